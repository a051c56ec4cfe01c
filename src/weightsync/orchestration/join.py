"""Elastic joins: bring a replica added between syncs to the current version at once,
from the trainer ranks' arenas, without touching the other replicas.

Used by :meth:`~weightsync.orchestration.manager.CheckpointEngineManager.add_replica` when
the backend has the ``join`` capability (``nixl``), a sync has completed on a kept group,
and that sync sent the full weights. Steps, all bounded: every trainer rank offers the
version it served last (``join_offer``: its layout, a lease its next send waits for);
the new replica is checked against that weight set (validation before bytes:
``PlanMismatch`` before any of it moves); its workers are prepared and initialised from
the offers (``join_topology``); it receives the version through its usual
``ws_receive`` (so an HF or vLLM replica loads it exactly as in a sync; a tensor-parallel
vLLM worker pulls only its slices); the leases end (``join_done``); it is marked healthy
at that version and routed to. Nothing is called on the other replicas: they keep
generating. The next sync rebuilds the group with the new replica in it.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Optional

from weightsync.core.errors import WeightSyncError
from weightsync.orchestration.calls import Call, call_all
from weightsync.orchestration.checks import run_validate
from weightsync.orchestration.group import ReplicaGroup
from weightsync.orchestration.replicas import ReplicaRecord, ReplicaSet
from weightsync.orchestration.report import SyncReport

__all__ = ["can_join", "join_replica"]

logger = logging.getLogger(__name__)


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
                 lease_s: Optional[float] = None) -> dict:
    """Bring ``record`` to ``version`` from the trainer ranks (see the module doc); returns
    its receive's figures plus ``seconds``. Raises (the caller decides what follows); the
    trainer ranks' leases are ended whatever happens."""
    start = time.perf_counter()
    report = SyncReport(version=version)
    lease = float(lease_s if lease_s is not None else group.call_timeout)
    offers = group.run(group.trainer_calls("execute_checkpoint_engine", "join_offer",
                                           record.name, lease), "join", version)
    try:
        run_validate(group, _Only(replicas, record), report, [("full", None)], dtype, codec)
        if not replicas.is_managed(record):
            raise WeightSyncError(f"{record.name} failed its check before the join",
                                  peer=record.name, phase="join", version=version)
        def one(method: str, *args: Any, **kw: Any) -> Call:
            return Call(record.name, record.handle, method, args, kw)

        metas = group.run([one("ws_prepare", group.backend, group.engine_kwargs)], "join",
                          version)[0]
        kwargs = group.engine_cls.join_topology(offers, len(metas))
        group.run([one("ws_init", kwargs)], "join", version)
        group.run([one("ws_begin_sync", version, ["full"])], "join", version)
        stats = group.run([one("ws_receive", version, kind="full")], "join", version,
                          timeout=group.call_timeout)[0]
        group.run([one("ws_reset_caches")], "join", version)
    finally:
        outs = call_all([Call(f"trainer rank {i}", h, "execute_checkpoint_engine",
                              ("join_done", o["lease"])) for i, (h, o) in
                         enumerate(zip(group.trainers, offers))],
                        timeout=group.timeout, phase="join", version=version)
        for o in outs:
            if not o.ok:
                logger.warning("weightsync: ending a join lease on %s failed: %s", o.label,
                               o.error)
    record.state, record.version, record.weights = "healthy", version, "full"
    out = dict(stats or {})
    out["seconds"] = time.perf_counter() - start
    logger.info("weightsync: %s joined at version %s in %.3f s (%s bytes), no other replica "
                "touched", record.name, version, out["seconds"], out.get("bytes", "?"))
    return out


class _Only:
    """A view of a :class:`ReplicaSet` whose managed replicas are ``record`` alone (what
    validation asks)."""

    def __init__(self, replicas: ReplicaSet, record: ReplicaRecord) -> None:
        self._replicas, self._record = replicas, record

    def managed(self) -> list[ReplicaRecord]:
        return [self._record] if self._replicas.is_managed(self._record) else []
