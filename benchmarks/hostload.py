"""What else the host's CPUs did while each bench ran: reads a ``hostload.txt`` that a device
script wrote beside its runs (``devcode``-style ``run.sh`` of session 31 on):

    S <unix s> cpu <user> <nice> <system> <idle> <iowait> <irq> <softirq> <steal> ... <loadavg 1 5 15> <r/t> <pid>
    B <unix s> <run>        (a bench started)
    E <unix s> <run>        (it ended)

``S`` lines are samples of ``/proc/stat``'s aggregate ``cpu`` line and ``/proc/loadavg``.
For each run (``B`` .. ``E``) it prints the share of all CPUs busy (user + nice + system +
irq + softirq over every jiffy, the run's own processes included), the share stolen by
the hypervisor (``steal``), and the highest 1-minute load average sampled.

    python3 benchmarks/hostload.py benchmarks/results/gpu-h100-2026-12-06-s31/hostload.txt
"""

from __future__ import annotations

import argparse
import bisect
import dataclasses
from typing import Optional

__all__ = ["RunLoad", "read", "main"]


@dataclasses.dataclass(frozen=True)
class RunLoad:
    """One bench's window and what the host did in it."""

    run: str
    seconds: float
    busy: float          # share of every CPU's jiffies spent busy (0..1)
    steal: float         # share of every CPU's jiffies stolen (0..1)
    load1_max: float     # highest 1-minute load average sampled in the window


def _sample(parts: list[str]) -> tuple[float, list[int], float]:
    t = float(parts[1])
    if parts[2] != "cpu":
        raise ValueError(f"not a /proc/stat cpu line: {' '.join(parts[:4])}")
    nums = []
    for p in parts[3:]:
        if "." in p or "/" in p:
            break
        nums.append(int(p))
    load1 = float(parts[3 + len(nums)])
    return t, nums, load1


def read(path: str) -> list[RunLoad]:
    """Each run of the file, in order, with its host load (the samples nearest its start
    and end, the ones inside it for the load average)."""
    samples: list[tuple[float, list[int], float]] = []
    marks: list[tuple[str, float, str]] = []
    with open(path) as f:
        for line in f:
            parts = line.split()
            if not parts:
                continue
            if parts[0] == "S":
                samples.append(_sample(parts))
            elif parts[0] in ("B", "E") and len(parts) >= 3:
                marks.append((parts[0], float(parts[1]), parts[2]))
    samples.sort(key=lambda s: s[0])
    times = [s[0] for s in samples]
    out: list[RunLoad] = []
    start: Optional[tuple[float, str]] = None
    for kind, t, run in marks:
        if kind == "B":
            start = (t, run)
            continue
        if start is None or start[1] != run:
            continue
        t0, _ = start
        start = None
        i = max(bisect.bisect_right(times, t0) - 1, 0)
        j = min(bisect.bisect_left(times, t), len(samples) - 1)
        if j <= i:
            continue
        a, b = samples[i][1], samples[j][1]
        d = [y - x for x, y in zip(a, b)]
        total = sum(d[:8]) or 1
        idle = d[3] + d[4]
        busy = (total - idle - d[7]) / total
        inside = [s[2] for s in samples[i:j + 1]]
        out.append(RunLoad(run=run, seconds=t - t0, busy=busy, steal=d[7] / total,
                           load1_max=max(inside)))
    return out


def main(argv: Optional[list[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("path", help="a hostload.txt")
    args = ap.parse_args(argv)
    print(f"{'run':<12} {'s':>6} {'busy %':>7} {'steal %':>8} {'load1 max':>10}")
    for r in read(args.path):
        print(f"{r.run:<12} {r.seconds:6.1f} {r.busy * 100:7.1f} {r.steal * 100:8.2f} "
              f"{r.load1_max:10.2f}")


if __name__ == "__main__":
    main()
