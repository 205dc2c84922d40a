"""One ResNet-50 training step of ours against PyTorch's from the same weights and batch,
tensor by tensor: `ringmaster-trainer bench-engine --dump-step DIR` writes ours
(before.safetensors: weights, statistics, batch; after.safetensors: gradients, statistics
after the step, the loss), then this runs torchvision's resnet50 on the same batch twice:
in bf16 autocast with channels_last (as ours computes) and in fp32 (the reference).

Each gradient and statistic is compared to the fp32 reference by ‖x − ref‖ / ‖ref‖, for
ours and for PyTorch's own bf16 step: ours should be as close to fp32 as PyTorch's bf16 is
(bf16 keeps 8 bits of mantissa, so neither is exact). Prints a table of the worst tensors
and the medians, and one JSON line with the summary.

    python3 compare_step.py DIR
"""

import json
import statistics
import sys

import torch
import torchvision
from safetensors import safe_open
from safetensors.torch import load_file


def step(before: dict, images, labels, classes: int, bf16: bool):
    model = torchvision.models.resnet50(num_classes=classes).cuda()
    state = {k: v for k, v in before.items() if k not in ("images", "labels")}
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected, unexpected
    assert all(k.endswith("num_batches_tracked") for k in missing), missing
    model.train()
    if bf16:
        model = model.to(memory_format=torch.channels_last)
        images = images.to(memory_format=torch.channels_last)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
        loss = torch.nn.functional.cross_entropy(model(images), labels)
    loss.backward()
    grads = {name: p.grad.float() for name, p in model.named_parameters()}
    stats = {name: b.float() for name, b in model.named_buffers() if not name.endswith("num_batches_tracked")}
    return loss.item(), grads, stats


def relative(x, ref) -> float:
    return (torch.linalg.vector_norm(x - ref) / torch.linalg.vector_norm(ref).clamp_min(1e-30)).item()


def main(folder: str) -> None:
    torch.backends.cudnn.benchmark = False
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    before = {k: v.cuda() for k, v in load_file(f"{folder}/before.safetensors").items()}
    after = {k: v.cuda() for k, v in load_file(f"{folder}/after.safetensors").items()}
    with safe_open(f"{folder}/before.safetensors", "pt") as f:
        meta = f.metadata()
    with safe_open(f"{folder}/after.safetensors", "pt") as f:
        our_loss = float(f.metadata()["loss"])
    batch, size, classes = int(meta["batchSize"]), int(meta["imageSize"]), int(meta["classes"])
    images = before["images"].reshape(batch, 3, size, size)
    labels = before["labels"].long()
    ref_loss, ref_grads, ref_stats = step(before, images, labels, classes, bf16=False)
    if meta.get("precision") == "fp32":
        # Ours in fp32 against PyTorch in fp32 (no TF32 on either side): the same arithmetic,
        # so every tensor should agree to rounding.
        rows = sorted(
            ((name, relative(after[name], ref)) for name, ref in list(ref_grads.items()) + list(ref_stats.items())),
            key=lambda r: -r[1],
        )
        for name, d in rows[:8]:
            print(f"{name:<40} {d:>13.2e}")
        print(json.dumps({"precision": "fp32", "tensors": len(rows), "lossOurs": our_loss, "lossTorchFp32": ref_loss,
                          "worst": rows[0][1], "median": statistics.median(r[1] for r in rows)}))
        return
    bf_loss, bf_grads, bf_stats = step(before, images, labels, classes, bf16=True)
    rows = []
    for name, ref in list(ref_grads.items()) + list(ref_stats.items()):
        theirs = bf_grads.get(name, bf_stats.get(name))
        rows.append((name, relative(after[name], ref), relative(theirs, ref)))
    rows.sort(key=lambda r: -r[1])
    print(f"{'tensor':<40} {'ours vs fp32':>13} {'torch bf16 vs fp32':>19}")
    for name, ours, theirs in rows[:12]:
        print(f"{name:<40} {ours:>13.2e} {theirs:>19.2e}")
    grads = [r for r in rows if not r[0].endswith(("running_mean", "running_var"))]
    summary = {
        "tensors": len(rows),
        "lossOurs": our_loss,
        "lossTorchBf16": bf_loss,
        "lossTorchFp32": ref_loss,
        "gradientsMedianOurs": statistics.median(r[1] for r in grads),
        "gradientsMedianTorchBf16": statistics.median(r[2] for r in grads),
        "gradientsMaxOurs": max(r[1] for r in grads),
        "gradientsMaxTorchBf16": max(r[2] for r in grads),
        "statisticsMaxOurs": max((r[1] for r in rows if r not in grads), default=0.0),
        "statisticsMaxTorchBf16": max((r[2] for r in rows if r not in grads), default=0.0),
        "tensorsOursWorseThan2xTorch": sum(1 for r in grads if r[1] > 2 * r[2] + 1e-6),
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main(sys.argv[1])
