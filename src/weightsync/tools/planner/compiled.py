"""The point-to-point pull plan of a whole model, from :func:`compile_plan`, aggregated.

Owns :func:`pull_stats`: bytes and READs per (trainer rank, worker of one replica), every
figure taken from :func:`weightsync.core.xferplan.compile_plan` (the code the ``nixl``
backend runs). A model of a thousand tensors into 128 workers compiled as one plan would
hold millions of reads (a row-parallel shard is one read per row), so the planner
compiles it in pieces and multiplies, exactly, as follows:

1. *One compile per distinct tensor layout.* Tensors with the same (shape, rule, dtypes,
   boxes of every worker) -- the same projection in every layer -- share one compile,
   multiplied by their count. Each tensor is held in its own region and lands in its own
   buffer (no read spans two tensors, as in the backend when tensors are not adjacent).
2. *One worker per distinct box signature, one replica.* Trainer ranks hold FSDP2
   ``Shard(0)`` ranges (``torch.chunk`` rows, as :func:`~weightsync.transport.backends
   .nixl.layout.held_part` serves them): every byte has one holder, so no balancing choice
   couples workers, and a worker's reads per rank depend only on its boxes' dim-0 ranges
   and their extents elsewhere (a run lies within one row). Workers alike in that
   (replicas, EP groups for attention, TP ranks of a row-parallel layer) share one.
3. *Dimensions nobody splits, before the one a worker splits*, are compiled at size 1
   and the reads and bytes multiplied by their size (e.g. dim 1 of an expert tensor
   ``[E, H, I]`` whose dim 2 is TP-split: each index of it is one more run of the same
   length from the same rank, never coalesced with its neighbour).

``tests/test_planner.py`` checks that this equals one compile of a small model whole.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np

from weightsync.core.plan import itemsize
from weightsync.core.xferplan import DestLayout, HeldRange, SourceLayout, Want, compile_plan
from weightsync.tools.planner.rules import PlannedTensor

__all__ = ["PullStats", "ClassStat", "pull_stats", "held_rows", "reduce_dims"]


@dataclass
class ClassStat:
    """One compile: its representative tensor, how many tensors it stands for."""

    name: str
    count: int
    shape: tuple[int, ...]
    rule: str
    factor: int
    reads: int           # per replica, all tensors of the class
    wire_bytes: int
    digest: str
    seconds: float


@dataclass
class PullStats:
    """Per (trainer rank, worker of one replica): wire bytes and READs."""

    pair_bytes: np.ndarray
    pair_reads: np.ndarray
    classes: list[ClassStat] = field(default_factory=list)
    compile_seconds: float = 0.0

    @property
    def compile_calls(self) -> int:
        return len(self.classes)


def held_rows(rows: int, world: int, rank: int) -> tuple[int, int]:
    """Rows ``[a, b)`` of dim 0 that FSDP2 ``Shard(0)`` gives ``rank`` (torch.chunk)."""
    chunk = -(-rows // world) if rows else 0
    return min(rank * chunk, rows), min((rank + 1) * chunk, rows)


def reduce_dims(shape: tuple[int, ...], boxes: Sequence) -> tuple[tuple[int, ...], int]:
    """Dims (>= 1) that every box covers fully and that lie before its last partial dim:
    the shape with them at 1, and the product of their sizes (see the module doc)."""
    flat = [b for bs in boxes for b in bs]
    if len(shape) < 3 or not flat:
        return shape, 1
    lasts = []
    for box in flat:
        partial = [d for d, (a, b) in enumerate(box) if (a, b) != (0, shape[d])]
        lasts.append(partial[-1] if partial else -1)
    limit = min(lasts)
    free = [j for j in range(1, len(shape))
            if j < limit and all(box[j] == (0, shape[j]) for box in flat)]
    factor = math.prod(shape[j] for j in free)
    return tuple(1 if j in free else n for j, n in enumerate(shape)), factor


def _reduced_box(box: tuple, shape: tuple, proto: tuple) -> tuple:
    return tuple((0, 1) if p != n else ab for ab, n, p in zip(box, shape, proto))


def _signature(boxes: tuple) -> tuple:
    """Boxes that compile to the same reads per rank: the same dim-0 ranges (Shard(0)
    decides the holder by row alone) and the same extents and relative offsets on the
    other dims (a run lies in one row; partial runs never touch, wherever they sit)."""
    base = boxes[0][1:]
    return tuple((box[0], tuple(b - a for a, b in box[1:]),
                  tuple(a - a0 for (a, _), (a0, _) in zip(box[1:], base))) for box in boxes)


def _sources(proto: tuple[int, ...], dtype: str, world: int) -> list[SourceLayout]:
    rows, per_row = (proto[0], math.prod(proto[1:])) if proto else (1, 1)
    out = []
    for r in range(world):
        a, b = held_rows(rows, world, r) if proto else ((0, 1) if r == 0 else (0, 0))
        if b > a:
            out.append(SourceLayout(rank=r, held=(HeldRange(
                name="t", shape=proto, dtype=dtype, start=a * per_row, stop=b * per_row,
                region="t", offset=0),)))
    return out


def _compile_class(pt: PlannedTensor, world: int, max_read: Optional[int]):
    """compile_plan for one class: (plan, worker groups, factor)."""
    proto, factor = reduce_dims(pt.shape, pt.boxes)
    groups: dict[tuple, list[int]] = defaultdict(list)
    first: dict[tuple, tuple] = {}
    for g, boxes in enumerate(pt.boxes):
        if any(math.prod(b - a for a, b in box) for box in boxes):
            key = _signature(boxes)
            groups[key].append(g)
            first.setdefault(key, boxes)
    dests = []
    for key, gs in groups.items():
        boxes = first[key]
        wants, off = [], 0
        for i, box in enumerate(boxes):
            rbox = _reduced_box(box, pt.shape, proto)
            wants.append(Want(name="t", dtype=pt.dst_dtype, box=rbox, dest="d", offset=off))
            off += math.prod(b - a for a, b in rbox) * itemsize(pt.dst_dtype)
        dests.append(DestLayout(worker=f"g{gs[0]}", wants=tuple(wants)))
    plan = compile_plan(_sources(proto, pt.src_dtype, world), dests, max_read_bytes=max_read)
    return plan, list(groups.values()), factor


def pull_stats(tensors: Sequence[PlannedTensor], world: int, workers: int,
               max_read_bytes: Optional[int] = None) -> PullStats:
    """Bytes/READs per (rank, worker) of one replica for all ``tensors`` (module doc)."""
    classes: dict[tuple, list[PlannedTensor]] = defaultdict(list)
    for pt in tensors:
        classes[(pt.shape, pt.rule, pt.src_dtype, pt.dst_dtype, pt.boxes)].append(pt)
    pb = np.zeros((world, workers), np.float64)
    pr = np.zeros((world, workers), np.float64)
    stats, t_all = [], time.perf_counter()
    for members in classes.values():
        t0 = time.perf_counter()
        plan, groups, factor = _compile_class(members[0], world, max_read_bytes)
        mult = len(members) * factor
        src = np.array([r.src_rank for r in plan.reads], np.int64)
        dst = np.array([int(r.dst_worker[1:]) for r in plan.reads], np.int64)
        nb = np.array([r.nbytes for r in plan.reads], np.float64)
        b1, r1 = np.zeros((world, workers)), np.zeros((world, workers))
        np.add.at(b1, (src, dst), nb)
        np.add.at(r1, (src, dst), 1.0)
        for gs in groups:
            for g in gs:
                pb[:, g] += b1[:, gs[0]] * mult
                pr[:, g] += r1[:, gs[0]] * mult
        n_reads = sum(r1[:, gs[0]].sum() * len(gs) for gs in groups) * mult
        n_bytes = sum(b1[:, gs[0]].sum() * len(gs) for gs in groups) * mult
        stats.append(ClassStat(members[0].name, len(members), members[0].shape,
                               members[0].rule, factor, int(n_reads), int(n_bytes),
                               plan.digest[:12], time.perf_counter() - t0))
    return PullStats(pb, pr, stats, time.perf_counter() - t_all)
