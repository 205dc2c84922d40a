"""Summarises `run.sh bench`'s rows (bench.jsonl): for every engine and batch, the median,
min and max of images/s over the repeats, the spread ((max - min) / median), the most
memory NVML saw for the whole process, and ours next to PyTorch's modes.

    python3 summarize.py bench.jsonl
"""

import json
import statistics
import sys
from collections import defaultdict


def label(row: dict) -> str:
    """The engine's name: PyTorch's mode, or ours with how its step ran."""
    if row["engine"].startswith("pytorch"):
        return row["engine"]
    name = "ours"
    if row.get("cudaGraph"):
        name += "-graph"
    if row.get("fromHost"):
        name += "-from-host"
    return name


def main(path: str) -> None:
    rows = [json.loads(line) for line in open(path) if line.strip().startswith("{")]
    by = defaultdict(list)
    for row in rows:
        if "imagesPerSecond" in row:
            by[(label(row), row["batchSize"])].append(row)
    median_of = {}
    print(f"{'engine':<34} {'batch':>5} {'n':>2} {'median':>8} {'min':>8} {'max':>8} {'spread':>7} {'NVML GB':>8} {'alloc GB':>8}")
    for (engine, batch), group in sorted(by.items(), key=lambda kv: (-kv[0][1], kv[0][0])):
        ips = [r["imagesPerSecond"] for r in group]
        median = statistics.median(ips)
        median_of[(engine, batch)] = median
        nvml = max((r.get("nvmlPeakBytes") or 0) for r in group) / 1e9
        alloc = max((r.get("peakBytes") or 0) for r in group) / 1e9
        spread = (max(ips) - min(ips)) / median
        print(f"{engine:<34} {batch:>5} {len(ips):>2} {median:>8.0f} {min(ips):>8.0f} {max(ips):>8.0f} {spread:>6.1%} {nvml:>8.2f} {alloc:>8.2f}")
    print()
    for batch in sorted({b for _, b in median_of}, reverse=True):
        ours = {e: v for (e, b), v in median_of.items() if b == batch and not e.startswith("pytorch")}
        theirs = {e: v for (e, b), v in median_of.items() if b == batch and e.startswith("pytorch")}
        for o, ov in sorted(ours.items()):
            ratios = ", ".join(f"{ov / tv:.2f}x {t}" for t, tv in sorted(theirs.items()))
            print(f"batch {batch}: {o} = {ratios}")


if __name__ == "__main__":
    main(sys.argv[1])
