"""Point-to-point pull (the ``nixl`` backend) on the link model.

Owns :func:`predict_p2p`. The phases follow the backend's code (:mod:`weightsync.transport
.backends.nixl.engine`): every trainer rank first puts what it serves into its staging
arena (a copy per byte it holds; with FP8 on the trainer, that copy is the block
quantization; with ``serve="auto"``, the backend's default, tensors served in the model's
own dtype are served from their own storage and cost only the per-tensor put), then one
control round trip starts the pull, every worker posts the
READs of the compiled plan (:func:`.compiled.pull_stats`: bytes per (rank, worker) and
the number of READs, ``read_us`` of software each), and once all have landed the worker
applies them: whole tensors land in its own (``receive_into``: software only), TP/EP
slices and casts are copied by the loader (vLLM's, a receiver-side FP8 cast).

A warm sync is pipelined (as the engine runs it; ``pipelined`` of
the scenario): each rank tells the workers to pull before it stages and names each
staging block (``bucket_size``) once written, and the workers read it at once. So
staging and the pull are one phase: their loads share every resource they both use
(a host's memory, say), and the phase lasts its busiest resource, plus the control round
trip, plus the time to write the first block (nothing can be read before it). The apply
runs after the pull.

Except on a host (a CPU trainer and workers): there the staging copy was measured *not*
to hide behind the pulls, so bytes staged on a host are priced as their own phase before
the pull, pipelined or not: on a 2-core box each pipelined staging step of 1 GiB took at
least the whole copy at the box's memcpy rate beyond the raw READ paired with it, while
serving from the tensors' own storage added about nothing. Why they do not overlap there
(NIXL's progress threads, perhaps) is not known.
"""

from __future__ import annotations

import math

import numpy as np

from weightsync.core.plan import itemsize
from weightsync.tools.planner.compiled import PullStats, rank_boxes, workers_cut
from weightsync.tools.planner.linkmodel import Loads, StrategyResult
from weightsync.tools.planner.rules import PlannedTensor, kept_bytes
from weightsync.tools.planner.scenario import Placement, Scenario

__all__ = ["predict_p2p", "held_bytes"]


def held_bytes(pts: list[PlannedTensor], world: int, model_dtype: str,
               serve: str = "staging", shard: str = "fsdp") -> tuple:
    """Per trainer rank: (bytes it serves, bytes its staging copy moves, tensors it puts).
    ``serve="auto"``: a tensor served in the model's own dtype is served from its own
    storage (an FSDP2 or TP shard, marked by the export), so only casts, FP8 and tensors
    staged box by box for the workers (:func:`~weightsync.tools.planner.compiled
    .workers_cut`) are staged."""
    served, moved, count = np.zeros(world), np.zeros(world), np.zeros(world)
    elems_of: dict[tuple, tuple] = {}
    for pt in pts:
        key = (pt.shape, pt.held, pt.boxes)
        if key not in elems_of:
            elems_of[key] = (np.array([sum(math.prod(b - a for a, b in box)
                                           for box in rank_boxes(pt, r, world, shard))
                                       for r in range(world)], np.float64),
                             workers_cut(pt) is not None)
        elems, staged_by_box = elems_of[key]
        src = itemsize(model_dtype) if not pt.rule.endswith("_scale") else 0
        served += elems * itemsize(pt.src_dtype)
        if serve == "staging" or pt.src_dtype != model_dtype or not src or staged_by_box:
            moved += elems * (src + itemsize(pt.src_dtype)) / 2
        count += elems > 0
    return served, moved, count


def _serve(sc: Scenario, pl: Placement, held: tuple, res: StrategyResult) -> Loads:
    loads = Loads(pl)
    served, moved, count = held
    for r, dev in enumerate(pl.trainer):
        loads.copy(dev, moved[r])
        loads.work(f"trainer rank {r}", count[r] * pl.links_of(dev).sw("tensor_us"))
    res.notes.append(f"trainer ranks serve {served.min() / 1e9:.3g}-{served.max() / 1e9:.3g} GB "
                     f"each ({sc.trainer_layout})")
    return loads


def _pull(sc: Scenario, pl: Placement, stats: PullStats, res: StrategyResult) -> Loads:
    loads = Loads(pl)
    n = stats.pair_bytes.shape[1]        # one replica's workers, or all (replicated holders)
    cross = False
    sent = np.zeros(sc.trainer_gpus)
    for i, dev in enumerate(pl.worker):
        g = i % n
        col, reads = stats.pair_bytes[:, g], stats.pair_reads[:, g]
        for r in np.flatnonzero(col):
            src = pl.trainer[r]
            cross = cross or src[0] != dev[0]
            loads.move(src, dev, col[r])
        sent += col
        loads.work(pl.who(dev), reads.sum() * pl.links_of(dev).sw("read_us"))
        res.dest_bytes.append(float(col.sum()))
        res.dest_reads.append(float(reads.sum()))
    res.source_bytes = [float(x) for x in sent]
    links = pl.links_of(pl.worker[0])
    path = links.link("nic") if cross else links.link("intra")
    loads.latency = links.sw("control_us") + path.latency
    return loads


def _apply(sc: Scenario, pl: Placement, pts, res: StrategyResult) -> Loads:
    loads = Loads(pl)
    n = sc.replica_size
    kept = [sum(kept_bytes(pt, g) for pt in pts) for g in range(n)]
    count = [sum(1 for pt in pts if pt.boxes[g]) for g in range(n)]
    # a worker that keeps every tensor whole, as served, lands it in its own tensors
    # (receive_into), as does a TP/EP worker that gives receive_into tensors of its kept
    # boxes' shapes (into_shards); else TP/EP slices and casts are copied by the loader
    in_place = (n == 1 or sc.into_shards) and all(pt.src_dtype == pt.dst_dtype for pt in pts)
    for i, dev in enumerate(pl.worker):
        g = i % n
        if not in_place:
            loads.copy(dev, (res.dest_bytes[i] + kept[g]) / 2)
        loads.work(pl.who(dev), count[g] * pl.links_of(dev).sw("tensor_us"))
    return loads


def _pipelined(pl: Placement, serve: Loads, pull: Loads, first_block: float) -> Loads:
    """Staging and the pull as one phase (see the module doc)."""
    both = Loads(pl)
    both.absorb(serve)       # a host's core time of the software too (Loads.work)
    both.absorb(pull)
    for actor, secs in list(serve.busy.items()) + list(pull.busy.items()):
        both.busy[actor] += secs
    both.latency = serve.latency + pull.latency + first_block
    return both


def predict_p2p(sc: Scenario, pl: Placement, pts: list[PlannedTensor],
                stats: PullStats) -> StrategyResult:
    res = StrategyResult("p2p")
    held = held_bytes(pts, sc.trainer_gpus, sc.src_dtype, sc.serve, sc.trainer_shard)
    serve = _serve(sc, pl, held, res)
    pull = _pull(sc, pl, stats, res)
    # on a host the staging copy did not hide behind the pulls (see the module doc)
    if sc.pipelined and not (pl.host and held[1].max() > 0):
        staged = serve.result("serve")
        moved = held[1]
        share = min(1.0, sc.bucket_size / moved.max()) if moved.max() > 0 else 0.0
        phases = [("serve+pull (pipelined)",
                   _pipelined(pl, serve, pull, staged.limit_seconds * share))]
    else:
        phases = [("serve", serve), ("pull", pull)]
    phases.append(("apply", _apply(sc, pl, pts, res)))
    for name, loads in phases:
        res.phases.append(loads.result(name))
        res.add_links(loads)
    res.seconds = sum(p.seconds for p in res.phases)
    if not pl.host and set(pl.worker) & set(pl.trainer):
        res.notes.append("workers share GPUs with trainer ranks: priced as device copies, but "
                         "NIXL between two processes on one H200 ran at ~0.5 GB/s here "
                         "(NOTES.md): optimistic")
    small = [c for c in stats.classes if c.reads and c.wire_bytes / c.reads < 4096]
    if small:
        worst = min(small, key=lambda c: c.wire_bytes / c.reads)
        res.notes.append(f"{sum(c.reads for c in small):.3g} READs per replica are under 4 KiB "
                         f"(smallest: {worst.name} x{worst.count}, "
                         f"{worst.wire_bytes / worst.reads:.0f} B per READ)")
    return res
