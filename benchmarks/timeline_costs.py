"""The ``cuda_ipc`` ring trainer's host costs, read off ``gpu_bench.py --timeline`` outputs.

A ``--timeline`` run prints, per engine configuration, both processes' engine steps of each
warm sync on one clock (a ``timeline: warm sync k of n`` block each; an output with no
such line holds the last warm sync alone). Per sync (:func:`syncs`) this takes,
from the trainer's steps:

* packing: from the end of each wait for a free slot (``_tx_wait_free``) to the start of
  the next publish (the tensors of that bucket copied into its slot);
* publishing: each ``_publish`` span;
* slot waits: each ``_tx_wait_free`` span (the slot's trip to the receivers and back that
  the trainer's own work did not hide);
* host: everything from the start of the first slot wait to the end of the last publish
  but the slot waits: packing and publishing, and the trainer's loop between a publish and
  its next slot wait.

:func:`host_costs` turns the syncs of one code on one host, ordered by events (``sync``
``"event"``) and at two or more bucket sizes, into the planner's ``software`` costs (us):
``tensor_us`` and ``bucket_us`` are the intercept (over the model's tensors) and the slope of
the least-squares line of the host time against the number of buckets, and
``handoff_us`` is the slot waits per bucket at the smallest bucket size timed. A run that
printed several syncs of a configuration gives one point per bucket size: the median of
its syncs' host times and of their slot waits and publishes (one slow sync, a stall of
the host, then moves no cost). This is how the GPU presets' costs were read.

``finish_us`` is what a sync takes outside the trainer's loop (before its first slot wait
and after its last publish: the closing message, the receivers' last bucket and their
final acknowledgement) beyond one bucket's pack and unpack at the flat copy's rate (the
pipeline's fill and drain, which the planner prices already), at the smallest bucket size
timed, where the GPU has the least queued behind the trainer.

    python3 benchmarks/timeline_costs.py DIR [DIR ...]   # each DIR: gpu_bench.txt + .json

The last line printed is the costs as ``weightsync plan`` arguments (``--link-set
software.tensor_us=...``): a plan priced with the host that ran the timelines.
"""

from __future__ import annotations

import json
import math
import os
import re
import statistics
import sys
from dataclasses import dataclass

_STEP = re.compile(r"\s+([\d.]+) ms  ([TR]) (\S+)")


@dataclass(frozen=True)
class SyncSteps:
    """The trainer's steps in one timed sync of a ``--timeline`` run (milliseconds)."""
    cfg: dict
    publishes: int
    packing_ms: float
    publish_ms: float
    host_ms: float           # packing, publishing and the loop between (see the module doc)
    wait_ms: float
    sync_ms: float


def spans(rows: list, side: str, step: str) -> list[tuple[float, float]]:
    """(start, end) of each ``step`` of one side (``"T"`` trainer, ``"R"`` receiver)."""
    out, start = [], None
    for t, who, name in rows:
        if who != side:
            continue
        if name == step + ">":
            start = t
        elif name == "<" + step and start is not None:
            out.append((start, t))
            start = None
    return out


def timeline_blocks(path: str) -> list[tuple[dict, list[tuple[float, str, str]]]]:
    """Each printed sync of one ``gpu_bench.txt`` of a ``--timeline`` run: its engine config
    and its steps, (ms, side, step) in order; a configuration's syncs one after another."""
    blocks, cfg, rows = [], None, []
    with open(path) as f:
        for line in f:
            start = line.startswith("engine ")
            if start or line.startswith("timeline: warm sync "):
                if cfg is not None and rows:
                    blocks.append((cfg, rows))
                if start:
                    cfg = json.loads(line[len("engine "):])["cfg"]
                rows = []
                continue
            m = _STEP.match(line)
            if m and cfg is not None:
                rows.append((float(m.group(1)), m.group(2), m.group(3)))
    if cfg is not None and rows:
        blocks.append((cfg, rows))
    return blocks


def syncs(path: str) -> list[SyncSteps]:
    """Each printed sync in one ``gpu_bench.txt`` of a ``--timeline`` run."""
    out = []
    for cfg, rows in timeline_blocks(path):
        pubs, waits = spans(rows, "T", "_publish"), spans(rows, "T", "_tx_wait_free")
        if not pubs:
            continue
        starts = [a for a, _ in pubs]
        packing = [next((p for p in starts if p >= b), b) - b for _, b in waits]
        publish, wait = sum(b - a for a, b in pubs), sum(b - a for a, b in waits)
        host = pubs[-1][1] - waits[0][0] - wait if waits else publish
        out.append(SyncSteps(cfg, len(pubs), sum(packing), publish, host, wait,
                             max(t for t, _, _ in rows)))
    return out


def _plain_ring(cfg: dict) -> bool:
    """The ring as users run it (consumed by ``receive_weights`` + copy or ``receive_into``),
    not zero-copy, pushes or the bench's diagnostic variants (stream waits, no links, ...)."""
    return not cfg.get("zero_copy") and cfg.get("consume", "copy") in ("copy", "into") \
        and set(cfg) <= {"bucket_size", "num_slots", "zero_copy", "sync", "consume"}


def median_syncs(steps: list[SyncSteps]) -> dict[int, SyncSteps]:
    """One run's syncs of one ordering, by bucket size: each field the median over the
    syncs printed at that size (one sync: itself)."""
    by_size: dict[int, list[SyncSteps]] = {}
    for s in steps:
        by_size.setdefault(s.cfg["bucket_size"], []).append(s)
    out = {}
    for size, group in by_size.items():
        def mid(field: str) -> float:
            return statistics.median(getattr(s, field) for s in group)
        out[size] = SyncSteps(group[0].cfg, round(mid("publishes")), mid("packing_ms"),
                              mid("publish_ms"), mid("host_ms"), mid("wait_ms"),
                              mid("sync_ms"))
    return out


def run_info(run_dir: str) -> tuple[int, float, int]:
    """Tensors of the model a run synced (its ``gpu_bench.json``'s ``layers``), its flat
    copy of that model (``d2d`` ``flat_ms``) and the model's bytes (``d2d`` ``bytes``, else
    its shapes in bf16)."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    try:
        from gpu_bench import model_shapes
    finally:
        sys.path.pop(0)
    with open(os.path.join(run_dir, "gpu_bench.json")) as f:
        doc = json.load(f)
    shapes = model_shapes(doc["layers"])
    nbytes = doc["d2d"].get("bytes") or 2 * sum(math.prod(shape) for _, shape in shapes)
    return len(shapes), float(doc["d2d"]["flat_ms"]), int(nbytes)


def host_costs(run_dirs: list[str]) -> dict[str, float]:
    """``software.tensor_us`` / ``bucket_us`` / ``handoff_us`` / ``finish_us`` (us) from the
    event-ordered plain ring syncs (:func:`_plain_ring`) of ``--timeline`` runs of one code
    on one host; raises ``ValueError`` unless the event-ordered syncs span two bucket sizes."""
    points, tensors, outside = [], set(), []
    for d in run_dirs:
        ring = [s for s in syncs(os.path.join(d, "gpu_bench.txt")) if _plain_ring(s.cfg)]
        event = median_syncs([s for s in ring if s.cfg.get("sync") == "event"])
        if not event:
            continue
        count, flat_ms, nbytes = run_info(d)
        tensors.add(count)
        points += list(event.items())
        # outside the trainer's loop, beyond one bucket's pack and unpack: (size, ms)
        outside += [(b, s.sync_ms - s.host_ms - s.wait_ms - 2 * flat_ms * min(b, nbytes) / nbytes)
                    for b, s in event.items()]
    if len({b for b, _ in points}) < 2 or len(tensors) != 1:
        raise ValueError(f"need event ring syncs at two bucket sizes of one model, got "
                         f"{sorted({b >> 20 for b, _ in points})} MiB of {sorted(tensors)} tensors")
    xs = [s.publishes for _, s in points]
    ys = [s.host_ms for _, s in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    intercept = my - slope * mx
    small = min(b for b, _ in points)
    at_small = [s for b, s in points if b == small]
    handoff = sum(s.wait_ms for s in at_small) / sum(s.publishes for s in at_small)
    finish = [ms for b, ms in outside if b == small]
    out = {"software.tensor_us": round(intercept / tensors.pop() * 1e3, 1),
           "software.bucket_us": round(slope * 1e3, 1),
           "software.handoff_us": round(handoff * 1e3, 1),
           "software.finish_us": round(max(0.0, sum(finish) / len(finish)) * 1e3, 1)}
    return out


def main(argv: list[str]) -> None:
    for d in argv:
        for s in syncs(os.path.join(d, "gpu_bench.txt")):
            print(f"{d}: {json.dumps(s.cfg)}: {s.publishes} publishes, packing "
                  f"{s.packing_ms:.2f} ms, publishing {s.publish_ms:.2f} ms, host "
                  f"{s.host_ms:.2f} ms, slot waits {s.wait_ms:.2f} ms, sync {s.sync_ms:.2f} ms")
    costs = host_costs(argv)
    print(costs)
    # the same costs as `weightsync plan` arguments: this host's ring, priced
    print(" ".join(f"--link-set {k}={v:g}" for k, v in costs.items()))


if __name__ == "__main__":
    main(sys.argv[1:])
