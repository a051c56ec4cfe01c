"""The manager's replica bookkeeping, group building and failure isolation (a mixin of
:class:`~weightsync.orchestration.manager.CheckpointEngineManager`; see its module doc).

Replica states: *healthy* (holds a complete version, routed to), *stale* (managed, but
its last sync did not complete or it has not been synced since it joined: fenced, not
routed to, brought up to date by the next sync) and *failed* (removed from the topology
by isolation: not routed to, not synced, until ``add_replica`` takes it back).
"""

from __future__ import annotations

import logging
from typing import Any, Optional

from weightsync.orchestration.calls import Call, Outcome, call_all, values_or_raise
from weightsync.orchestration.isolation import Verdict, blame, source_of
from weightsync.transport.base import validate_topology, worker_kwargs
from weightsync.core.errors import TopologyError, WeightSyncError
from weightsync.orchestration.report import ReplicaStatus, SyncReport

__all__ = ["GroupMixin"]

logger = logging.getLogger("weightsync.orchestration.manager")


class GroupMixin:
    """Needs: backend, trainers, replicas, timeout, call_timeout, settle, engine_kwargs,
    isolate_failures, version, _engine_cls (set by the manager's constructor)."""

    def _init_replicas(self, replicas: Any) -> None:
        self.replicas: list[Any] = []
        self._names: dict[int, str] = {}
        self._health: dict[int, str] = {}          # id -> "healthy" / "stale"
        self._failed: dict[str, tuple[Any, str]] = {}   # name -> (handle, why)
        self._statuses: dict[int, ReplicaStatus] = {}   # of the sync in progress
        self._held: dict[int, Any] = {}            # id -> version it holds (last known)
        self._fenced_now: list[Any] = []          # replicas told begin_sync by this sync
        self._counter = 0
        self._rr = -1
        self._members: list[Any] = []             # replicas of the current group
        self._rank_owner: dict[int, str] = {}     # receiving rank -> replica name
        self._group_ready = False
        self._caps: dict[int, dict] = {}
        self._weights: dict[int, Optional[str]] = {}   # replica -> "base" / "full" / None
        for r in replicas:
            self._register(r)

    # -- replicas ---------------------------------------------------------------------
    def _register(self, replica: Any, name: Optional[str] = None) -> str:
        if any(r is replica for r in self.replicas):
            raise ValueError("this replica is already managed")
        if name is None:
            name = f"replica-{self._counter}"
            self._counter += 1
        self.replicas.append(replica)
        self._names[id(replica)] = name
        self._health[id(replica)] = "healthy" if self.version is None else "stale"
        return name

    def name_of(self, replica: Any) -> str:
        return self._names[id(replica)]

    def healthy_replicas(self) -> list:
        """Replicas that hold a complete version and may serve generation."""
        return [r for r in self.replicas if self._health.get(id(r)) == "healthy"]

    def failed_replicas(self) -> dict[str, str]:
        """Replicas removed by isolation: name -> why (``add_replica`` takes one back)."""
        return {name: why for name, (_, why) in self._failed.items()}

    def replica_health(self) -> list[dict]:
        """Every replica the manager knows: name, state, last known version, error."""
        out = [{"name": self.name_of(r), "state": self._health.get(id(r), "stale"),
                "version": self._held.get(id(r)),
                "error": None} for r in self.replicas]
        out += [{"name": n, "state": "failed", "version": None, "error": why}
                for n, (_, why) in self._failed.items()]
        return out

    def route(self) -> Any:
        """The next healthy replica, round robin (``WeightSyncError`` if there is none)."""
        pool = self.healthy_replicas()
        if not pool:
            raise WeightSyncError("no healthy rollout replica to generate on "
                                  f"(failed: {sorted(self._failed)})", phase="generate")
        self._rr = (self._rr + 1) % len(pool)
        return pool[self._rr]

    def _status(self, report: Optional[SyncReport], replica: Any) -> ReplicaStatus:
        st = self._statuses.get(id(replica))
        if st is None:
            st = self._statuses[id(replica)] = ReplicaStatus(len(self._statuses),
                                                             self.name_of(replica), ok=True)
            if report is not None:
                report.replicas.append(st)
        return st

    def _isolate(self, report: Optional[SyncReport], name: str, why: str, phase: str) -> None:
        handle = next((r for r in self.replicas if self.name_of(r) == name), None)
        if handle is None:
            return
        self.replicas = [r for r in self.replicas if r is not handle]
        self._health.pop(id(handle), None)
        self._weights.pop(id(handle), None)
        self._held.pop(id(handle), None)
        self._failed[name] = (handle, f"{phase}: {why}")
        self._group_ready = False
        st = self._status(report, handle)
        st.ok, st.error, st.isolated, st.version = False, f"{phase}: {why}", True, None
        if report is not None:
            report.isolated.append(name)
        logger.warning("weightsync: isolated %s (%s: %s)", name, phase, why)
        # Fenced, it may be resumed: direct callers get a clear refusal instead of waiting.
        bound = min(self.timeout, 10.0)
        fenced = call_all([Call(name, handle, "ws_fence", (f"removed by the manager: {why}",))],
                          timeout=bound, phase="isolate")
        calls = [Call(name, handle, "ws_finalize")]
        if fenced[0].ok and fenced[0].value:
            calls.append(Call(name, handle, "ws_resume"))
        for o in fenced + call_all(calls, timeout=bound, phase="isolate"):
            if not o.ok:
                logger.info("weightsync: cleaning up isolated %s: %s", name, o.error)

    # -- calls ------------------------------------------------------------------------
    def _trainer_calls(self, method: str, *args: Any, per_rank: Optional[list] = None,
                       **kwargs: Any) -> list[Call]:
        return [Call(f"trainer rank {i}", h, method,
                     (per_rank[i],) if per_rank is not None else args, kwargs, patient=True)
                for i, h in enumerate(self.trainers)]

    def _replica_calls(self, method: str, *args: Any, per_replica: Optional[list] = None,
                       targets: Optional[list] = None, **kwargs: Any) -> list[Call]:
        targets = self.replicas if targets is None else targets
        return [Call(self.name_of(r), r, method,
                     (per_replica[j],) if per_replica is not None else args, kwargs)
                for j, r in enumerate(targets)]

    def _run(self, calls: list[Call], phase: str, version: Any = None,
             timeout: Optional[float] = None) -> list[Any]:
        return values_or_raise(call_all(calls, timeout=timeout or self.timeout, phase=phase,
                                        version=version))

    def _judge(self, report: Optional[SyncReport], trainers: list[Outcome],
               replicas: list[Outcome], phase: str) -> Verdict:
        """Isolate the replicas to blame for a failed step, or raise the root cause when
        nothing can be isolated (a trainer's fault, no culprit, no replica left)."""
        verdict = blame(trainers, replicas, self._rank_owner if phase != "prepare" else {})
        if not verdict.failed:
            return verdict
        if self.isolate_failures and verdict.trainer_fault is None:
            for name, why in verdict.culprits.items():
                self._isolate(report, name, why, phase)
        if verdict.trainer_fault is not None or not verdict.culprits \
                or not self.isolate_failures or not self.replicas:
            # the root cause first: a worker's own failure, not a peer relaying it
            ordered = sorted(trainers + replicas,
                             key=lambda o: o.ok or source_of(o.error) != o.label)
            if verdict.trainer_fault is not None:
                ordered.insert(0, verdict.trainer_fault)
            values_or_raise(ordered)
        return verdict

    def _replica_step(self, report: Optional[SyncReport], phase: str, method: str,
                      args: tuple = (), kwargs: Optional[dict] = None,
                      targets: Optional[list] = None, record: bool = True) -> list:
        """A call on replicas only; those that fail are isolated. Values (None: failed)."""
        targets = list(self.replicas if targets is None else targets)
        if record and report is not None:
            report.phases.append(phase)
        outs = call_all(self._replica_calls(method, *args, targets=targets, **(kwargs or {})),
                        timeout=self.timeout, phase=phase,
                        version=None if report is None else report.version)
        self._judge(report, [], outs, phase)
        return [o.value if o.ok else None for o in outs]

    # -- group ------------------------------------------------------------------------
    def build_group(self) -> None:
        """prepare -> build_topology -> validate -> init_process_group (see module doc)."""
        self._build(None, list(self.replicas))

    def _ensure_group(self, report: SyncReport) -> None:
        same = len(self._members) == len(self.replicas) and all(
            a is b for a, b in zip(self._members, self.replicas))
        if not (self._group_ready and same):
            self._build(report, list(self.replicas))

    def _build(self, report: Optional[SyncReport], members: list) -> list:
        """Build the group of ``members``, isolating replicas that fail; returns who is in."""
        if not members:
            raise ValueError("no rollout replicas to sync to; add_replica first")
        if report is not None:
            report.rebuilt = True
        for _ in range(len(members) + 1):
            members = [m for m in members if any(m is r for r in self.replicas)]
            self._group_ready = False
            if not members:          # every replica of a re-run was isolated meanwhile
                self._members = []
                return []
            if self._try_build(report, members):
                same = len(members) == len(self.replicas)
                self._members, self._group_ready = members, same
                logger.info("weightsync: %s group ready: %d trainer ranks -> %d replicas",
                            self.backend, len(self.trainers), len(members))
                return members
        raise WeightSyncError("could not build a group", phase="init")  # pragma: no cover

    def _try_build(self, report: Optional[SyncReport], members: list) -> bool:
        n = len(self.trainers)
        version = None if report is None else report.version
        outs = call_all(self._trainer_calls("ws_prepare", self.backend, self.engine_kwargs)
                        + self._replica_calls("ws_prepare", self.backend, self.engine_kwargs,
                                              targets=members),
                        timeout=self.timeout, settle=self.settle, phase="prepare",
                        version=version)
        if self._judge(report, outs[:n], outs[n:], "prepare").failed:
            return False
        metas = [o.value for o in outs]
        ranks, self._rank_owner = [], {}
        for r, m in zip(members, metas[n:]):
            if not isinstance(m, (list, tuple)) or not m:
                raise TopologyError(f"{self.name_of(r)} returned no receiving rank from "
                                    f"prepare (got {m!r})", peer=self.name_of(r), phase="prepare")
            for _ in m:
                self._rank_owner[len(self._rank_owner)] = self.name_of(r)
            ranks.append(len(m))
        flat = [meta for m in metas[n:] for meta in m]
        tk, rk = self._engine_cls.build_topology(n, len(flat), list(metas[:n]) + flat)
        self._check(tk, "trainer", n)
        self._check(rk, "rollout", len(flat))
        rollout_kw, start = [], 0
        for k in ranks:
            rollout_kw.append([self._entry(rk, j) for j in range(start, start + k)])
            start += k
        outs = call_all(self._trainer_calls("ws_init", per_rank=[self._entry(tk, i)
                                                                 for i in range(n)])
                        + self._replica_calls("ws_init", per_replica=rollout_kw, targets=members),
                        timeout=self.call_timeout, settle=self.settle, phase="init",
                        version=version)
        if self._judge(report, outs[:n], outs[n:], "init").failed:
            return False
        caps = self._replica_step(report, "capabilities", "ws_capabilities", targets=members,
                                  record=False)
        self._caps.update({id(r): c for r, c in zip(members, caps) if c is not None})
        return all(c is not None for c in caps)

    def _check(self, kwargs: Any, side: str, size: int) -> None:
        if isinstance(kwargs, dict):
            validate_topology(self.backend, side, kwargs, size)
        elif isinstance(kwargs, (list, tuple)):
            if len(kwargs) != size:
                raise TopologyError(f"{self.backend}: build_topology gave {len(kwargs)} {side} "
                                    f"entries, but the {side} side has {size} workers",
                                    phase="build_topology")
        else:
            raise TopologyError(f"{self.backend}: build_topology returned "
                                f"{type(kwargs).__name__} for the {side} side",
                                phase="build_topology")

    @staticmethod
    def _entry(kwargs: Any, index: int) -> dict:
        return worker_kwargs(kwargs, index) if isinstance(kwargs, dict) else dict(kwargs[index])
