"""PyTorch's ResNet-50 training step on the same GPU, as `make bench-gpu` compares it.

torchvision `resnet50`, channels_last, bf16 autocast, SGD with momentum,
`cudnn.benchmark=True`, one synthetic batch already on the device (as our
`bench-engine`). Eager, then `torch.compile`. One JSON line per (mode, batch):
images/s and memory: `torch.cuda.max_memory_allocated` (tensors), `max_memory_reserved`
(the caching allocator) and what the whole process holds on the device at the end.
"""

import argparse
import json
import time

import torch
import torchvision


def used_on_device() -> int:
    free, total = torch.cuda.mem_get_info()
    return total - free


def measure(mode: str, batch: int, steps: int, warmup: int) -> dict:
    torch.backends.cudnn.benchmark = True
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    model = torchvision.models.resnet50(num_classes=1000).cuda().to(memory_format=torch.channels_last)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=5e-5)
    loss_fn = torch.nn.CrossEntropyLoss()
    images = torch.randn(batch, 3, 224, 224, device="cuda").to(memory_format=torch.channels_last)
    labels = torch.randint(0, 1000, (batch,), device="cuda")

    def step():
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = loss_fn(model(images), labels)
        loss.backward()
        optimizer.step()

    if mode == "compiled":
        step = torch.compile(step)
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    return {
        "engine": f"pytorch-{mode}",
        "model": "resnet50",
        "batchSize": batch,
        "precision": "bf16",
        "steps": steps,
        "imagesPerSecond": steps * batch / seconds,
        "stepMs": seconds * 1000 / steps,
        "peakBytes": torch.cuda.max_memory_allocated(),
        # Beside the tensors: what the caching allocator held at most, and what the whole
        # process held on the GPU at the end (context and kernels too), as ours counts.
        "reservedBytes": torch.cuda.max_memory_reserved(),
        "deviceUsedBytes": used_on_device(),
        "torch": torch.__version__,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch", type=int, action="append", default=None)
    parser.add_argument("--mode", choices=["eager", "compiled"], action="append", default=None)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=10)
    args = parser.parse_args()
    for mode in args.mode or ["eager", "compiled"]:
        for batch in args.batch or [256, 128]:
            print(json.dumps(measure(mode, batch, args.steps, args.warmup)), flush=True)


if __name__ == "__main__":
    main()
