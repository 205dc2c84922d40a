"""PyTorch's ResNet-50 training step on the same GPU, as `make bench-gpu` compares it.

torchvision `resnet50`, channels_last, bf16 autocast, SGD with momentum and weight decay,
`cudnn.benchmark=True`, one synthetic batch already on the device (as our `bench-engine`).
Modes, each the strongest form of a common way to run PyTorch:

* `eager`: the plain loop, `SGD(foreach)` (PyTorch's default).
* `fused`: eager with `SGD(fused=True)`: one multi-tensor kernel for the update.
* `graph`: eager with the whole step (forward, backward, fused SGD) captured as one CUDA
  graph and replayed (PyTorch's "whole network capture"), static inputs.
* `compile`: `torch.compile` of the step, default mode, fused SGD.
* `max-autotune`: `torch.compile(mode="max-autotune")`: Triton templates and GEMM/conv
  autotuning, CUDA graphs.

One JSON line per (mode, batch): images/s over the timed steps, and memory: the allocator's
most allocated and reserved bytes (`deviceUsedBytes`, what the whole device had in use at
the end; the NVML figure for the whole process comes from `nvml_peak.py` around this).
"""

import argparse
import json
import time

import torch
import torchvision

MODES = ["eager", "fused", "graph", "compile", "max-autotune"]


def used_on_device() -> int:
    free, total = torch.cuda.mem_get_info()
    return total - free


def make_step(mode: str, model, images, labels):
    optimizer = torch.optim.SGD(
        model.parameters(),
        lr=0.01,
        momentum=0.9,
        weight_decay=5e-5,
        fused=mode != "eager",
    )
    loss_fn = torch.nn.CrossEntropyLoss()
    # Inside a graph autocast must not cache its casts (they would be made once, outside).
    autocast_cache = mode != "graph"

    def step(zero_grad=True):
        if zero_grad:
            optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=autocast_cache):
            loss = loss_fn(model(images), labels)
        loss.backward()
        optimizer.step()

    if mode == "compile":
        return torch.compile(step)
    if mode == "max-autotune":
        return torch.compile(step, mode="max-autotune")
    if mode == "graph":
        # Warm up on a side stream (cuDNN's search, the optimizer's state), then capture.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                step()
        torch.cuda.current_stream().wait_stream(side)
        # As PyTorch's guide does: gradients set to None before the capture, so backward
        # makes them in the graph's own memory, and every replay writes them anew.
        optimizer.zero_grad(set_to_none=True)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step(zero_grad=False)
        return graph.replay
    return step


def measure(mode: str, batch: int, steps: int, warmup: int, profile: bool = False) -> dict:
    torch.backends.cudnn.benchmark = True
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    model = torchvision.models.resnet50(num_classes=1000).cuda().to(memory_format=torch.channels_last)
    images = torch.randn(batch, 3, 224, 224, device="cuda").to(memory_format=torch.channels_last)
    labels = torch.randint(0, 1000, (batch,), device="cuda")
    started = time.perf_counter()
    step = make_step(mode, model, images, labels)
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    warm_seconds = time.perf_counter() - started
    if profile:
        torch.cuda.profiler.start()
    started = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    if profile:
        torch.cuda.profiler.stop()
    return {
        "engine": f"pytorch-{mode}",
        "model": "resnet50",
        "batchSize": batch,
        "precision": "bf16",
        "steps": steps,
        "imagesPerSecond": steps * batch / seconds,
        "stepMs": seconds * 1000 / steps,
        "warmupSeconds": warm_seconds,
        "peakBytes": torch.cuda.max_memory_allocated(),
        "reservedBytes": torch.cuda.max_memory_reserved(),
        "deviceUsedBytes": used_on_device(),
        "torch": torch.__version__,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, action="append", default=None)
    parser.add_argument("--mode", choices=MODES, action="append", default=None)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--profile", action="store_true", help="bracket the timed steps with cudaProfilerStart/Stop (for ncu --profile-from-start off)")
    args = parser.parse_args()
    for mode in args.mode or ["eager", "compile"]:
        for batch in args.batch or [256, 128]:
            print(json.dumps(measure(mode, batch, args.steps, args.warmup, args.profile)), flush=True)


if __name__ == "__main__":
    main()
