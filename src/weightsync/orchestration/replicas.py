"""The manager's replica records: one :class:`ReplicaRecord` per rollout replica, held by a
:class:`ReplicaSet`.

Owns everything the manager knows of a replica: its handle and name, its state, the
version and weight set it holds, its capabilities, why it failed, its
:class:`~weightsync.orchestration.report.ReplicaStatus` in the sync in progress and
whether that sync fenced it. Used by :class:`~weightsync.orchestration.manager.CheckpointEngineManager`
(membership, routing, health), by :class:`~weightsync.orchestration.group.ReplicaGroup`
(group members, isolation) and by :mod:`weightsync.orchestration.checks` (verify). Makes
no calls on workers.

Replica states: *healthy* (holds a complete version, routed to), *stale* (managed, but
its last sync did not complete or it has not been synced since it joined: fenced, not
routed to, brought up to date by the next sync) and *failed* (removed from the topology
by isolation: not routed to, not synced, until ``add`` takes it back under its old name).
Isolating or removing a replica drops everything it had.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from weightsync.core.errors import WeightSyncError
from weightsync.orchestration.report import ReplicaStatus, SyncReport

__all__ = ["ReplicaRecord", "ReplicaSet"]


@dataclass(eq=False)
class ReplicaRecord:
    """One replica, as the manager knows it (compared by identity)."""

    handle: Any
    name: str
    state: str = "healthy"                 # "healthy" / "stale" / "failed"
    version: Any = None                    # the version it holds (last known)
    weights: Optional[str] = None          # the weight set it holds: "base" / "full" / None
    caps: dict = field(default_factory=dict)    # its ws_capabilities, from the last build
    error: Optional[str] = None            # why it failed (state "failed")
    status: Optional[ReplicaStatus] = None  # its part of the sync in progress (or the last)
    fenced: bool = False                   # told begin_sync by the sync in progress
    checked: dict = field(default_factory=dict)  # kind -> digest of the weight set its
                                                 # check_weights accepted (validation cache)


class ReplicaSet:
    """The managed replicas (healthy or stale, in the order they joined) and the failed
    ones (by name, in the order they failed)."""

    def __init__(self) -> None:
        self._managed: list[ReplicaRecord] = []
        self._failed: dict[str, ReplicaRecord] = {}
        self._counter = 0           # next "replica-N"
        self._statuses = 0          # statuses handed out in the sync in progress
        self._rr = -1               # round robin over the healthy ones

    # -- membership -------------------------------------------------------------------
    def add(self, handle: Any, *, healthy: bool) -> ReplicaRecord:
        """Manage ``handle``: a new replica gets the next name, a failed one is taken back
        under its old name. ``healthy``: whether it may be routed to before a sync."""
        if self.get(handle) is not None:
            raise ValueError("this replica is already managed")
        old = self.failed_record(handle)
        if old is not None:
            del self._failed[old.name]
            name = old.name
        else:
            name = f"replica-{self._counter}"
            self._counter += 1
        record = ReplicaRecord(handle, name, state="healthy" if healthy else "stale")
        self._managed.append(record)
        return record

    def isolate(self, name: str, why: str) -> Optional[ReplicaRecord]:
        """Move the managed replica ``name`` to the failed ones (None: not managed); it
        keeps its handle, name and status of the sync in progress, and nothing else."""
        record = self.by_name(name)
        if record is None:
            return None
        self._managed.remove(record)
        record.state, record.error = "failed", why
        record.version, record.weights, record.caps, record.fenced = None, None, {}, False
        record.checked = {}
        self._failed[name] = record
        return record

    def remove(self, record: ReplicaRecord) -> None:
        """Forget ``record`` altogether (managed or failed)."""
        if self._failed.get(record.name) is record:
            del self._failed[record.name]
        else:
            self._managed.remove(record)

    # -- lookup -----------------------------------------------------------------------
    def get(self, handle: Any) -> Optional[ReplicaRecord]:
        """The managed record of ``handle`` (None when it is not managed)."""
        return next((r for r in self._managed if r.handle is handle), None)

    def failed_record(self, handle: Any) -> Optional[ReplicaRecord]:
        return next((r for r in self._failed.values() if r.handle is handle), None)

    def lookup(self, handle: Any) -> Optional[ReplicaRecord]:
        """The record of ``handle``, managed or failed."""
        record = self.get(handle)
        return record if record is not None else self.failed_record(handle)

    def by_name(self, name: str) -> Optional[ReplicaRecord]:
        """The managed record named ``name``."""
        return next((r for r in self._managed if r.name == name), None)

    def is_managed(self, record: ReplicaRecord) -> bool:
        return any(r is record for r in self._managed)

    def managed(self) -> list[ReplicaRecord]:
        return list(self._managed)

    def handles(self) -> list[Any]:
        return [r.handle for r in self._managed]

    def __len__(self) -> int:
        return len(self._managed)

    def aliases(self) -> dict[str, str]:
        """Managed replica name -> the name its adapter gives itself in its errors (the
        ``self_name`` of its capabilities, learned when the group was built)."""
        out = {}
        for r in self._managed:
            own = r.caps.get("self_name") if isinstance(r.caps, dict) else None
            if isinstance(own, str) and own:
                out[r.name] = own
        return out

    # -- health -----------------------------------------------------------------------
    def healthy(self) -> list[ReplicaRecord]:
        return [r for r in self._managed if r.state == "healthy"]

    def failed(self) -> dict[str, str]:
        """Failed replicas: name -> why."""
        return {name: r.error for name, r in self._failed.items()}

    def health(self) -> list[dict]:
        """Every replica known: name, state, last known version, error."""
        out = [{"name": r.name, "state": r.state, "version": r.version, "error": None}
               for r in self._managed]
        out += [{"name": n, "state": "failed", "version": None, "error": r.error}
                for n, r in self._failed.items()]
        return out

    def route(self) -> Any:
        """The next healthy replica's handle, round robin."""
        pool = self.healthy()
        if not pool:
            raise WeightSyncError("no healthy rollout replica to generate on "
                                  f"(failed: {sorted(self._failed)})", phase="generate")
        self._rr = (self._rr + 1) % len(pool)
        return pool[self._rr].handle

    def check_kinds(self, kinds: list[str]) -> None:
        """Refuse before anything moves when a replica cannot apply a weight set (e.g. a
        vLLM replica without LoRA support and an adapter-only sync)."""
        for r in self._managed:
            bad = [k for k in kinds if k not in r.caps.get("kinds", kinds)]
            if bad:
                why = r.caps.get("reasons", {}).get("lora", "")
                raise ValueError(f"{r.name} cannot apply {bad} syncs"
                                 f"{': ' + why if why else ''}")

    def forget_checks(self) -> None:
        """The next validation asks every managed replica again."""
        for r in self._managed:
            r.checked = {}

    def forget_weights(self) -> None:
        """No managed replica is known to hold a weight set (the next sync sends all)."""
        for r in self._managed:
            r.weights = None

    def mark_stale(self, record: ReplicaRecord) -> None:
        """``record`` does not hold what the trainer has (fenced until the next sync)."""
        record.state, record.weights = "stale", None
        record.checked = {}

    # -- the sync in progress ---------------------------------------------------------
    def begin_sync(self, report: SyncReport) -> None:
        """A new sync: no status, nobody fenced; every managed replica gets a status."""
        self._statuses = 0
        for r in list(self._managed) + list(self._failed.values()):
            r.status, r.fenced = None, False
        for r in self._managed:
            self.status(r, report)

    def status(self, record: ReplicaRecord, report: Optional[SyncReport]) -> ReplicaStatus:
        """``record``'s status in the sync in progress (made, and added to ``report``,
        on first use)."""
        if record.status is None:
            record.status = ReplicaStatus(self._statuses, record.name, ok=True)
            self._statuses += 1
            if report is not None:
                report.replicas.append(record.status)
        return record.status

    def mark_fenced(self) -> None:
        """Every managed replica was told ``begin_sync`` by this sync."""
        for r in self._managed:
            r.fenced = True

    def stale_fenced(self) -> None:
        """The sync failed: the replicas it fenced stay fenced until a sync completes."""
        for r in self._managed:
            if r.fenced:
                r.state = "stale"

    def synced(self, version: Any, weights: str, report: SyncReport) -> None:
        """The sync of ``version`` completed on every managed replica."""
        for r in self._managed:
            r.state, r.version, r.weights = "healthy", version, weights
            self.status(r, report).version = version
