"""Broadcast (``collective``) and ring (``shm``, ``cuda_ipc``) on the link model.

Owns :func:`predict_bucketed`. The layout is the bucket plan the backends run
(:func:`weightsync.core.plan.build_plan` per trainer rank's stream); who sends what is
the trainer's export: with FSDP2 every tensor has one owner
(:func:`weightsync.trainer.export.assign_owners`) that gathers it in ``all_to_all``
exchanges of up to 16 MiB (``export_weights``' ``coalesce_bytes``), then sends it; with
full tensors on every rank the owner is :func:`weightsync.transport.protocol.ownership
.owner_of`. A tensor-/expert-parallel trainer's shards are gathered too (to the owner on
a 1-D mesh, by ``full_tensor`` all-gathers on a 2-D one: :func:`_gather`). Every exchange is a collective of all trainer ranks, run in model order, and
an owner must have sent (all but ``num_slots`` buckets of) what it gathered before it
joins the next one, so the sync is modelled as one step per exchange, each
``gather + deliver``, steps one after another. Without FSDP2 gathers the whole sync is
one step and every stream runs at once.

Delivery of one step: the owner packs its bucketed bytes into slots (a copy), the bytes
cross the wire and each receiver copies what it keeps out of the bucket, all pipelined
(one fluid phase plus the fill of one bucket). ``collective`` ``ring`` (NCCL): a chain
through the receivers, node by node, channels spread over every receiving GPU's NIC;
``star`` (gloo): the root sends each receiver its own copy, at most ``collective.GBps``
per stream. ``ring``: receivers read the slots in place (shared memory: a copy through
host memory; CUDA IPC: the same GPU's memory, or NVLink); it needs one node. On a host,
tensors of at least ``direct_min_bytes`` skip the buckets: ``collective`` broadcasts them
as they are, ``shm`` lets each receiver read them from the trainer one at a time.
Software: ``tensor_us`` per tensor on each side, ``bucket_us`` (+ ``op_us`` for a
collective) per bucket or direct tensor.
"""

from __future__ import annotations

import math
from collections import defaultdict

import numpy as np

from weightsync.core.plan import build_plan, itemsize
from weightsync.trainer.export import ExportItem, assign_owners
from weightsync.transport.protocol.ownership import owner_of
from weightsync.tools.planner.compiled import rank_boxes
from weightsync.tools.planner.linkmodel import Loads, PhaseResult, StrategyResult
from weightsync.tools.planner.rules import PlannedTensor, kept_bytes
from weightsync.tools.planner.scenario import Placement, Scenario

__all__ = ["predict_bucketed", "owners_of", "exchanges", "COALESCE_BYTES",
           "COLLECTIVE_DIRECT_MIN"]

COALESCE_BYTES = 16 << 20          # export_weights(coalesce_bytes=...) default
COLLECTIVE_DIRECT_MIN = 16 << 20   # WEIGHTSYNC_COLLECTIVE_DIRECT_MIN default (CPU only)


def _nbytes(pt: PlannedTensor, dtype: str | None = None) -> int:
    return math.prod(pt.shape) * itemsize(dtype or pt.src_dtype)


def owners_of(sc: Scenario, pts: list[PlannedTensor]) -> list[int]:
    """Owner rank of every planned tensor (an FP8 scale goes with its weight)."""
    base = [i for i, pt in enumerate(pts) if not pt.rule.endswith("_scale")]
    ranks = list(range(sc.trainer_gpus))
    if sc.trainer_shard == "fsdp" or sc.trainer_group > 1:     # export_weights gathers
        items = [ExportItem(pts[i].name, (), _nbytes(pts[i], sc.src_dtype)) for i in base]
        own = assign_owners(items, ranks)
    else:
        own = [owner_of(pts[i].name, ranks) for i in base]
    out, j = [], -1
    for pt in pts:
        j += 0 if pt.rule.endswith("_scale") else 1
        out.append(own[j])
    return out


def gathers(sc: Scenario) -> bool:
    """Whether the export gathers tensors before sending: FSDP2 shards over several ranks,
    or a tensor-/expert-parallel trainer."""
    return (sc.trainer_shard == "fsdp" and sc.trainer_gpus > 1) or sc.trainer_group > 1


def exchanges(sc: Scenario, pts: list[PlannedTensor]) -> list[list[int]]:
    """Steps of the sync: the export's exchanges (runs of consecutive tensors of at most
    16 MiB, at least one each: ``export_weights``' rule), or one step of everything."""
    if not gathers(sc):
        return [list(range(len(pts)))]
    steps, size = [], 0
    for i, pt in enumerate(pts):
        n = 0 if pt.rule.endswith("_scale") else _nbytes(pt, sc.src_dtype)
        if steps and (pt.rule.endswith("_scale") or size + n <= COALESCE_BYTES):
            steps[-1].append(i)
            size += n
        else:
            steps.append([i])
            size = n
    return steps


def _gather(sc: Scenario, pl: Placement, pts, step: list[int], owners: list[int]) -> Loads:
    """One exchange. FSDP2 (or TP on a 1-D mesh): every rank sends each owner what it holds
    of the owner's tensors (``all_to_all`` / ``gather``: Shard(0) rows, TP boxes). TP/EP with
    data-parallel ranks (a 2-D mesh): the export's ``full_tensor``, an all-gather over the
    ranks sharing the tensor (all of them under FSDP2, the TP x EP group when replicated),
    priced as NCCL's ring: each rank sends its neighbour ``(n - 1) / n`` of the tensor."""
    loads = Loads(pl)
    world, group = sc.trainer_gpus, sc.trainer_group
    ring = group > 1 and world > group
    for i in step:
        pt = pts[i]
        if pt.rule.endswith("_scale") or not pt.shape:
            continue
        isz = itemsize(sc.src_dtype)
        if ring:
            span = world if sc.trainer_shard == "fsdp" else group
            share = math.prod(pt.shape) * isz * (span - 1) / span
            for r in range(world):
                first = r - r % span
                loads.move(pl.trainer[r], pl.trainer[first + (r + 1 - first) % span], share)
            continue
        dst = pl.trainer[owners[i]]
        for r in range(world):
            if r != owners[i]:
                n = sum(math.prod(b - a for a, b in box)
                        for box in rank_boxes(pt, r, world, sc.trainer_shard))
                loads.move(pl.trainer[r], dst, n * isz)
    links = pl.links_of(pl.trainer[0])
    loads.latency = links.sw("op_us") + links.link("nic" if pl.nodes > 1 else "intra").latency
    return loads


def _wire(loads: Loads, sc: Scenario, pl: Placement, strategy: str, src, nbytes: float,
          direct: bool) -> float:
    """Put one stream's bytes of a step on the wire; return the path latency."""
    recv = pl.worker
    if strategy == "ring":
        for dev in recv:
            (loads.copy(dev, nbytes) if pl.host else loads.move(src, dev, nbytes))
        return pl.links_of(src).link("intra").latency
    links = pl.links_of(src)
    if links.collective_algo == "star":
        loads.put("stream", pl.name(src), nbytes * len(recv))
        if pl.host:
            loads.put("host_mem", src[0], 2 * nbytes * len(recv))
            if links.cores and links.collective_cap:
                # the raw broadcast that measured the cap kept every core busy (TCP over
                # loopback: a kernel copy on each side): its bytes cost the cores that long
                copy = links.link("device_mem").rate
                loads.cpu(src[0], nbytes * len(recv) * links.cores * copy / links.collective_cap)
        return links.link("intra").latency * len(recv)
    by_node: dict[int, list] = defaultdict(list)
    for dev in recv:
        by_node[dev[0]].append(dev)
    order = sorted(by_node, key=lambda n: (n != src[0], n))
    loads.put("intra_out" if order[0] == src[0] else "nic_out", src, nbytes)
    for pos, node in enumerate(order):
        devs, k = by_node[node], len(by_node[node])
        last = pos == len(order) - 1
        for dev in devs:
            if node == src[0]:
                loads.put("intra_in", dev, nbytes)
                loads.put("intra_out", dev, nbytes * (k - 1) / k)
            else:
                loads.put("nic_in", dev, nbytes / k)
                loads.put("intra_in", dev, nbytes * (k - 1) / k)
                loads.put("intra_out", dev, nbytes * (k - 1) / k)
            if not last:
                loads.put("nic_out", dev, nbytes / k)
    hops = len(recv)
    return hops * pl.links_of(recv[-1]).link("nic" if len(order) > 1 else "intra").latency


def _direct_min(sc: Scenario, pl: Placement, strategy: str) -> int:
    links = sc.links
    if not pl.host:
        return 0
    if strategy == "ring":
        ok = links.direct_min_bytes and sc.workers <= links.direct_max_receivers
        return links.direct_min_bytes if ok else 0
    return COLLECTIVE_DIRECT_MIN


def _streams(sc: Scenario, pts, owners: list[int], dmin: int) -> dict[int, dict]:
    """Per owner: its bucket plan's bucket of each tensor, and which tensors go direct."""
    per: dict[int, dict] = defaultdict(lambda: {"bucketed": [], "direct": set()})
    for i, pt in enumerate(pts):
        s = per[owners[i]]
        if dmin and _nbytes(pt) >= dmin:
            s["direct"].add(i)
        else:
            s["bucketed"].append(i)
    for s in per.values():
        plan = build_plan([(pts[i].name, pts[i].shape, pts[i].src_dtype) for i in s["bucketed"]],
                          sc.bucket_size)
        where: dict[str, set] = defaultdict(set)
        for b in plan.buckets:
            for e in b.entries:
                where[e.name].add(b.index)
        s["buckets_of"] = {i: where[pts[i].name] for i in s["bucketed"]}
        s["buckets"] = len(plan.buckets)
    return per


def _deliver(sc, pl, strategy, pts, step, owners, streams, kept) -> tuple[Loads, float]:
    """Loads of one step's delivery, and the seconds of its serialized direct reads."""
    loads = Loads(pl, sc.links.collective_cap)
    sw = pl.links_of(pl.trainer[0]).software
    lat, serial, first = 0.0, 0.0, 0.0
    by_owner: dict[int, list[int]] = defaultdict(list)
    for i in step:
        by_owner[owners[i]].append(i)
    for o, idx in by_owner.items():
        s, src = streams[o], pl.trainer[o]
        bucketed = [i for i in idx if i not in s["direct"]]
        direct = [i for i in idx if i in s["direct"]]
        nb = sum(_nbytes(pts[i]) for i in bucketed)
        buckets = len(set().union(*(s["buckets_of"][i] for i in bucketed))) if bucketed else 0
        loads.copy(src, nb)
        lat = max(lat, _wire(loads, sc, pl, strategy, src, nb, False))
        ops = buckets + len(direct)
        extra = sw["op_us"] if strategy == "broadcast" else 0.0
        loads.work(f"trainer rank {o}",
                   len(idx) * sw["tensor_us"] + ops * (sw["bucket_us"] + extra))
        first = max(first, min(nb, sc.bucket_size))
        for i in direct:
            b = _nbytes(pts[i])
            if strategy == "broadcast":
                _wire(loads, sc, pl, strategy, src, b, True)
            else:       # shm direct: every receiver reads it, the trainer waits for all
                serial += b * len(pl.worker) / sc.links.direct_rate + sw["control_us"]
    for n, dev in enumerate(pl.worker):
        g = n % sc.replica_size
        if strategy == "broadcast":
            loads.copy(dev, sum(kept[g][i] for i in step if i not in streams[owners[i]]["direct"]))
        loads.work(pl.who(dev), len(step) * sw["tensor_us"])
    # pipeline fill: the stages that are not the bottleneck, for one bucket (pack, unpack)
    copy_rate = pl.links_of(pl.trainer[0]).link("device_mem").rate
    loads.latency = lat + sw["control_us"] + 2 * first / copy_rate
    return loads, serial


def _applicable(sc: Scenario, pl: Placement, strategy: str) -> str:
    if strategy == "broadcast" and not pl.host and set(pl.worker) & set(pl.trainer):
        return ("broadcast (collective on NCCL) needs every rank on its own GPU; this "
                "layout shares GPUs between trainer ranks and rollout workers")
    if strategy == "ring":
        nodes = {d[0] for d in pl.trainer + pl.worker}
        if len(nodes) > 1:
            return (f"ring (shm / cuda_ipc) needs every trainer rank and rollout worker on one "
                    f"node; this layout spans {len(nodes)} nodes")
    return ""


def predict_bucketed(sc: Scenario, pl: Placement, pts: list[PlannedTensor],
                     strategy: str) -> StrategyResult:
    res = StrategyResult(strategy)
    res.reason = _applicable(sc, pl, strategy)
    if res.reason:
        res.applicable = False
        return res
    owners = owners_of(sc, pts)
    streams = _streams(sc, pts, owners, _direct_min(sc, pl, strategy))
    kept = [[kept_bytes(pt, g) for pt in pts] for g in range(sc.replica_size)]
    steps = exchanges(sc, pts)
    gathered = gathers(sc)
    total_g = total_d = 0.0
    worst: dict[str, PhaseResult] = {}
    totals = {"gather": Loads(pl), "deliver": Loads(pl, sc.links.collective_cap)}
    for step in steps:
        parts = [("gather", _gather(sc, pl, pts, step, owners), 0.0)] if gathered else []
        loads, serial = _deliver(sc, pl, strategy, pts, step, owners, streams, kept)
        parts.append(("deliver", loads, serial))
        for name, ld, ser in parts:
            r = ld.result(name)
            r.seconds += ser
            if ser > r.limit_seconds:
                r.limit, r.limit_seconds = "direct tensors, read one at a time (shm)", ser
            if name == "gather":
                total_g += r.seconds
            else:
                total_d += r.seconds
            if name not in worst or r.seconds > worst[name].seconds:
                worst[name] = r
            totals[name].absorb(ld)
    for ld in totals.values():
        res.add_links(ld)
    _finish(res, sc, pl, pts, owners, streams, steps, worst, total_g, total_d)
    return res


def _finish(res, sc, pl, pts, owners, streams, steps, worst, total_g, total_d) -> None:
    for name, total in (("gather", total_g), ("deliver", total_d)):
        if name in worst:
            w = worst[name]
            res.phases.append(PhaseResult(name, total, w.limit, w.limit_seconds, w.latency,
                                          w.top))
    res.seconds = total_g + total_d
    sent = np.zeros(sc.trainer_gpus)
    for i, pt in enumerate(pts):
        sent[owners[i]] += _nbytes(pt)
    res.source_bytes = [float(x) for x in sent]
    wire = float(sent.sum())
    res.dest_bytes = [wire] * sc.workers
    ops = sum(s["buckets"] + len(s["direct"]) for s in streams.values())
    res.dest_reads = [float(ops)] * sc.workers
    if len(steps) > 1:
        res.notes.append(f"{len(steps)} export exchanges, each a collective of all "
                         f"{sc.trainer_gpus} trainer ranks; the slowest step: "
                         f"{res.phases[0].limit}")
