#!/usr/bin/env python3
"""PyTorch DistributedDataParallel under Ringmaster: the sample of a job that brings its own
program (`spec.command`).

Ringmaster's launcher starts every rank with `mpirun`, and each rank finds the variables
PyTorch's `init_process_group` reads with `init_method="env://"` (its default): `RANK`,
`WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR` (worker 0) and
`MASTER_PORT`. Nothing here is Ringmaster's but the JSON lines rank 0 prints: with
`ringmaster-trainer` in the image, the launcher reads them and the job's status shows the
progress (`kubectl get tj`: PROGRESS, ETA) and the result, as it does for the built-in
trainer (docs/progress.md). An exception ends the job with its last line in the job's
message.

It trains a small network on a learnable synthetic set (each class a fixed pattern plus
noise; each rank draws its own samples), on the GPU with NCCL when there is one, else on the
CPU with gloo. Replace the model and the data with yours.
"""
import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel


def say(event, **fields):
    """One line of Ringmaster's contract (`ringmaster-contract`'s `trainer::Line`)."""
    print(json.dumps({"event": event, **fields}), flush=True)


def arguments():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="steps to train")
    parser.add_argument("--batch-size", type=int, default=64, help="images per rank and step")
    parser.add_argument("--learning-rate", type=float, default=0.02)
    parser.add_argument("--log-every", type=int, default=10, help="steps between progress lines")
    parser.add_argument("--image-size", type=int, default=32)
    return parser.parse_args()


def main():
    args = arguments()
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    # One thread per rank: the ranks of a worker share its cores.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))

    classes, size = 10, args.image_size
    torch.manual_seed(0)  # the same initial weights on every rank (DDP also broadcasts rank 0's)
    model = nn.Sequential(
        nn.Conv2d(3, 16, 3, stride=2, padding=1), nn.ReLU(),
        nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, classes),
    ).to(device)
    model = DistributedDataParallel(model, device_ids=[local_rank] if cuda else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.learning_rate, momentum=0.9)
    patterns = torch.randn(classes, 3, size, size, generator=torch.Generator().manual_seed(1))
    draw = torch.Generator().manual_seed(1000 + rank)
    parameters = sum(p.numel() for p in model.parameters())

    started = window_started = time.monotonic()
    window_steps = 0
    loss = accuracy = None
    for step in range(1, args.steps + 1):
        labels = torch.randint(0, classes, (args.batch_size,), generator=draw)
        images = patterns[labels] + torch.randn(args.batch_size, 3, size, size, generator=draw)
        images, labels = images.to(device), labels.to(device)
        logits = model(images)
        batch_loss = F.cross_entropy(logits, labels)
        optimizer.zero_grad(set_to_none=True)
        batch_loss.backward()
        optimizer.step()
        window_steps += 1
        if step % args.log_every == 0 or step == args.steps:
            # The mean over the ranks, as the built-in trainer reports it.
            figures = torch.stack([batch_loss.detach(), (logits.argmax(1) == labels).float().mean()])
            dist.all_reduce(figures)
            loss, accuracy = (figures / world).tolist()
            now = time.monotonic()
            images_per_step = args.batch_size * world
            if rank == 0:
                say("step", step=step, totalSteps=args.steps, loss=loss, accuracy=accuracy,
                    learningRate=args.learning_rate,
                    imagesPerSecond=step * images_per_step / (now - started),
                    recentImagesPerSecond=window_steps * images_per_step / (now - window_started))
            window_started, window_steps = now, 0

    seconds = time.monotonic() - started
    if rank == 0:
        say("summary", imagesPerSecond=args.steps * args.batch_size * world / seconds,
            steps=args.steps, finalLoss=loss, finalAccuracy=accuracy, worldSize=world,
            globalBatch=args.batch_size * world, parameters=parameters, seconds=seconds)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
