"""Elastic joins: bring a replica added between syncs to the current version at once,
without touching the other replicas.

Used by :meth:`~weightsync.orchestration.manager.CheckpointEngineManager.add_replica` when
the backend has the ``join`` capability (``nixl``), a sync has completed on a kept group,
and that sync sent the full weights. Where the version is read from (``source``):

* ``"trainer"``: every trainer rank offers the version it served last (``join_offer``:
  its layout, a lease its next send waits for);
* ``"replica"``: a healthy replica at that version offers what its last sync landed (one
  worker holding every tensor whole: an HF replica, a vLLM replica without tensor
  parallelism), so the trainer ranks are not asked at all; its lease delays only that
  replica's next receive, and only while the join still reads;
* ``"auto"`` (default): the trainer ranks if all of them offer within ``wait_s`` (they
  may be busy: a Ray actor in a training step answers nothing until the step ends), else
  a healthy replica. Leases of offers given up on are ended without waiting (the
  engine refuses an offer that arrives under an ended lease).

Then, all bounded: the new replica is checked against that weight set (validation before
bytes: ``PlanMismatch`` before any of it moves; described by the trainer ranks, or from
the replica's offer when the trainers are not asked); its workers are prepared and
initialised from the offers (``join_topology``); it receives the version through its
usual ``ws_receive`` (so an HF or vLLM replica loads it exactly as in a sync; a
tensor-parallel vLLM worker pulls only its slices); the leases end (``join_done``); it is
marked healthy at that version and routed to. Nothing but the offer and the lease's end is
called on the source replica, and nothing on the others: they keep generating. The next
sync rebuilds the group with the new replica in it.
"""

from __future__ import annotations

import logging
import secrets
import time
from typing import Any, Optional

from weightsync.core.errors import WeightSyncError
from weightsync.orchestration.calls import Call, call_all, post_all
from weightsync.orchestration.checks import check_offered, run_validate
from weightsync.orchestration.group import ReplicaGroup
from weightsync.orchestration.replicas import ReplicaRecord, ReplicaSet
from weightsync.orchestration.report import SyncReport
from weightsync.orchestration import workers as ws

__all__ = ["can_join", "join_replica", "JOIN_FROM", "JOIN_WAIT_S"]

logger = logging.getLogger(__name__)
#: where a joiner may read the current version from (see the module doc)
JOIN_FROM = ("auto", "trainer", "replica")
#: how long ``"auto"`` waits for every trainer rank's offer before asking a replica
JOIN_WAIT_S = 2.0


def can_join(group: ReplicaGroup, version: Any, kinds: list, keep_group: bool) -> Optional[str]:
    """Why a replica added now cannot join at once (None: it can)."""
    if "join" not in getattr(group.engine_cls, "capabilities", ()):
        return f"the {group.backend} backend cannot serve joiners"
    if version is None:
        return "no sync has completed yet"
    if not keep_group:
        return "keep_group=False finalizes the trainers' engines after each sync"
    if list(kinds) != ["full"]:
        return f"the last sync sent {kinds}, not the full weights"
    return None


def join_replica(group: ReplicaGroup, replicas: ReplicaSet, record: ReplicaRecord,
                 version: Any, dtype: Optional[str], codec: Any = None,
                 lease_s: Optional[float] = None, *, source: str = "auto",
                 wait_s: Optional[float] = None, colocated: bool = False) -> dict:
    """Bring ``record`` to ``version`` (see the module doc); returns its receive's figures
    plus ``seconds`` and ``source`` (``"trainer ranks"`` or the source replica's name).
    Raises (the caller decides what follows); the leases are ended whatever happens."""
    if source not in JOIN_FROM:
        raise ValueError(f"join source must be one of {JOIN_FROM}, got {source!r}")
    start = time.perf_counter()
    report = SyncReport(version=version)
    lease_s = float(lease_s if lease_s is not None else group.call_timeout)
    offers, holders, why, origin = None, [], [], "trainer ranks"
    if source != "replica":
        wait = group.timeout if source == "trainer" else float(wait_s or JOIN_WAIT_S)
        offers, holders = _offers(group.trainer_calls("execute_checkpoint_engine"), record,
                                  lease_s, wait, version, why)
        if offers is None and source == "trainer":
            raise why[0]
    if offers is None:
        if colocated:
            why.append(WeightSyncError("colocated replicas take turns with the trainer, so "
                                       "none is asked to serve a joiner", phase="join",
                                       version=version))
        else:
            offers, holders = _from_replica(group, replicas, record, version, lease_s, why)
            origin = holders[0].label if holders else ""
        if offers is None:
            raise WeightSyncError(f"no source could offer version {version!r} to "
                                  f"{record.name}: " + "; ".join(str(e) for e in why)[:3000],
                                  peer=record.name, phase="join", version=version)
    try:
        if origin == "trainer ranks":
            run_validate(group, _Only(replicas, record), report, [("full", None)], dtype, codec)
        else:
            check_offered(group, _Only(replicas, record), report, "full", None,
                          group.engine_cls.join_weights(offers))
        if not replicas.is_managed(record):
            raise WeightSyncError(f"{record.name} failed its check before the join",
                                  peer=record.name, phase="join", version=version)
        def one(method: str, *args: Any, **kw: Any) -> Call:
            return Call(record.name, record.handle, method, args, kw)

        metas = group.run([one(ws.PREPARE, group.backend, group.engine_kwargs)], "join",
                          version)[0]
        kwargs = group.engine_cls.join_topology(offers, len(metas))
        group.run([one(ws.INIT, kwargs)], "join", version)
        group.run([one(ws.BEGIN_SYNC, version, ["full"])], "join", version)
        stats = group.run([one(ws.RECEIVE, version, kind="full")], "join", version,
                          timeout=group.call_timeout)[0]
        group.run([one(ws.RESET_CACHES)], "join", version)
    finally:
        outs = call_all([_end(c, o["lease"]) for c, o in zip(holders, offers)],
                        timeout=group.timeout, phase="join", version=version)
        for o in outs:
            if not o.ok:
                logger.warning("weightsync: ending a join lease on %s failed: %s", o.label,
                               o.error)
    record.state, record.version, record.weights = "healthy", version, "full"
    out = dict(stats or {})
    out["seconds"] = time.perf_counter() - start
    out["source"] = origin
    logger.info("weightsync: %s joined at version %s from %s in %.3f s (%s bytes), no other "
                "replica paused", record.name, version, origin, out["seconds"],
                out.get("bytes", "?"))
    return out


def _end(call: Call, lease: str) -> Call:
    return Call(call.label, call.handle, "execute_checkpoint_engine", ("join_done", lease))


def _offers(calls: list[Call], record: ReplicaRecord, lease_s: float, wait: float,
            version: Any, why: list) -> tuple[Optional[list], list[Call]]:
    """Every offer of ``calls`` (one per source engine) within ``wait`` seconds, each under
    a lease named here; ``(None, [])`` if any did not come (its error appended to ``why``;
    the leases of all of them are ended without waiting)."""
    leases = [secrets.token_hex(8) for _ in calls]
    asked = [Call(c.label, c.handle, c.method, ("join_offer", record.name, lease_s),
                  {"lease": lease}) for c, lease in zip(calls, leases)]
    outs = call_all(asked, timeout=wait, phase="join", version=version)
    if all(o.ok for o in outs):
        return [o.value for o in outs], asked
    why.extend(o.error for o in outs if not o.ok)
    post_all([_end(c, lease) for c, lease in zip(asked, leases)], phase="join")
    return None, []


def _from_replica(group: ReplicaGroup, replicas: ReplicaSet, record: ReplicaRecord,
                  version: Any, lease_s: float, why: list) -> tuple[Optional[list], list[Call]]:
    """The offer of the first healthy replica at ``version`` holding the full weights whose
    one worker holds every tensor whole."""
    for r in replicas.managed():
        # (a join or a removal makes the manager forget who holds which weight set, so the
        # next sync sends everything; a healthy replica at the version of a full sync
        # still holds it, unless it took a base round)
        if r is record or r.state != "healthy" or r.version != version or r.weights == "base":
            continue
        call = Call(r.name, r.handle, "execute_checkpoint_engine")
        offers, asked = _offers([call], record, lease_s, group.timeout, version, why)
        if offers is None:
            continue
        offer = offers[0]
        if isinstance(offer, list):         # one answer per worker (a vLLM replica)
            if len(offer) != 1:
                post_all([_end(asked[0], offer[0]["lease"])], phase="join")
                why.append(WeightSyncError(f"{r.name} has {len(offer)} workers",
                                           peer=r.name, phase="join", version=version))
                continue
            offer = offer[0]
        return [offer], asked
    if not why:
        why.append(WeightSyncError("no healthy replica holds it", phase="join", version=version))
    return None, []


class _Only:
    """A view of a :class:`ReplicaSet` whose managed replicas are ``record`` alone (what
    validation asks)."""

    def __init__(self, replicas: ReplicaSet, record: ReplicaRecord) -> None:
        self._replicas, self._record = replicas, record

    def managed(self) -> list[ReplicaRecord]:
        return [self._record] if self._replicas.is_managed(self._record) else []
