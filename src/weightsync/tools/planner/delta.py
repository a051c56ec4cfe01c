"""Delta syncs (``delta+<backend>``, :mod:`weightsync.transport.codec`) on the link model.

Owns :func:`predict_delta`: one strategy of a :class:`~.scenario.Scenario` with
``delta`` set (the fraction of each tensor's elements that changed since the last sync),
as the codec runs it over the strategy's transport, warm (every receiver holds the base):

* what goes on the wire: per tensor the codec's own record
  (:func:`weightsync.transport.codec.delta.record_size`: changed positions or a bitmap, the
  values, a header, a size class) when it is smaller than the tensor, else the tensor;
  tensors of at most :data:`~weightsync.transport.codec.state.SMALL` bytes go dense. The
  codec serves no shards (its engine drops the ``shards`` capability), so every worker
  of a replica takes every record and every dense tensor whole, and a sharded trainer
  gathers each tensor to its owner first, as the bucketed exports do;
* the transport below it moves those records as it moves tensors, in buckets of at most
  :data:`~weightsync.transport.codec.engine.DELTA_BUCKET` (the same strategy code,
  :func:`~.bucketed.predict_bucketed` / :func:`~.p2p.predict_p2p`, on the records);
* the codec's work, from ``links.codec``: each trainer rank encodes the bytes it sends
  (``encode_GBps``: the diff against its copy of the last sync; ``encode_ns`` for each of
  its changed elements: gathering it, its index, its digest), each worker applies every
  tensor (``apply_GBps``: the weights it checks and patches; ``apply_ns`` a changed
  element: the scatter, the digest of the change). A receiver applies a record bucket once it has it
  while the trainer encodes the next: a two-stage pipeline over the record buckets, so a
  sync whose records fit one bucket encodes everything, then applies everything. On a
  host whose links give ``cores``, every process's codec work shares them.

The sync is then: the dense gather of a sharded trainer (the strategy's own ``gather``
phase, or the bucketed export's for ``p2p``), the codec's pipeline, and the transport's
phases on the records after it (records are a few percent of the bytes; priced after the
pipeline, not hidden under it). Not modelled: the first sync (dense, it sets the bases),
a receiver without its base (dense to all), ``delta_max_bytes`` (every tensor tracked),
resends after a digest mismatch, and the trainer's hashing of its copies after the sync.
"""

from __future__ import annotations

import dataclasses
import math

from weightsync.core.plan import itemsize
from weightsync.tools.planner.bucketed import predict_bucketed
from weightsync.tools.planner.compiled import pull_stats
from weightsync.tools.planner.errors import PlannerError
from weightsync.tools.planner.linkmodel import PhaseResult, StrategyResult
from weightsync.tools.planner.p2p import predict_p2p
from weightsync.tools.planner.rules import PlannedTensor
from weightsync.tools.planner.scenario import Placement, Scenario
from weightsync.transport.codec.delta import record_size
from weightsync.transport.codec.engine import DELTA_BUCKET
from weightsync.transport.codec.state import SMALL

__all__ = ["predict_delta", "records", "RECORD_DTYPE"]

#: records are bytes (``uint8`` tensors) on the wire
RECORD_DTYPE = "uint8"


def _whole(pt: PlannedTensor, workers: int) -> tuple:
    return tuple((tuple((0, n) for n in pt.shape),) for _ in range(workers))


def records(pts: list[PlannedTensor], changed: float, workers: int
            ) -> tuple[list[PlannedTensor], int, int]:
    """What the codec sends for ``pts`` (as the trainer sends them: ``src_dtype``) when
    ``changed`` of each tensor's elements differ from the base: a record per tensor
    where it is smaller, else the tensor, each kept whole by every one of ``workers``.
    Returns (tensors, bytes as records, bytes sent dense)."""
    out, rec_bytes, dense_bytes = [], 0, 0
    for pt in pts:
        k = itemsize(pt.src_dtype)
        n = math.prod(pt.shape)
        size = None
        if n * k > SMALL:
            size = record_size(pt.shape, k, round(changed * n))
        if size is None:
            dense_bytes += n * k
            out.append(dataclasses.replace(pt, boxes=_whole(pt, workers), held=None))
            continue
        rec_bytes += size
        box = ((0, size),)
        out.append(PlannedTensor(pt.name, (size,), "replicated", RECORD_DTYPE,
                                 RECORD_DTYPE, tuple((box,) for _ in range(workers)), None))
    return out, rec_bytes, dense_bytes


def _codec_of(links, side: str) -> dict[str, float]:
    if not links.codec:
        raise PlannerError(f"links.codec.{side}_GBps", f"missing in links file {links.name!r} "
                                                        f"(needed by delta)")
    return {side: links.codec[side], f"{side}_ns": links.codec[f"{side}_ns"]}


def _pipeline(encode: float, apply: float, buckets: int) -> float:
    """Two stages over ``buckets`` equal parts: each part is encoded, then applied, and the
    next part's encode runs beside this part's apply."""
    return max(encode, apply) + min(encode, apply) / max(1, buckets)


def predict_delta(sc: Scenario, pl: Placement, pts: list[PlannedTensor], strategy: str
                  ) -> tuple[StrategyResult, dict]:
    """``strategy`` of ``sc`` (``sc.delta`` set) as the codec runs it over that transport;
    with the figures of the records (bytes as records and sent dense, the dense bytes they
    stand for, record buckets, codec seconds)."""
    # the trainer encodes on its nodes, the workers apply on theirs
    codec = {**_codec_of(sc.links, "encode"), **_codec_of(sc.rollout_links or sc.links, "apply")}
    workers = sc.replica_size
    recs, rec_bytes, dense_sent = records(pts, sc.delta, workers)
    inner_bucket = min(sc.bucket_size, DELTA_BUCKET)
    inner = dataclasses.replace(sc, delta=None, bucket_size=inner_bucket, strategies=(strategy,),
                                serve="staging")
    if strategy == "p2p":
        stats = pull_stats(recs, inner.trainer_gpus, workers, inner.max_read_bytes,
                           inner.trainer_shard, inner.replicas)
        wire = predict_p2p(inner, pl, recs, stats)
        # the dense gather of a sharded trainer: the bucketed export's
        dense = predict_bucketed(dataclasses.replace(sc, delta=None), pl, pts, "broadcast")
    else:
        wire = predict_bucketed(inner, pl, recs, strategy)
        dense = predict_bucketed(dataclasses.replace(sc, delta=None), pl, pts, strategy)
    if not wire.applicable:
        return wire, {}
    gather = [p for p in dense.phases if p.name.startswith("gather")]
    sent = sum(math.prod(pt.shape) * itemsize(pt.src_dtype) for pt in pts)
    changes = sum(round(sc.delta * math.prod(pt.shape)) for pt in pts)
    ranks = dense.source_bytes or [sent]

    def work(side: str, nbytes: float) -> float:      # a rank's share of the changes too
        return nbytes / codec[side] + changes * nbytes / max(sent, 1) * codec[f"{side}_ns"]
    encodes = [work("encode", b) for b in ranks]
    encode, apply = max(encodes), work("apply", sent)
    buckets = max(1, math.ceil(rec_bytes / inner_bucket))
    seconds = _pipeline(encode, apply, buckets)
    limit = (f"trainer rank {encodes.index(encode)} encode ({max(ranks) / 1e9:.3g} GB, "
             f"{changes * max(ranks) / max(sent, 1):.3g} changed elements)" if encode >= apply else
             f"every worker's apply ({sent / 1e9:.3g} GB, {changes:.3g} changed elements)")
    cores = sc.links.cores
    if pl.host and cores:
        busy = sum(encodes) + len(pl.worker) * apply
        if busy / cores > seconds:
            seconds = busy / cores
            limit = f"the host's {cores} cores (every process's encode and apply)"
    phase = PhaseResult(f"delta: encode + apply ({buckets} record bucket"
                        f"{'s' if buckets > 1 else ''})", seconds, limit, seconds, 0.0)
    rest = [p for p in wire.phases if not p.name.startswith("gather")]
    out = dataclasses.replace(wire, phases=gather + [phase] + rest,
                              seconds=sum(p.seconds for p in gather + [phase] + rest),
                              notes=list(wire.notes) + [
                                  f"delta at {sc.delta:g} of each tensor's elements: "
                                  f"{rec_bytes / 1e9:.4g} GB of records and "
                                  f"{dense_sent / 1e9:.4g} GB dense for {sent / 1e9:.4g} GB; "
                                  f"every worker applies all of it (the codec serves no "
                                  f"shards)" + (f", so each TP/EP worker also keeps a whole "
                                                f"base copy of {sent / 1e9:.4g} GB to apply "
                                                f"onto" if workers > 1 else "")])
    return out, {"changed": sc.delta, "record_bytes": rec_bytes, "dense_sent_bytes": dense_sent,
                 "dense_bytes": sent, "changed_elements": changes,
                 "record_buckets": buckets, "encode_s": encode,
                 "apply_s": apply, "codec_s": seconds}
