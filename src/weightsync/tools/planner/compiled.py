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
   A tensor-/expert-parallel trainer (:func:`rank_boxes`: boxes of its TP x EP group,
   rows of those chunked by FSDP2 or replicated over data-parallel ranks) groups workers
   by equal boxes only. Where a byte has several holders (replicated over DP, a norm on
   every TP rank) each worker of every replica is compiled alone, as each receiver of the
   backend compiles its own plan; the receiver balances over its whole plan, the planner
   per tensor layout (biggest first, carrying each worker's loads), so bytes per worker
   are exact but the split over holders and the READ count (holders coalesce
   differently) are approximations: up to 19 % and 50 % off the backend's compile on the
   small cases of ``tests/test_planner.py`` (held there to 25 % and 55 %).
3. *Dimensions nobody splits* (no worker, no trainer rank), *before the one a worker
   splits*, are compiled at size 1
   and the reads and bytes multiplied by their size (e.g. dim 1 of an expert tensor
   ``[E, H, I]`` whose dim 2 is TP-split: each index of it is one more run of the same
   length from the same rank, never coalesced with its neighbour). Where the trainers
   stage a tensor box by box for its workers (:func:`staged_boxes`, as the ``nixl``
   arena does), a worker's piece is one run whatever those dims: bytes are multiplied,
   reads only cut by the read limit.

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
from weightsync.core.xferplan import (DestLayout, HeldBox, SourceLayout, Want, box_is_run,
                                      compile_plan, cut_boxes, read_totals)
from weightsync.tools.planner.rules import PlannedTensor

__all__ = ["PullStats", "ClassStat", "pull_stats", "held_rows", "reduce_dims", "rank_boxes",
           "staged_boxes", "workers_cut"]


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


def rank_boxes(pt: PlannedTensor, rank: int, world: int, shard: str = "fsdp") -> tuple:
    """The boxes trainer ``rank`` of ``world`` holds of ``pt``: its tensor-/expert-parallel
    group's boxes (``pt.held``; ranks ``g = rank % group`` of a group are consecutive, TP
    innermost, as Megatron), whole without TP/EP; with ``shard="fsdp"`` FSDP2 ``Shard(0)``
    over the ``world // group`` data-parallel ranks then chunks the rows of what the group
    rank holds (``torch.chunk``; a TP split of dim 0 too is FSDP2-over-TP's strided shard:
    rows of the TP rows), with ``"full"`` each data-parallel rank holds all of it."""
    group = len(pt.held) if pt.held is not None else 1
    boxes = pt.held[rank % group] if pt.held is not None else (tuple((0, n) for n in pt.shape),)
    if not pt.shape:                 # a scalar: FSDP2 leaves it on rank 0
        return boxes if shard != "fsdp" or rank == 0 else ()
    if shard != "fsdp" or world == group:
        return boxes
    dp, d = world // group, rank // group
    rows = sum(b[0][1] - b[0][0] for b in boxes)
    a, b = held_rows(rows, dp, d)
    out, at = [], 0
    for box in boxes:            # the group rank's boxes, rows back to back
        n = box[0][1] - box[0][0]
        lo, hi = max(a - at, 0), min(b - at, n)
        if hi > lo:
            out.append(((box[0][0] + lo, box[0][0] + hi),) + tuple(box[1:]))
        at += n
    return tuple(out)


def workers_cut(pt: PlannedTensor) -> Optional[tuple]:
    """The boxes the ``nixl`` trainers stage ``pt`` by, or None: every worker keeps none of
    it or a box of it that is not one run (a row-parallel weight's columns; what its
    receivers tell the trainers), and together those boxes partition it
    (:func:`~weightsync.core.xferplan.cut_boxes`)."""
    if not pt.shape or not all(w == () or any(not box_is_run(pt.shape, b) for b in w)
                               for w in pt.boxes):
        return None
    cut = tuple(sorted({b for w in pt.boxes for b in w}))
    whole = tuple((0, n) for n in pt.shape)
    return cut if cut_boxes(pt.shape, whole, cut) is not None else None


def staged_boxes(pt: PlannedTensor, rank: int, world: int, shard: str = "fsdp") -> tuple:
    """What trainer ``rank`` serves ``pt`` as: its :func:`rank_boxes`, each cut into the
    boxes of :func:`workers_cut` when there are some (as the ``nixl`` trainer stages it):
    each worker's box is then one read per rank."""
    boxes = rank_boxes(pt, rank, world, shard)
    by = workers_cut(pt)
    if by is None:
        return boxes
    out = []
    for held in boxes:
        pieces = cut_boxes(pt.shape, held, by)
        if pieces is None:
            return boxes
        out.extend(pieces)
    return tuple(out)


def reduce_dims(shape: tuple[int, ...], boxes: Sequence,
                held: Sequence = ()) -> tuple[tuple[int, ...], int]:
    """Dims (>= 1) that every box covers fully and that lie before its last partial dim,
    and that every trainer box of ``held`` covers fully too (a holder boundary then
    repeats alike at each index of such a dim): the shape with them at 1, and the product
    of their sizes (see the module doc)."""
    flat = [b for bs in boxes for b in bs]
    if len(shape) < 3 or not flat:
        return shape, 1
    lasts = []
    for box in flat:
        partial = [d for d, (a, b) in enumerate(box) if (a, b) != (0, shape[d])]
        lasts.append(partial[-1] if partial else -1)
    limit = min(lasts)
    free = [j for j in range(1, len(shape))
            if j < limit and all(box[j] == (0, shape[j]) for box in (*flat, *held))]
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


def _sources(pt: PlannedTensor, proto: tuple[int, ...], world: int,
             shard: str) -> list[SourceLayout]:
    out = []
    for r in range(world):
        held, off = [], 0
        for box in staged_boxes(pt, r, world, shard) if proto else (((0, 1),) if r == 0 else ()):
            rbox = _reduced_box(box, pt.shape, proto) if proto else ()
            n = math.prod(b - a for a, b in rbox)
            if n:
                held.append(HeldBox(name="t", shape=proto, dtype=pt.src_dtype, box=rbox,
                                    region="t", offset=off))
                off += n * itemsize(pt.src_dtype)
        if held:
            out.append(SourceLayout(rank=r, held=tuple(held)))
    return out


def _compile_class(pt: PlannedTensor, world: int, max_read: Optional[int], shard: str,
                   replicas: int, expand: bool, sent: np.ndarray, mult: int,
                   trainer: list, proto: tuple[int, ...]):
    """The compile of one class (``trainer``: every rank's boxes of it; ``proto``: its shape
    with the dims of rule 3 at 1): ``([(column compiled, columns it stands for, {rank:
    (bytes, reads)})], digest)``. Where every byte has one holder, workers that
    read alike share one :func:`compile_plan` (rule 2: by FSDP2 row signature, or by equal
    boxes under TP/EP trainer boxes). Where a byte has several holders (replicated over DP,
    a norm on every TP rank) every worker of every replica is compiled alone with its
    global index as ``spread`` (:func:`~weightsync.core.xferplan.read_totals`), as each
    receiver of the backend compiles its own plan (balanced over the holders by itself,
    ties turned by its rank), going on from the bytes ``sent`` already planned per (rank,
    column) as a receiver's whole-plan balance would (the class's tensors planned ``mult``
    at a time). ``expand``: columns are the workers of every replica, else of one."""
    n = len(pt.boxes)
    unique = shard == "fsdp" and sum(math.prod(b - a for a, b in box) for box in trainer) \
        == math.prod(pt.shape)
    groups: dict[tuple, list[int]] = defaultdict(list)
    first: dict[tuple, tuple] = {}
    for g, boxes in enumerate(pt.boxes):
        if any(math.prod(b - a for a, b in box) for box in boxes):
            key = _signature(boxes) if pt.held is None and shard == "fsdp" else boxes
            groups[key].append(g)
            first.setdefault(key, boxes)
    dests = []
    for key, gs in groups.items():
        wants, off = [], 0
        for box in first[key]:
            rbox = _reduced_box(box, pt.shape, proto)
            wants.append(Want(name="t", dtype=pt.dst_dtype, box=rbox, dest="d", offset=off))
            off += math.prod(b - a for a, b in rbox) * itemsize(pt.dst_dtype)
        dests.append((tuple(wants), gs))
    sources = _sources(pt, proto, world, shard)
    if unique:
        plan = compile_plan(sources, [DestLayout(worker=f"g{gs[0]}", wants=w) for w, gs in dests],
                            max_read_bytes=max_read)
        per: dict[int, dict[int, list]] = defaultdict(dict)
        for r in plan.reads:
            cell = per[int(r.dst_worker[1:])].setdefault(r.src_rank, [0, 0])
            cell[0] += r.nbytes
            cell[1] += 1
        out = [(gs[0], [k * n + g for k in range(replicas if expand else 1) for g in gs],
                per[gs[0]]) for _, gs in dests]
        return out, plan.digest[:12]
    alone = [(wants, k * n + g) for wants, gs in dests
             for k in range(replicas if expand else 1) for g in gs]
    totals = read_totals(sources, [DestLayout(worker=f"g{i}", wants=w) for w, i in alone],
                         max_read_bytes=max_read, spread=[i for _, i in alone],
                         prior=[{r: int(b // mult) for r, b in enumerate(sent[:, i]) if b}
                                for _, i in alone])
    return [(i, [i], t) for (_, i), t in zip(alone, totals)], "per-receiver"


def pull_stats(tensors: Sequence[PlannedTensor], world: int, workers: int,
               max_read_bytes: Optional[int] = None, shard: str = "fsdp",
               replicas: int = 1) -> PullStats:
    """Bytes/READs per (rank, worker) for all ``tensors`` (module doc): the workers of one
    replica, or, where some byte has several holders (replicated over DP, TP/EP trainer
    boxes), of every replica (``workers x replicas`` columns: replicas then read
    differently, each receiver turning its ties by its rank)."""
    expand = shard != "fsdp" or any(pt.held is not None for pt in tensors)
    cols_n = workers * replicas if expand else workers
    classes: dict[tuple, list[PlannedTensor]] = defaultdict(list)
    for pt in tensors:
        classes[(pt.shape, pt.rule, pt.src_dtype, pt.dst_dtype, pt.boxes, pt.held)].append(pt)
    pb = np.zeros((world, cols_n), np.float64)
    pr = np.zeros((world, cols_n), np.float64)
    stats, t_all = [], time.perf_counter()
    # the biggest layouts first, as a receiver's balance takes its biggest pieces first
    order = sorted(classes.values(), key=lambda m: -len(m) * math.prod(m[0].shape) *
                   itemsize(m[0].src_dtype))
    for members in order:
        t0 = time.perf_counter()
        pt = members[0]
        staged = workers_cut(pt) is not None
        trainer = [b for r in range(world) for b in staged_boxes(pt, r, world, shard)]
        proto, factor = reduce_dims(pt.shape, pt.boxes, trainer)
        mult = len(members) * factor
        # staged box by box, a worker's piece is one run whatever the collapsed dims
        # (rule 3 multiplies runs for row-major storage): reads are not multiplied by
        # them, only cut by the read limit at their full size
        read_mult = len(members) if staged else mult
        compiled, digest = _compile_class(pt, world, max_read_bytes, shard, replicas, expand,
                                          pb, mult, trainer, proto)
        n_reads = n_bytes = 0.0
        for rep, targets, by_rank in compiled:
            if not by_rank:
                continue
            ranks = np.fromiter(by_rank, np.int64)
            nb = np.array([by_rank[r][0] for r in ranks], np.float64)
            nr = np.array([by_rank[r][1] for r in ranks], np.float64)
            if staged and factor > 1 and max_read_bytes:
                nr = nr * np.ceil(nb * factor / np.maximum(nr, 1) / max_read_bytes)
            for c in targets:
                pb[ranks, c] += nb * mult
                pr[ranks, c] += nr * read_mult
            n_reads += nr.sum() * len(targets) * read_mult
            n_bytes += nb.sum() * len(targets) * mult
        if expand:       # per replica, as the class figures always were
            n_reads, n_bytes = n_reads / replicas, n_bytes / replicas
        stats.append(ClassStat(members[0].name, len(members), members[0].shape,
                               members[0].rule, factor, int(n_reads), int(n_bytes),
                               digest, time.perf_counter() - t0))
    return PullStats(pb, pr, stats, time.perf_counter() - t_all)
