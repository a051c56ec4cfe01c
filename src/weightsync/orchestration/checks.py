"""The manager's checks: validation before bytes (:func:`run_validate`), and ``verify``
after (:func:`run_verify`). Called by
:class:`~weightsync.orchestration.manager.CheckpointEngineManager` (``update_weights``,
``verify``) with the :class:`~weightsync.orchestration.group.ReplicaGroup` that makes the
calls and the :class:`~weightsync.orchestration.replicas.ReplicaSet` of the replicas;
owns no state.

**Validation** (every sync, before pause): every trainer rank describes what it will send
for each round (``ws_describe``: names, full shapes, dtypes after the cast, from metadata
only) and every replica checks the union against its model (``ws_check_weights``); any
problem raises ``PlanMismatch`` listing the offending names (``exc.names``, and per
replica ``exc.problems``) before anything is paused or sent. A replica whose adapter
cannot check (no ``check_weights``) is skipped.

**Verify**: every replica's weight digests against the trainer's.

Each replica hashes the tensors of the weight set(s) it holds (``"full"``, or ``"base"``
and ``"adapter"`` after adapter-only syncs) and says which dtype it holds each in; the
trainer ranks export the same set as in a sync (FSDP2 shards gathered to their owners,
the engine's ``dtype`` cast applied) and hash each tensor cast to the replica's dtype, as
the replica's ``copy_`` cast it. Equal digests for every name: the replica holds exactly
the trainer's weights. The trainer side is computed once per weight set and dtype map.
"""

from __future__ import annotations

import hashlib
import json
import time
from typing import Any, Optional

from weightsync.orchestration.calls import Call, call_all
from weightsync.orchestration.group import ReplicaGroup
from weightsync.orchestration.isolation import describe_error
from weightsync.orchestration.replicas import ReplicaRecord, ReplicaSet
from weightsync.core.errors import PlanMismatch
from weightsync.core.digests import MAX_LISTED, combine_digests, compare_digests
from weightsync.orchestration.report import SyncReport, VerifyReport
from weightsync.transport.codec import Quantizer
from weightsync.orchestration import workers as ws

__all__ = ["run_validate", "check_offered", "run_verify"]


def _quantizer(codec: Any) -> Optional[Quantizer]:
    """The FP8 quantizer the engines run with (codec options), or None."""
    if codec is None or not getattr(codec, "quantize", None):
        return None
    return Quantizer(codec.quantize, skip=codec.quantize_skip)


def run_validate(group: ReplicaGroup, replicas: ReplicaSet, report: SyncReport, rounds: list,
                 dtype: Optional[str], codec: Any = None) -> None:
    """Every round's weight set, described by the trainer ranks, checked by every managed
    replica (``PlanMismatch`` before anything moves). With FP8 on the fly (``codec``), the
    set as the replicas will get it: FP8 weights and their scale tensors."""
    quantizer = _quantizer(codec)
    for kind, cfg in rounds:
        described = group.run(group.trainer_calls(ws.DESCRIBE, kind, dtype),
                              "validate", report.version)
        offered, seen = [], set()
        for rank in described:
            for entry in rank:
                if entry[0] not in seen:
                    seen.add(entry[0])
                    offered.append(entry)
        if quantizer is not None:
            offered = quantizer.describe(offered)
        check_offered(group, replicas, report, kind, cfg, offered)


def check_offered(group: ReplicaGroup, replicas: ReplicaSet, report: SyncReport, kind: str,
                  cfg: Any, offered: list) -> None:
    """Every managed replica checks the weight set ``offered`` (``[[name, shape, dtype],
    ...]`` as it will arrive) against its model: ``PlanMismatch`` naming the offending
    tensors of each replica that refuses it."""
    # a replica that accepted this very weight set before is not asked again (the
    # description is re-made every sync, so a changed set is always checked)
    key = hashlib.sha256(json.dumps([kind, cfg, offered], sort_keys=True,
                                    default=str).encode()).hexdigest()
    targets = [r for r in replicas.managed() if r.checked.get(kind) != key]
    report.validated = sorted(set(report.validated) | {r.name for r in targets})
    if not targets:
        return
    answers = group.replica_step(report, "validate", ws.CHECK_WEIGHTS,
                                 (offered, kind, cfg), targets=targets, record=False)
    bad = {r.name: [list(p) for p in a] for r, a in zip(targets, answers) if a}
    for r, a in zip(targets, answers):
        if not a:
            r.checked[kind] = key
    if bad:
        raise _mismatch(bad, kind, report.version)


def _mismatch(bad: dict, kind: str, version: Any) -> PlanMismatch:
    names = sorted({p[0] for problems in bad.values() for p in problems})
    listed = "; ".join(f"{who}: " + ", ".join(f"{n} ({why})" for n, why in problems[:MAX_LISTED])
                       for who, problems in bad.items())
    err = PlanMismatch(f"the {kind!r} weight set does not fit {sorted(bad)}: {len(names)} "
                       f"offending tensor(s): {listed}"[:8000], peer=next(iter(bad)),
                       phase="validate", version=version)
    err.names, err.problems = names, bad   # type: ignore[attr-defined]
    return err


def _sets(record: ReplicaRecord) -> list[str]:
    return ["base", "adapter"] if record.weights == "base" else ["full"]


def run_verify(group: ReplicaGroup, replicas: ReplicaSet, version: Any, dtype: Optional[str],
               *, fence: bool, codec: Any = None) -> VerifyReport:
    """Every managed replica's digests against the trainer's; ``fence``: those that
    differ are fenced and marked stale. With FP8 on the fly (``codec``), the trainer
    hashes its weights quantized as the engines quantize them (bit-exact: the quantizer
    is deterministic), and their scales."""
    quantizer = _quantizer(codec)
    extra = (quantizer.scheme, list(quantizer.skip)) if quantizer is not None else ()
    start = time.perf_counter()
    report = VerifyReport(version=version)
    records = replicas.managed()
    if not records:
        raise ValueError("no rollout replicas to verify")
    held = _replica_digests(group, records, report, version)
    trainer: dict[tuple[str, str], dict] = {}
    for (name, kind), value in held.items():
        key = (kind, json.dumps(value["dtypes"], sort_keys=True))
        if key not in trainer:
            parts = group.run(group.trainer_calls(ws.DIGEST, kind, value["dtypes"], dtype,
                                                  *extra),
                              "verify", version, timeout=group.call_timeout)
            merged: dict[str, str] = {}
            for part in parts:
                merged.update(part)
            trainer[key] = merged
            report.trainer[kind] = combine_digests(merged)
        bad = compare_digests(trainer[key], value["digests"])
        entry = report.replicas[name]
        entry["digest"][kind] = combine_digests(value["digests"])
        entry["mismatched"] += bad
        entry["ok"] = entry["ok"] and not bad
    if fence:
        _fence_bad(group, replicas, report, records)
    report.seconds = time.perf_counter() - start
    return report


def _replica_digests(group: ReplicaGroup, records: list[ReplicaRecord], report: VerifyReport,
                     version: Any) -> dict[tuple[str, str], dict]:
    """``ws_digest`` of every weight set each replica holds: (name, set) -> its answer;
    an entry per replica in ``report`` (with the error of one that did not answer)."""
    held: dict[tuple[str, str], dict] = {}
    for kind in ("full", "base", "adapter"):
        targets = [r for r in records if kind in _sets(r)]
        outs = call_all([Call(r.name, r.handle, ws.DIGEST, (kind,)) for r in targets],
                        timeout=group.call_timeout, phase="verify", version=version)
        for r, o in zip(targets, outs):
            entry = report.replicas.setdefault(r.name, {
                "ok": True, "digest": {}, "mismatched": [], "error": None})
            if o.ok:
                held[(r.name, kind)] = o.value
            else:
                entry["ok"], entry["error"] = False, describe_error(o.error)
    return held


def _fence_bad(group: ReplicaGroup, replicas: ReplicaSet, report: VerifyReport,
               records: list[ReplicaRecord]) -> None:
    for r in records:
        entry = report.replicas.get(r.name)
        if entry is None or entry["ok"] or entry["error"]:
            continue
        names = entry["mismatched"]
        why = (f"verify: {len(names)} tensor(s) differ from the trainer's: "
               f"{names[:MAX_LISTED]}")
        replicas.mark_stale(r)
        outcome = call_all([Call(r.name, r.handle, ws.FENCE, (why,))],
                           timeout=group.timeout, phase="verify")[0]
        if not outcome.ok:
            entry["error"] = describe_error(outcome.error)
