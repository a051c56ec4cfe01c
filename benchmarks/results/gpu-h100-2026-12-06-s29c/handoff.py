"""Per-bucket steps of the trainer in one warm ring sync of a --timeline run (gpu_bench.txt):
buckets published, the period between publishes, the trainer's time waiting for a free slot
(_tx_wait_free) and between a free slot and its publish (packing), and the receiver's time
from a release to its next fetch.

    python3 handoff.py now/gpu_bench.txt c1129/gpu_bench.txt
"""
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from timeline_costs import spans, timeline_blocks  # noqa: E402  (benchmarks/)


def syncs(path):
    for cfg, rows in timeline_blocks(path):
        yield json.dumps(cfg), rows


for path in sys.argv[1:]:
    for cfg, rows in syncs(path):
        end = max(t for t, _, _ in rows)
        pubs = spans(rows, "T", "_publish")
        waits = spans(rows, "T", "_tx_wait_free")
        starts = [a for a, _ in pubs]
        period = [b - a for a, b in zip(starts, starts[1:])]
        # a free slot's end to the next publish's start: the trainer's packing of that bucket
        packing = [next((p for p in starts if p >= b), b) - b for _, b in waits]
        rel = spans(rows, "R", "_rx_release")
        fetch = [a for a, _ in spans(rows, "R", "_rx_fetch")]
        gap = [next((f for f in fetch if f >= b), b) - b for _, b in rel]
        print(f"{path}: {cfg}")
        print(f"  sync {end:.2f} ms, {len(pubs)} publishes; period between publishes median "
              f"{statistics.median(period):.3f} ms, mean {statistics.mean(period):.3f}")
        print(f"  trainer: waiting for a free slot {sum(b - a for a, b in waits):.2f} ms in all "
              f"({len(waits)} waits), packing median {statistics.median(packing):.3f} ms, "
              f"publish median {statistics.median([b - a for a, b in pubs]):.3f} ms")
        print(f"  receiver: release to next fetch median {statistics.median(gap):.3f} ms, "
              f"release median {statistics.median([b - a for a, b in rel]):.3f} ms")
