"""Runs a command and says the most GPU memory its processes held, by NVML, the same way
for every engine (ours, PyTorch's): the command's output passes through, then one JSON
line `{"nvmlPeakBytes": …, "nvmlDefinition": …}` on stdout.

    python3 nvml_peak.py [--interval 0.05] [--out FILE --tag KEY=VALUE…] -- COMMAND ARGS…

With --out, the command's last JSON line that has `imagesPerSecond` (a benchmark's row)
is appended to FILE with the NVML fields and the tags added (`run.sh bench` collects its
rows so).

The figure is the largest sum, over one sample, of `usedGpuMemory` of the command's
processes (and their children) as `nvmlDeviceGetComputeRunningProcesses` reports them: the
whole process, context, libraries and allocator included. Where NVML cannot tell memory
per process (some containers hide the PIDs), it falls back to the device's used memory less
what was used before the command started, and says so in `nvmlDefinition`.
"""

import argparse
import json
import os
import subprocess
import sys
import threading
import time

import pynvml


def descendants(root: int) -> set:
    """`root` and every process under it, from /proc."""
    children = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
            parent = int(stat[stat.rfind(")") + 2 :].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(parent, []).append(int(entry))
    found, todo = set(), [root]
    while todo:
        pid = todo.pop()
        if pid not in found:
            found.add(pid)
            todo.extend(children.get(pid, []))
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--interval", type=float, default=0.05)
    parser.add_argument("--gpu", type=int, default=0)
    parser.add_argument("--out", help="append the command's benchmark row, with the NVML figures, to this file")
    parser.add_argument("--tag", action="append", default=[], help="KEY=VALUE added to that row")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command")
    pynvml.nvmlInit()
    device = pynvml.nvmlDeviceGetHandleByIndex(args.gpu)
    baseline = pynvml.nvmlDeviceGetMemoryInfo(device).used
    child = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    peak = {"process": 0, "device": 0, "seen": False}

    def sample() -> None:
        while child.poll() is None:
            ours = descendants(child.pid)
            try:
                running = pynvml.nvmlDeviceGetComputeRunningProcesses(device)
            except pynvml.NVMLError:
                running = []
            used = [p.usedGpuMemory for p in running if p.pid in ours and p.usedGpuMemory is not None]
            if used:
                peak["seen"] = True
                peak["process"] = max(peak["process"], sum(used))
            peak["device"] = max(peak["device"], pynvml.nvmlDeviceGetMemoryInfo(device).used - baseline)
            time.sleep(args.interval)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    row = None
    for text in child.stdout:
        sys.stdout.write(text)
        sys.stdout.flush()
        try:
            parsed = json.loads(text)
        except ValueError:
            continue
        if isinstance(parsed, dict) and "imagesPerSecond" in parsed:
            row = parsed
    code = child.wait()
    sampler.join()
    line = {
        "nvmlPeakBytes": peak["process"] if peak["seen"] else peak["device"],
        "nvmlDefinition": "the command's processes' usedGpuMemory (NVML), largest sum of one sample"
        if peak["seen"]
        else "the device's used memory less its use before the command (NVML; no per-process figures here)",
        "nvmlDevicePeakBytes": peak["device"],
        "exitCode": code,
    }
    print(json.dumps(line), flush=True)
    if args.out and row is not None:
        row.update(line)
        for tag in args.tag:
            key, _, value = tag.partition("=")
            row[key] = int(value) if value.isdigit() else value
        with open(args.out, "a") as out:
            out.write(json.dumps(row) + "\n")
    return code


if __name__ == "__main__":
    sys.exit(main())
