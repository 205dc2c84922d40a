"""A kernel table from Nsight Compute's CSV (`ncu --csv --metrics gpu__time_duration.sum
--profile-from-start off …` around `bench-engine --profile` or `bench_torch.py --profile`):
GPU time per step by kind of work and the costliest kernels, for each file given, side by
side. Kernels are timed one at a time by ncu (serialised), so the sums are the GPU's busy
time without overlap, not the step's wall time.

    python3 kernel_table.py STEPS NAME=ours.csv NAME=compile.csv …
"""

import csv
import re
import sys
from collections import defaultdict

# Kinds of work, first match wins (cuDNN's, cuBLAS's, Triton's and our own kernel names).
KINDS = [
    ("conv backward filter", r"wgrad|dgrad_filter|bwd_filter|backward_filter|convolve_wgrad|wgrad"),
    ("conv backward data", r"dgrad|bwd_data|backward_data"),
    ("conv forward", r"fprop|conv|xmma|implicit_gemm|sm90_.*gemm|cutlass.*(conv|fprop)|nchwToNhwc|nhwcToNchw"),
    ("batch norm", r"bn_|batch_norm|batchnorm|BatchNorm|bn_fw|bn_bw|welford"),
    ("gemm (classifier)", r"gemm|cublas|cutlass"),
    ("optimizer", r"sgd|multi_tensor|fused_sgd|foreach"),
    ("weights to bf16 / grads to f32", r"kcrs_to_krsc|krsc_add_to_kcrs|convert|_to_copy"),
    ("relu / add / pool", r"relu|add_assign|max_pool|avg_pool|threshold|add|pool"),
    ("loss", r"softmax|cross_entropy|log_softmax|nll"),
    ("triton (fused elementwise)", r"^triton_"),
    ("memset / copy", r"memset|memcpy|copy|fill"),
]


def kind(name: str) -> str:
    for label, pattern in KINDS:
        if re.search(pattern, name, re.IGNORECASE):
            return label
    return "other"


def milliseconds(value: str, unit: str) -> float:
    v = float(value.replace(",", ""))
    return v * {"nsecond": 1e-6, "usecond": 1e-3, "msecond": 1.0, "second": 1e3}.get(unit, 1e-6)


def load(path: str):
    """Kernel name → total ms, and the number of launches, from the rows of
    gpu__time_duration.sum."""
    with open(path) as f:
        text = f.read()
    start = text.find('"ID"')
    rows = csv.DictReader(text[start:].splitlines())
    times = defaultdict(float)
    launches = 0
    for row in rows:
        if row.get("Metric Name") == "gpu__time_duration.sum":
            times[row["Kernel Name"]] += milliseconds(row["Metric Value"], row["Metric Unit"])
            launches += 1
    return times, launches


def main() -> None:
    steps = float(sys.argv[1])
    loaded = [(a.split("=", 1)[0], load(a.split("=", 1)[1])) for a in sys.argv[2:]]
    runs = [(name, times) for name, (times, _) in loaded]
    kinds = sorted({kind(k) for _, t in runs for k in t} | {"other"})
    print(f"{'ms per step':<34}" + "".join(f"{name:>14}" for name, _ in runs))
    for k in kinds:
        cells = [sum(v for n, v in t.items() if kind(n) == k) / steps for _, t in runs]
        if any(cells):
            print(f"{k:<34}" + "".join(f"{c:>14.2f}" for c in cells))
    print(f"{'all kernels':<34}" + "".join(f"{sum(t.values()) / steps:>14.2f}" for _, t in runs))
    print(f"{'kernel launches per step':<34}" + "".join(f"{n / steps:>14.0f}" for _, (_, n) in loaded))
    for name, t in runs:
        print(f"\n{name}: the 15 costliest kernels (ms per step)")
        for k, v in sorted(t.items(), key=lambda kv: -kv[1])[:15]:
            print(f"  {v / steps:8.3f}  {kind(k):<28} {k[:110]}")


if __name__ == "__main__":
    main()
