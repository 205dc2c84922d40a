#!/usr/bin/env python3
"""Horovod with PyTorch under Ringmaster: the sample of a Horovod job (`spec.command`).

Horovod reads its ranks from MPI itself (`hvd.init()` under Ringmaster's `mpirun`), so it
needs none of the variables Ringmaster sets for PyTorch DDP. As in the DDP sample, rank 0
prints Ringmaster's JSON lines: with `ringmaster-trainer` in the image, the job's status shows
the progress and the result, and an exception's last line becomes the job's failure message.
Not run by Ringmaster's own tests (Horovod is built from source against PyTorch, with MPI
and NCCL: see the Dockerfile); the DDP sample is.
"""
import argparse
import json
import time

import horovod.torch as hvd
import torch
import torch.nn.functional as F
from torch import nn


def say(event, **fields):
    """One line of Ringmaster's contract (`ringmaster-contract`'s `trainer::Line`)."""
    print(json.dumps({"event": event, **fields}), flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=64, help="images per rank and step")
    parser.add_argument("--learning-rate", type=float, default=0.02)
    parser.add_argument("--log-every", type=int, default=10)
    args = parser.parse_args()

    hvd.init()
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(hvd.local_rank())
    device = torch.device("cuda" if cuda else "cpu")
    classes, size = 10, 32
    model = nn.Sequential(
        nn.Conv2d(3, 16, 3, stride=2, padding=1), nn.ReLU(),
        nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, classes),
    ).to(device)
    # Horovod's rule: scale the learning rate by the ranks, average the gradients.
    optimizer = torch.optim.SGD(model.parameters(), lr=args.learning_rate * hvd.size(), momentum=0.9)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    patterns = torch.randn(classes, 3, size, size, generator=torch.Generator().manual_seed(1))
    draw = torch.Generator().manual_seed(1000 + hvd.rank())

    started = time.monotonic()
    loss = accuracy = None
    for step in range(1, args.steps + 1):
        labels = torch.randint(0, classes, (args.batch_size,), generator=draw)
        images = patterns[labels] + torch.randn(args.batch_size, 3, size, size, generator=draw)
        images, labels = images.to(device), labels.to(device)
        logits = model(images)
        batch_loss = F.cross_entropy(logits, labels)
        optimizer.zero_grad()
        batch_loss.backward()
        optimizer.step()
        if step % args.log_every == 0 or step == args.steps:
            loss = hvd.allreduce(batch_loss.detach(), name="loss").item()
            accuracy = hvd.allreduce((logits.argmax(1) == labels).float().mean(), name="accuracy").item()
            rate = step * args.batch_size * hvd.size() / (time.monotonic() - started)
            if hvd.rank() == 0:
                say("step", step=step, totalSteps=args.steps, loss=loss, accuracy=accuracy,
                    learningRate=args.learning_rate * hvd.size(), imagesPerSecond=rate)
    seconds = time.monotonic() - started
    if hvd.rank() == 0:
        say("summary", imagesPerSecond=args.steps * args.batch_size * hvd.size() / seconds,
            steps=args.steps, finalLoss=loss, finalAccuracy=accuracy, worldSize=hvd.size(),
            globalBatch=args.batch_size * hvd.size(),
            parameters=sum(p.numel() for p in model.parameters()), seconds=seconds)


if __name__ == "__main__":
    main()
