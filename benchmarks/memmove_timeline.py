"""Per sync and per process: bytes copied, seconds spent copying (busy), and the gaps, from
the traces ``memmove_trace/sitecustomize.py`` wrote; optionally one sync's copies in order.

    WEIGHTSYNC_MEMMOVE_TRACE=/tmp/mt PYTHONPATH=benchmarks/memmove_trace \\
        .venv/bin/weightsync bench --sizes 4 --receivers 1 --methods shm-buckets --no-hf --warm 3
    .venv/bin/python benchmarks/memmove_timeline.py /tmp/mt 4 [SYNC]

Syncs are told apart by bytes: each process's copies are cut into ``SYNCS`` equal shares
(run one method, so every sync copies the same bytes)."""
import glob
import json
import os
import sys


def main() -> None:
    folder, syncs = sys.argv[1], int(sys.argv[2])
    show = int(sys.argv[3]) if len(sys.argv) > 3 else -1
    per = {}
    for path in sorted(glob.glob(os.path.join(folder, "*.json"))):
        log = json.load(open(path))
        share, acc = sum(e[2] for e in log) / syncs, 0
        cut = [[] for _ in range(syncs)]
        for e in log:
            cut[min(syncs - 1, int((acc + e[2] / 2) // share))].append(e)
            acc += e[2]
        per[os.path.basename(path)[:-5]] = cut
    for k in range(syncs):
        t0 = min(p[k][0][0] for p in per.values() if p[k])
        t1 = max(p[k][-1][1] for p in per.values() if p[k])
        line = f"sync {k}: {t1 - t0:.3f} s"
        for pid, cut in per.items():
            busy = sum(e[1] - e[0] for e in cut[k])
            line += (f" | pid {pid}: {len(cut[k])} copies, {sum(e[2] for e in cut[k]) / 1e9:.2f} "
                     f"GB, busy {busy:.3f} s ({busy / (t1 - t0):.0%})")
        print(line)
    if show >= 0:
        events = sorted((e[0], e[1], e[2], pid) for pid, cut in per.items() for e in cut[show])
        t0 = events[0][0]
        for a, b, n, pid in events:
            print(f"{pid:>8} {1e3 * (a - t0):9.2f} {1e3 * (b - t0):9.2f} ms {n / 1e6:9.2f} MB "
                  f"{n / max(b - a, 1e-9) / 1e9:6.2f} GB/s")


if __name__ == "__main__":
    main()
