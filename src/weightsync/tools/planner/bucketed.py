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
(one fluid phase plus the fill of one bucket). A host ring (``shm``) adds what its
``num_slots`` slots stall on buckets of uneven size (:func:`slot_pipeline`: a fill waits
for the drain of the bucket in its slot); the GPU ring's and the broadcast's are not
modelled. ``collective`` ``ring`` (NCCL): a chain
through the receivers, node by node, channels spread over every receiving GPU's NIC;
``star`` (gloo): the root sends each receiver its own copy, at most ``collective.GBps``
per stream. ``ring``: receivers read the slots in place (shared memory: a copy through
host memory; CUDA IPC: the same GPU's memory, or NVLink); it needs one node. On a host,
tensors of at least ``direct_min_bytes`` skip the buckets: ``collective`` broadcasts them
as they are, ``shm`` lets each receiver read them from the trainer one at a time.
Software: ``tensor_us`` per tensor on each side, ``bucket_us`` (+ ``op_us`` for a
collective) per bucket or direct tensor. A ``cuda_ipc`` ring adds ``handoff_us`` per bucket
one after another (the slot's trip from trainer to receiver and back, which the copies of
the other slot do not hide; its owners hand off at once), and ``finish_us`` once at the
end of the sync (the trainer's closing message and the receivers' last acknowledgement,
beyond the last bucket's copies). The ring orders each bucket's copies on the GPU with
CUDA events, so the trainer's packs overlap its host work.

``shm`` on a host, as :mod:`weightsync.transport.backends.shm.engine` runs it:

* copy threads (``fastcopy.copy_threads``, ``WEIGHTSYNC_COPY_THREADS`` unset): a receiver
  has the host's ``cores`` shared by the receivers (at most 16); it splits its copies out
  of a bucket of at least 8 MiB over them while it has at least 3 and the receivers
  together no more than the cores; the trainer's push pool has min(4, cores). A split
  copy runs that many times the one-thread ``device_mem`` rate, within ``host_mem``;
* ``Scenario.trainer_device="gpu"``: the trainer's tensors are CUDA tensors. Each bucket is
  a device-to-host copy into the pinned ring (``links.d2h``, no core), none go direct;
* ``shared="trainer"`` (shared read): a direct tensor is copied by every receiver with
  ``memcpy`` out of a mapping of the trainer's storage over its copy threads, instead of
  read with ``process_vm_readv`` (``ring.direct_GBps``); direct reads happen as before
  (``direct_max_receivers``), the rest takes the ring;
* ``shared="receivers"`` (push): every tensor is written by its owner straight into every
  receiver's memory, receiver after receiver, no bucket, no receiver copy; a CPU trainer
  with ``memmove`` over its push threads (8 MiB or more) one tensor at a time, a GPU
  trainer by queued device-to-host copies. One offer from each receiver at the start
  (``LandMsg``) and one message naming the tensors at the end, which receivers then go
  through.

``cuda_ipc`` on GPUs (a gpu links file), as :mod:`weightsync.transport.backends.cuda_ipc`
runs it:

* ``shared="trainer"`` (zero-copy): every tensor sent as it is kept (no cast) is read by
  each receiver straight from the trainer's memory: one copy per receiver, no pack. The
  trainer announces them in batches (:func:`zero_copy_batches`: the bucket size first,
  each next batch twice the last); the first copy waits for the first batch's host time;
* ``shared="receivers"`` / ``"both"`` (pushes): the trainer copies every tensor into each
  receiver's own, holding batches of an eighth of a bucket (the first copy waits for the
  first one's host time); the receivers go through the pushed tensors after the copies.
"""

from __future__ import annotations

import math
from collections import defaultdict

import numpy as np

from weightsync.core.plan import build_plan, itemsize
from weightsync.trainer.export import ExportItem, assign_owners
from weightsync.transport.protocol.ownership import owner_of
from weightsync.transport.fastcopy import AUTO_MAX_THREADS, SPLIT_MIN
# the shm receiver's own rule for splitting its copies out of a bucket
from weightsync.transport.backends.shm.engine import SPLIT_BYTES, SPLIT_MIN_THREADS
from weightsync.transport.backends.collective import COLLECTIVE_DIRECT_MIN
from weightsync.transport.backends.cuda_ipc.refs import MAX_REF_ENTRIES
from weightsync.tools.planner.compiled import rank_boxes
from weightsync.tools.planner.linkmodel import Loads, PhaseResult, StrategyResult
from weightsync.tools.planner.rules import PlannedTensor, kept_bytes
from weightsync.tools.planner.scenario import Placement, Scenario

__all__ = ["predict_bucketed", "owners_of", "exchanges", "COALESCE_BYTES",
           "COLLECTIVE_DIRECT_MIN", "copy_threads", "slot_pipeline", "zero_copy_batches"]

COALESCE_BYTES = 16 << 20          # export_weights(coalesce_bytes=...) default


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
          direct: bool, split: float = 0.0) -> float:
    """Put one stream's bytes of a step on the wire; return the path latency. ``split``:
    of ``nbytes``, what a receiver of a host ring copies out over its copy threads."""
    recv = pl.worker
    if strategy == "ring":
        n = _rx_split_threads(sc, pl)
        for dev in recv:
            if not pl.host:
                loads.move(src, dev, nbytes)
            elif n > 1:
                loads.copy(dev, split, threads=n)
                loads.copy(dev, nbytes - split)
            else:
                loads.copy(dev, nbytes)
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


def copy_threads(sc: Scenario, sharers: int | None) -> int:
    """``fastcopy.copy_threads`` on a host of ``links.cores`` (``WEIGHTSYNC_COPY_THREADS``
    unset): ``sharers`` receivers copying at once share the cores, at most 16 each; without
    (the trainer's push pool) min(4, cores). One where the links give no cores."""
    cores = sc.links.cores
    if not cores:
        return 1
    if sharers is not None:
        return max(1, min(AUTO_MAX_THREADS, cores // max(1, sharers)))
    return max(1, min(4, cores))


def _rx_split_threads(sc: Scenario, pl: Placement) -> int:
    """Threads a host ring's receiver splits its big bucket copies over (``ShmEngine
    ._init_receiver``: at least 3, all receivers' within the cores), else 1."""
    if not pl.host:
        return 1
    n = copy_threads(sc, sc.workers)
    ok = n >= SPLIT_MIN_THREADS and n * sc.workers <= (sc.links.cores or 0)
    return n if ok else 1


def _split_rate(sc: Scenario, threads: int) -> float:
    """Bytes/s of one copy split over ``threads`` threads of a process: each at the one-
    thread rate (``device_mem``), all within the host's memory (``host_mem``); one thread
    is ``device_mem`` alone, as every other copy of the model."""
    links = sc.links
    one = links.link("device_mem").rate
    return one if threads <= 1 else min(threads * one, links.link("host_mem").rate)


def _direct_min(sc: Scenario, pl: Placement, strategy: str) -> int:
    links = sc.links
    if not pl.host:
        return 0
    if strategy == "ring":
        if sc.trainer_device == "gpu" or sc.push:
            # a CUDA tensor is never read across processes (``plain_cpu``); with pushes
            # every tensor is written into the receivers before it could be read
            return 0
        ok = links.direct_min_bytes and sc.workers <= links.direct_max_receivers
        return links.direct_min_bytes if ok else 0
    return sc.collective_direct_min


def _streams(sc: Scenario, pts, owners: list[int], dmin: int,
             push: bool = False, zero_copy: bool = False) -> dict[int, dict]:
    """Per owner: its bucket plan's bucket of each tensor, which tensors go direct, which
    are pushed (``push``: all of them, every receiver offered every tensor) and which are
    read in place (``zero_copy``, ``cuda_ipc``: every tensor sent as it is kept, no cast)
    and in how many announced batches (``zc_batches``, :func:`zero_copy_batches`)."""
    per: dict[int, dict] = defaultdict(lambda: {"bucketed": [], "direct": set(),
                                                "pushed": set(), "zc": []})
    for i, pt in enumerate(pts):
        s = per[owners[i]]
        if push:
            s["pushed"].add(i)
        elif zero_copy and pt.src_dtype == pt.dst_dtype:
            s["zc"].append(i)
        elif dmin and _nbytes(pt) >= dmin:
            s["direct"].add(i)
        else:
            s["bucketed"].append(i)
    for s in per.values():
        batches = zero_copy_batches([_nbytes(pts[i]) for i in s["zc"]], sc.bucket_size)
        order = iter(s["zc"])
        s["zc_batch_of"] = {next(order): b for b, sizes in enumerate(batches) for _ in sizes}
        s["zc_batches"] = len(batches)
        s["zc_set"] = set(s["zc"])
        plan = build_plan([(pts[i].name, pts[i].shape, pts[i].src_dtype) for i in s["bucketed"]],
                          sc.bucket_size)
        index = {pts[i].name: i for i in s["bucketed"]}
        where: dict[str, set] = defaultdict(set)
        for b in plan.buckets:
            for e in b.entries:
                where[e.name].add(b.index)
        s["buckets_of"] = {i: where[pts[i].name] for i in s["bucketed"]}
        s["buckets"] = len(plan.buckets)
        # what each bucket holds, in order: (tensor, bytes of it in the bucket)
        s["layout"] = [[(index[e.name], e.nbytes) for e in b.entries] for b in plan.buckets]
    return per


def _first_push_batch(sizes: list[int], bucket_size: int) -> int:
    """How many tensors a ``cuda_ipc`` trainer holds before it issues its first pushes
    (a batch of an eighth of a bucket, ``PushMixin._tx_push``)."""
    limit, total = max(bucket_size // 8, 1), 0
    for k, n in enumerate(sizes, 1):
        total += n
        if total >= limit:
            return k
    return len(sizes)


def zero_copy_batches(sizes: list[int], bucket_size: int) -> list[list[int]]:
    """``cuda_ipc`` zero-copy's announcements (``ZeroCopyMixin._pack``, default options):
    tensors are announced in order; a batch goes out once it holds the bucket size, the
    next once it holds twice the one before (at most 1024 tensors a batch). Returns the
    tensors' bytes per batch."""
    out: list[list[int]] = []
    cur: list[int] = []
    total = 0
    for n in sizes:
        cur.append(n)
        total += n
        limit = max(1, bucket_size) << min(len(out), 20)
        if total >= limit or len(cur) >= MAX_REF_ENTRIES:
            out.append(cur)
            cur, total = [], 0
    if cur:
        out.append(cur)
    return out


def slot_pipeline(sizes: list[float], fill_rate: float, drain_rate: float, slots: int,
                  handoff: float, fill_alone: float | None = None,
                  drain_alone: float | None = None) -> float:
    """Seconds a ring of ``slots`` buckets takes to pass buckets of ``sizes`` bytes when
    the trainer fills each at ``fill_rate`` bytes/s and a receiver drains it at
    ``drain_rate``: bucket k is filled once bucket k-1 is and the drain of bucket
    k-``slots`` (the one in its slot) is acknowledged; it is drained once it is published
    and bucket k-1 is drained; each message (publish, acknowledgement) takes ``handoff``
    seconds. Equal buckets keep the slower side busy; uneven ones make it wait (with two
    slots and equal rates, a full bucket behind a small one: the trainer waits for the full
    one before it to drain). ``fill_alone`` / ``drain_alone``: a side's rate while the other
    side waits (it then has the memory to itself; default: its rate beside the other)."""
    fill_alone = fill_rate if fill_alone is None else fill_alone
    drain_alone = drain_rate if drain_alone is None else drain_alone
    n = len(sizes)
    fill_end: list[float] = []
    drained: list[float] = []
    t = 0.0
    f_left = float(sizes[0]) if n else 0.0      # bytes left of the fill in progress
    d_left = float(sizes[0]) if n else 0.0
    while len(drained) < n:
        k, j = len(fill_end), len(drained)
        # when the next fill / drain may start (None: it waits on one not yet done)
        f_at = None
        if k < n:
            f_at = fill_end[k - 1] if k else 0.0
            if k >= slots:
                f_at = max(f_at, drained[k - slots] + handoff) if j > k - slots else None
        d_at = max(fill_end[j] + handoff, drained[j - 1] if j else 0.0) if j < k else None
        f_on = f_at is not None and f_at <= t
        d_on = d_at is not None and d_at <= t
        fr = (fill_rate if d_on else fill_alone) if f_on else 0.0
        dr = (drain_rate if f_on else drain_alone) if d_on else 0.0
        steps = [f_left / fr if f_on else math.inf, d_left / dr if d_on else math.inf]
        steps += [at - t for at in (f_at, d_at) if at is not None and at > t]
        dt = min(steps)
        if dt == math.inf:       # cannot happen: the drain of a filled bucket can always run
            raise RuntimeError("slot_pipeline: no step can run")
        t += dt
        if f_on:
            f_left -= fr * dt
            if f_left <= 1e-9 * sizes[k] or steps[0] == dt:
                fill_end.append(t)
                f_left = float(sizes[k + 1]) if k + 1 < n else 0.0
        if d_on:
            d_left -= dr * dt
            if d_left <= 1e-9 * sizes[j] or steps[1] == dt:
                drained.append(t)
                d_left = float(sizes[j + 1]) if j + 1 < n else 0.0
    return drained[-1] if drained else 0.0


def _ring_sizes(streams: dict[int, dict], step: list[int], owners: list[int]) -> list[list[int]]:
    """Per owner of a step's tensors, the bytes each of its buckets carries of them."""
    mine = set(step)
    out = []
    for o in sorted({owners[i] for i in step}):
        sizes = [sum(n for i, n in b if i in mine) for b in streams[o]["layout"]]
        out.append([n for n in sizes if n])
    return out


def _shared_read_rate(sc: Scenario) -> float:
    """Bytes/s of all receivers' reads of one direct tensor out of the trainer's shared
    memory (``ShmEngine._rx_mapped``): each receiver a ``memcpy`` split over its copy
    threads (a direct tensor is at least 8 MiB, so it is split), every thread at the one-
    thread rate, all of them within the host's memory."""
    one = sc.links.link("device_mem").rate
    threads = copy_threads(sc, sc.workers)
    return min(sc.workers * threads * one, sc.links.link("host_mem").rate)


def _push_seconds(sc: Scenario, per_owner: list[list[int]]) -> float:
    """A CPU trainer's pushes (``ShmEngine._tx_push``; ``per_owner``: the bytes of each
    tensor an owner pushes): each owner writes its tensors one after another into every
    receiver, one receiver after another, each tensor of 8 MiB or more split over its push
    threads (``split_memmove``), the rest on one thread; the receivers wait meanwhile, so
    the cores are the trainer's. Owners push at once and share the host's memory and
    cores."""
    links, receivers = sc.links, sc.workers
    threads = copy_threads(sc, None)
    one = links.link("device_mem").rate
    per = [sum(receivers * b / _split_rate(sc, threads if b >= SPLIT_MIN else 1)
               for b in sizes) for sizes in per_owner]
    total = receivers * sum(sum(sizes) for sizes in per_owner)
    shared = total / links.link("host_mem").rate
    cores = total / (links.cores * one) if links.cores else 0.0
    return max(max(per, default=0.0), shared, cores)


#: what the seconds a step runs one after another are, per shm path
_SERIAL = {"direct": "direct tensors, read one at a time (shm)",
           "shared": "direct tensors, copied out of the trainer's shared memory one at a "
                     "time (shm shared read)",
           "push": "pushes into every receiver's memory, tensor after tensor and receiver "
                   "after receiver (shm push)",
           "handoff": "each bucket's slot handed from trainer to receivers and back, "
                      "and the sync's closing handshake (cuda_ipc ring, "
                      "software.handoff_us, finish_us)"}


def _deliver(sc, pl, strategy, pts, step, owners, streams, kept,
             first_step: bool = True, last_step: bool = True) -> tuple[Loads, float, str, Loads]:
    """Loads of one step's delivery, the seconds of what it runs one after another (shm's
    direct reads, a CPU trainer's pushes and the receivers' pass over what was pushed),
    what those are (a key of :data:`_SERIAL`), and the bytes of a CPU trainer's pushes
    (priced in those seconds; returned for the per-link totals only)."""
    loads = Loads(pl, sc.links.collective_cap)
    sw = pl.links_of(pl.trainer[0]).software
    lat, serial, first, held = 0.0, 0.0, 0.0, 0.0
    gpu = sc.trainer_device == "gpu"
    receivers = len(pl.worker)
    shared_read = strategy == "ring" and sc.shared == "trainer" and pl.host
    what = "shared" if shared_read else "direct"
    direct_rate = _shared_read_rate(sc) if shared_read else sc.links.direct_rate
    # a trainer that waits for each direct read before its next item (direct_window 1):
    # the receivers idle while their acknowledgement travels and the next header comes
    waited = sw["direct_wait_us"] if sc.links.direct_window < 2 else 0.0
    cpu_pushes: dict[int, list[int]] = {}     # owner -> bytes of each tensor it pushes
    handoff = 0.0       # cuda_ipc ring: the busiest owner's bucket handoffs, one by one
    slots_used = False  # cuda_ipc ring: some owner passed buckets through its slots
    by_owner: dict[int, list[int]] = defaultdict(list)
    for i in step:
        by_owner[owners[i]].append(i)
    for o, idx in by_owner.items():
        s, src = streams[o], pl.trainer[o]
        pushed = [_nbytes(pts[i]) for i in idx if i in s["pushed"]]
        zc = s["zc_set"]
        bucketed = [i for i in idx if i not in s["direct"] and i not in s["pushed"]
                    and i not in zc]
        direct = [i for i in idx if i in s["direct"]]
        nb = sum(_nbytes(pts[i]) for i in bucketed)
        # a receiver splits a copy of 8 MiB or more (a whole tensor, or a bucket's chunk
        # of one bigger than the bucket)
        split = sum(_nbytes(pts[i]) for i in bucketed
                    if min(_nbytes(pts[i]), sc.bucket_size) >= SPLIT_BYTES)
        buckets = len(set().union(*(s["buckets_of"][i] for i in bucketed))) if bucketed else 0
        if gpu:         # device-to-host into the pinned ring
            loads.d2h(src, nb)
        else:
            loads.copy(src, nb)
        lat = max(lat, _wire(loads, sc, pl, strategy, src, nb, False, split))
        read = sum(_nbytes(pts[i]) for i in idx if i in zc)
        if read:    # cuda_ipc zero-copy: each receiver copies out of the trainer's tensors
            lat = max(lat, _wire(loads, sc, pl, strategy, src, read, False))
        if pushed and not pl.host:  # cuda_ipc: the trainer's copies into every receiver
            for dev in pl.worker:
                loads.move(src, dev, sum(pushed))
        elif pushed and gpu:       # queued on one stream: the copy engine, back to back
            loads.d2h(src, receivers * sum(pushed))
        elif pushed:
            cpu_pushes[o] = pushed
        if strategy == "ring" and not pl.host:
            handoff = max(handoff, buckets * sw["handoff_us"])
            slots_used = slots_used or buckets > 0
        ops = buckets + len(direct) + len({s["zc_batch_of"][i] for i in idx if i in zc})
        extra = sw["op_us"] if strategy == "broadcast" else 0.0
        loads.work(f"trainer rank {o}",
                   len(idx) * sw["tensor_us"] + ops * (sw["bucket_us"] + extra))
        first = max(first, min(nb, sc.bucket_size))
        if first_step and (zc or pushed) and not pl.host:
            # cuda_ipc: the first copy waits for the host to announce the first zero-copy
            # batch (a bucket's worth of tensors) or to hold the first batch of pushes (an
            # eighth of a bucket)
            batch = [i for i in idx if s["zc_batch_of"].get(i) == 0] if zc else \
                _first_push_batch([_nbytes(pts[i]) for i in idx if i in s["pushed"]],
                                  sc.bucket_size)
            held = max(held, (len(batch) if zc else batch) * sw["tensor_us"])
        for i in direct:
            b = _nbytes(pts[i])
            if strategy == "broadcast":
                _wire(loads, sc, pl, strategy, src, b, True)
            else:       # shm direct: every receiver reads it, the trainer waits for all
                serial += b * len(pl.worker) / direct_rate + sw["control_us"] + waited
    if slots_used and last_step:
        # the sync's end, once: the trainer's closing message and the last acknowledgement
        handoff += sw["finish_us"]
    if handoff:
        serial += handoff
        what = "handoff"
    pushing = strategy == "ring" and sc.push
    side = Loads(pl)        # what the serial part moves: for the links report only
    if cpu_pushes:
        serial += _push_seconds(sc, list(cpu_pushes.values()))
        threads = copy_threads(sc, None)
        for o, sizes in cpu_pushes.items():
            big = sum(b for b in sizes if b >= SPLIT_MIN)
            side.copy(pl.trainer[o], receivers * big, threads=threads)
            side.copy(pl.trainer[o], receivers * (sum(sizes) - big))
    if pushing:
        what = "push"
        # receivers wait for the message naming the pushed tensors (sent once they are
        # written), then go through them: after the copies, not beside them
        serial += len(step) * sw["tensor_us"]
    for n, dev in enumerate(pl.worker):
        g = n % sc.replica_size
        if strategy == "broadcast":
            loads.copy(dev, sum(kept[g][i] for i in step if i not in streams[owners[i]]["direct"]))
        if not pushing:
            loads.work(pl.who(dev), len(step) * sw["tensor_us"])
    # pipeline fill: the stages that are not the bottleneck, for one bucket (pack, unpack);
    # a GPU trainer packs by device-to-host copies, a receiver may unpack over its threads
    pack, unpack = _pack_unpack(sc, pl, strategy)
    loads.latency = lat + sw["control_us"] + first / pack + first / unpack + held
    if pushing and first_step:  # every receiver's offer (LandMsg) before the first tensor
        loads.latency += sw["control_us"]
    return loads, serial, what, side


def _pack_unpack(sc: Scenario, pl: Placement, strategy: str) -> tuple[float, float]:
    """Bytes/s of one side alone: the trainer's pack into a slot (a GPU trainer's by
    device-to-host copies) and a receiver's copy out of it (over its threads, if split)."""
    copy_rate = pl.links_of(pl.trainer[0]).link("device_mem").rate
    pack = sc.links.link("d2h").rate if sc.trainer_device == "gpu" else copy_rate
    threads = _rx_split_threads(sc, pl) if strategy == "ring" else 1
    unpack = _split_rate(sc, threads) if threads > 1 else copy_rate
    return pack, unpack


def _applicable(sc: Scenario, pl: Placement, strategy: str) -> str:
    if strategy == "broadcast" and not pl.host and set(pl.worker) & set(pl.trainer):
        return ("broadcast (collective on NCCL) needs every rank on its own GPU; this "
                "layout shares GPUs between trainer ranks and rollout workers")
    if strategy == "ring":
        nodes = {d[0] for d in pl.trainer + pl.worker}
        if len(nodes) > 1:
            return (f"ring (shm / cuda_ipc) needs every trainer rank and rollout worker on one "
                    f"node; this layout spans {len(nodes)} nodes")
    elif sc.trainer_device == "gpu":
        return (f"{strategy} from a GPU trainer into processes of a host is not modelled "
                "(trainer.device gpu: ring, i.e. shm, only)")
    return ""


def predict_bucketed(sc: Scenario, pl: Placement, pts: list[PlannedTensor],
                     strategy: str) -> StrategyResult:
    res = StrategyResult(strategy)
    res.reason = _applicable(sc, pl, strategy)
    if res.reason:
        res.applicable = False
        return res
    owners = owners_of(sc, pts)
    push = strategy == "ring" and sc.push
    zero_copy = strategy == "ring" and not pl.host and sc.shared == "trainer"
    streams = _streams(sc, pts, owners, _direct_min(sc, pl, strategy), push, zero_copy)
    kept = [[kept_bytes(pt, g) for pt in pts] for g in range(sc.replica_size)]
    steps = exchanges(sc, pts)
    gathered = gathers(sc)
    host_ring = strategy == "ring" and pl.host and not push
    total_g = total_d = 0.0
    worst: dict[str, PhaseResult] = {}
    totals = {"gather": Loads(pl), "deliver": Loads(pl, sc.links.collective_cap)}
    for k, step in enumerate(steps):
        parts = [("gather", _gather(sc, pl, pts, step, owners), 0.0, "")] if gathered else []
        loads, serial, what, side = _deliver(sc, pl, strategy, pts, step, owners, streams,
                                             kept, first_step=k == 0,
                                             last_step=k == len(steps) - 1)
        parts.append(("deliver", loads, serial, what))
        totals["deliver"].absorb(side)
        ring = _ring_sizes(streams, step, owners) if host_ring else []
        for name, ld, ser, what in parts:
            r = ld.result(name)
            if name == "deliver" and ring:
                _ring_stalls(r, ring, sc, pl)
            r.seconds += ser
            if ser > r.limit_seconds:
                r.limit, r.limit_seconds = _SERIAL[what], ser
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


def _ring_stalls(r: PhaseResult, ring: list[list[int]], sc: Scenario, pl: Placement) -> None:
    """What uneven buckets cost a host ring beyond the fluid model: each owner's stalls
    (:func:`slot_pipeline` of its buckets against the same bytes in as many equal buckets).
    While both sides copy, the slower one runs at the rate the fluid model gives it (the
    owner's bytes over the phase's seconds), the other that much faster as it is alone
    (pack vs unpack); while one side waits, the other has the host's memory to itself and
    copies at its own rate (pack, or each receiver's unpack, within ``host_mem``, which
    the receivers share), never slower than beside the other. Equal buckets add nothing;
    full buckets behind part-full ones do."""
    fluid = r.limit_seconds
    if fluid <= 0:
        return
    handoff = pl.links_of(pl.trainer[0]).software["control_us"]     # seconds
    pack, unpack = _pack_unpack(sc, pl, "ring")
    host = sc.links.link("host_mem").rate
    stall = 0.0
    for sizes in ring:
        if len(sizes) < 2:
            continue
        total = sum(sizes)
        rate = total / fluid
        fill, drain = rate * pack / min(pack, unpack), rate * unpack / min(pack, unpack)
        # the receivers drain each bucket at once: alone, they share the memory among them
        alone = {"fill_alone": max(fill, min(pack, host)),
                 "drain_alone": max(drain, min(unpack, host / max(1, sc.workers)))}
        even = [total / len(sizes)] * len(sizes)
        stall = max(stall, slot_pipeline(sizes, fill, drain, sc.num_slots, handoff, **alone)
                    - slot_pipeline(even, fill, drain, sc.num_slots, handoff, **alone))
    if stall > 0.01 * fluid:        # under 1 %: a last part-full bucket, no matter
        r.seconds += stall
        r.limit_seconds += stall
        r.limit += (f"; the ring's {sc.num_slots} slots stall on buckets of uneven size "
                    f"(+{stall * 1e3:.3g} ms)")


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
    ops = sum(s["buckets"] + len(s["direct"]) + s["zc_batches"] for s in streams.values())
    res.dest_reads = [float(ops)] * sc.workers
    note = _shm_note(sc, pl, res.strategy)
    if note:
        res.notes.append(note)
    if len(steps) > 1:
        res.notes.append(f"{len(steps)} export exchanges, each a collective of all "
                         f"{sc.trainer_gpus} trainer ranks; the slowest step: "
                         f"{res.phases[0].limit}")


def _shm_note(sc: Scenario, pl: Placement, strategy: str) -> str:
    """What a ring ran: on a host (shm) the trainer's device, the shared-memory path,
    threads; on GPUs (cuda_ipc) zero-copy or pushes."""
    if strategy != "ring":
        return ""
    if not pl.host:
        if sc.push:
            return ("cuda_ipc pushes: the trainer copies every tensor straight into each "
                    "receiver's own, no ring")
        if sc.shared == "trainer":
            return ("cuda_ipc zero-copy: receivers copy every tensor sent as it is kept "
                    "straight out of the trainer's memory, no ring")
        return ""
    gpu = sc.trainer_device == "gpu"
    src = "GPU trainer (device-to-host over links.d2h)" if gpu else "CPU trainer"
    if sc.push:
        by = "queued device-to-host copies" if gpu else \
            f"{copy_threads(sc, None)} push threads for tensors of >= 8 MiB"
        how = f"push into each receiver's shared memory, receiver after receiver ({by}), no ring"
    elif sc.shared == "trainer" and _direct_min(sc, pl, strategy):
        how = (f"shared read: direct tensors copied out of the trainer's shared memory over "
               f"{copy_threads(sc, sc.workers)} copy threads per receiver")
    elif sc.shared == "trainer":
        how = (f"ring: no direct tensors with {sc.workers} receivers (at most "
               f"{sc.links.direct_max_receivers}), so the trainer's shared memory is not read")
    else:
        how = "ring"
    if sc.links.direct_window < 2 and not sc.push and _direct_min(sc, pl, strategy):
        how += ("; the trainer waits for each direct read before its next item "
                f"(ring.direct_window 1: +{sc.links.sw('direct_wait_us') * 1e6:.0f} us a read)")
    n = _rx_split_threads(sc, pl)
    if n > 1 and not sc.push:
        how += f"; receivers split bucket copies of >= 8 MiB over {n} threads"
    return f"shm, {src}: {how}"
