"""The replica group: who takes part in a sync, the calls on its workers (the transfer
rounds included), and failure isolation (:class:`ReplicaGroup`).

Owns the group's members (the replicas it was built with), which receiving rank belongs
to which replica, whether the group is ready, and the calls on the trainer ranks and the
replicas (every one bounded, see :mod:`~weightsync.orchestration.calls`). Judges a failed
step by the rules of :mod:`~weightsync.orchestration.isolation` and isolates the replicas
to blame (moved to the failed ones of the :class:`~weightsync.orchestration.replicas.ReplicaSet`,
fenced and finalized), or, for atomic syncs (``abort_on_failure``), raises the root cause
so that the whole sync is aborted. Used by :class:`~weightsync.orchestration.manager.CheckpointEngineManager`
(group set-up, every step of a sync) and :mod:`weightsync.orchestration.checks`.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Optional

from weightsync.orchestration.calls import Call, Outcome, call_all, values_or_raise
from weightsync.orchestration.isolation import Verdict, blame, source_of
from weightsync.orchestration.replicas import ReplicaRecord, ReplicaSet
from weightsync.transport.base import validate_topology, worker_kwargs
from weightsync.core.errors import TopologyError, WeightSyncError
from weightsync.orchestration.report import SyncReport
from weightsync.orchestration import workers as ws

__all__ = ["ReplicaGroup"]

logger = logging.getLogger("weightsync.orchestration.manager")


class ReplicaGroup:
    """The trainer ranks and the managed replicas of ``replicas``, as one engine group of
    ``backend`` (``engine_cls`` builds its topology)."""

    def __init__(self, backend: str, engine_cls: Any, engine_kwargs: dict, trainers: list,
                 replicas: ReplicaSet, *, timeout: float, call_timeout: float, settle: float,
                 isolate_failures: bool, abort_on_failure: bool = False) -> None:
        self.backend, self.engine_cls, self.engine_kwargs = backend, engine_cls, engine_kwargs
        self.trainers = trainers
        self.replicas = replicas
        self.timeout, self.call_timeout, self.settle = timeout, call_timeout, settle
        self.isolate_failures = isolate_failures
        self.abort_on_failure = abort_on_failure  # atomic syncs: raise, never isolate in a step
        self.members: list[ReplicaRecord] = []    # replicas of the current group
        self.ready = False
        self._rank_owner: dict[int, str] = {}      # receiving rank -> replica name

    def invalidate(self) -> None:
        """The next sync builds the group again."""
        self.ready = False

    # -- calls ------------------------------------------------------------------------
    def trainer_calls(self, method: str, *args: Any, per_rank: Optional[list] = None,
                      **kwargs: Any) -> list[Call]:
        return [Call(f"trainer rank {i}", h, method,
                     (per_rank[i],) if per_rank is not None else args, kwargs, patient=True)
                for i, h in enumerate(self.trainers)]

    def replica_calls(self, method: str, *args: Any, per_replica: Optional[list] = None,
                      targets: Optional[list[ReplicaRecord]] = None,
                      **kwargs: Any) -> list[Call]:
        """One call per replica of ``targets`` (records; all managed ones by default)."""
        targets = self.replicas.managed() if targets is None else targets
        return [Call(r.name, r.handle, method,
                     (per_replica[j],) if per_replica is not None else args, kwargs)
                for j, r in enumerate(targets)]

    def run(self, calls: list[Call], phase: str, version: Any = None,
            timeout: Optional[float] = None) -> list[Any]:
        """The values of ``calls``, or raise the first failure."""
        return values_or_raise(call_all(calls, timeout=timeout or self.timeout, phase=phase,
                                        version=version))

    def replica_step(self, report: Optional[SyncReport], phase: str, method: str,
                     args: tuple = (), kwargs: Optional[dict] = None,
                     targets: Optional[list[ReplicaRecord]] = None,
                     record: bool = True) -> list:
        """A call on replicas only; those that fail are isolated. Values (None: failed)."""
        targets = self.replicas.managed() if targets is None else list(targets)
        if record and report is not None:
            report.phases.append(phase)
        outs = call_all(self.replica_calls(method, *args, targets=targets, **(kwargs or {})),
                        timeout=self.timeout, phase=phase,
                        version=None if report is None else report.version)
        self.judge(report, [], outs, phase)
        return [o.value if o.ok else None for o in outs]

    # -- the transfer ----------------------------------------------------------------
    def transfer(self, report: SyncReport, version: Any, rounds: list) -> list:
        """Every round of ``rounds`` (send on every trainer rank, receive on every member)
        on the current group; the survivors that must re-run (if any)."""
        members, n = list(self.members), len(self.trainers)
        for i, (kind, cfg) in enumerate(rounds):
            report.phases.append(f"sync:{kind}")
            calls = self.trainer_calls(ws.SEND, version, kind=kind) + self.replica_calls(
                ws.RECEIVE, version, kind=kind, adapter_config=cfg, targets=members)
            t0 = time.perf_counter()
            outs = call_all(calls, timeout=self.call_timeout, settle=self.settle,
                            phase=f"sync:{kind}", version=version)
            report.seconds += time.perf_counter() - t0
            for o in outs[:n]:
                if o.ok:
                    report.trainer.append(o.value)
                    report.bytes += int(o.value.get("bytes", 0))
            for r, o in zip(members, outs[n:]):
                st = self.replicas.status(r, report)
                st.attempts += int(i == 0)
                if o.ok:
                    st.seconds += float(o.value.get("seconds", 0.0))
                    st.bytes += int(o.value.get("bytes", 0))
                    st.staged_bytes = max(st.staged_bytes, int(o.value.get("staged_bytes", 0)))
            verdict = self.judge(report, outs[:n], outs[n:], f"sync:{kind}")
            if verdict.failed or (verdict.late and i < len(rounds) - 1):
                # (a late confirmation left the trainer's group unusable: the rounds still
                # to come run again on a rebuilt one)
                alive = [m for m in members if self.replicas.is_managed(m)]
                if i < len(rounds) - 1:
                    return alive
                failed = {o.label for o in outs[n:] if not o.ok}
                return [m for m in alive if m.name in failed]
        return []

    # -- failures ---------------------------------------------------------------------
    def judge(self, report: Optional[SyncReport], trainers: list[Outcome],
              replicas: list[Outcome], phase: str) -> Verdict:
        """Isolate the replicas to blame for a failed step, or raise the root cause when
        nothing can be isolated (a trainer's fault, no culprit, no replica left)."""
        verdict = blame(trainers, replicas, self._rank_owner if phase != "prepare" else {},
                        self.replicas.aliases())
        if verdict.late:
            # replicas that hold the version although a trainer rank gave up on their
            # confirmation: reported, not fenced; the trainer's group is built again
            self.ready = False
            if report is not None:
                report.late.extend(n for n in verdict.late if n not in report.late)
            for name, why in verdict.late.items():
                logger.warning("weightsync: %s completed version %s after the trainer gave "
                               "up on it (%s); it holds the version",
                               name, None if report is None else report.version, why)
        if not verdict.failed:
            return verdict
        isolating = self.isolate_failures and not self.abort_on_failure
        if isolating and verdict.trainer_fault is None:
            for name, why in verdict.culprits.items():
                self.isolate(report, name, why, phase)
        if verdict.trainer_fault is not None or not verdict.culprits \
                or not isolating or not len(self.replicas):
            # the root cause first: a worker's own failure, not a peer relaying it
            ordered = sorted(trainers + replicas,
                             key=lambda o: o.ok or source_of(o.error) != o.label)
            if verdict.trainer_fault is not None:
                ordered.insert(0, verdict.trainer_fault)
            values_or_raise(ordered)
        return verdict

    def isolate(self, report: Optional[SyncReport], name: str, why: str, phase: str) -> None:
        """Take the managed replica ``name`` out of the topology (failed, fenced,
        finalized); the group must be built again."""
        record = self.replicas.isolate(name, f"{phase}: {why}")
        if record is None:
            return
        self.ready = False
        st = self.replicas.status(record, report)
        st.ok, st.error, st.isolated, st.version = False, f"{phase}: {why}", True, None
        if report is not None:
            report.isolated.append(name)
        logger.warning("weightsync: isolated %s (%s: %s)", name, phase, why)
        # Fenced, it may be resumed: direct callers get a clear refusal instead of waiting.
        bound = min(self.timeout, 10.0)
        fenced = call_all([Call(name, record.handle, ws.FENCE,
                                (f"removed by the manager: {why}",))],
                          timeout=bound, phase="isolate")
        calls = [Call(name, record.handle, ws.FINALIZE)]
        if fenced[0].ok and fenced[0].value:
            calls.append(Call(name, record.handle, ws.RESUME))
        for o in fenced + call_all(calls, timeout=bound, phase="isolate"):
            if not o.ok:
                logger.info("weightsync: cleaning up isolated %s: %s", name, o.error)

    # -- building ---------------------------------------------------------------------
    def ensure(self, report: SyncReport) -> None:
        """Build the group of every managed replica unless it is ready with exactly them."""
        managed = self.replicas.managed()
        same = len(self.members) == len(managed) and all(
            a is b for a, b in zip(self.members, managed))
        if not (self.ready and same):
            self.build(report, managed)

    def build(self, report: Optional[SyncReport],
              members: list[ReplicaRecord]) -> list[ReplicaRecord]:
        """Build the group of ``members``, isolating replicas that fail; returns who is in."""
        if not members:
            raise ValueError("no rollout replicas to sync to; add_replica first")
        if report is not None:
            report.rebuilt = True
        for _ in range(len(members) + 1):
            members = [m for m in members if self.replicas.is_managed(m)]
            self.ready = False
            if not members:          # every replica of a re-run was isolated meanwhile
                self.members = []
                return []
            if self._try_build(report, members):
                self.members, self.ready = members, len(members) == len(self.replicas)
                logger.info("weightsync: %s group ready: %d trainer ranks -> %d replicas",
                            self.backend, len(self.trainers), len(members))
                return members
        raise WeightSyncError("could not build a group", phase="init")  # pragma: no cover

    def _try_build(self, report: Optional[SyncReport], members: list[ReplicaRecord]) -> bool:
        version = None if report is None else report.version
        metas = self._prepare(report, members, version)
        if metas is None:
            return False
        if not self._init(report, members, metas, version):
            return False
        caps = self.replica_step(report, "capabilities", ws.CAPABILITIES, targets=members,
                                 record=False)
        for r, c in zip(members, caps):
            if c is not None and self.replicas.is_managed(r):
                r.caps = c
        return all(c is not None for c in caps)

    def _prepare(self, report: Optional[SyncReport], members: list[ReplicaRecord],
                 version: Any) -> Optional[list]:
        """``ws_prepare`` on every worker: their metadata (None: someone was isolated)."""
        n = len(self.trainers)
        outs = call_all(self.trainer_calls(ws.PREPARE, self.backend, self.engine_kwargs)
                        + self.replica_calls(ws.PREPARE, self.backend, self.engine_kwargs,
                                             targets=members),
                        timeout=self.timeout, settle=self.settle, phase="prepare",
                        version=version)
        if self.judge(report, outs[:n], outs[n:], "prepare").failed:
            return None
        return [o.value for o in outs]

    def _init(self, report: Optional[SyncReport], members: list[ReplicaRecord], metas: list,
              version: Any) -> bool:
        """build_topology from ``metas``, then ``ws_init`` on every worker (False: someone
        was isolated)."""
        n = len(self.trainers)
        ranks, self._rank_owner = [], {}
        for r, m in zip(members, metas[n:]):
            if not isinstance(m, (list, tuple)) or not m:
                raise TopologyError(f"{r.name} returned no receiving rank from "
                                    f"prepare (got {m!r})", peer=r.name, phase="prepare")
            for _ in m:
                self._rank_owner[len(self._rank_owner)] = r.name
            ranks.append(len(m))
        flat = [meta for m in metas[n:] for meta in m]
        tk, rk = self.engine_cls.build_topology(n, len(flat), list(metas[:n]) + flat)
        self._check(tk, "trainer", n)
        self._check(rk, "rollout", len(flat))
        rollout_kw, start = [], 0
        for k in ranks:
            rollout_kw.append([self._entry(rk, j) for j in range(start, start + k)])
            start += k
        outs = call_all(self.trainer_calls(ws.INIT, per_rank=[self._entry(tk, i)
                                                                for i in range(n)])
                        + self.replica_calls(ws.INIT, per_replica=rollout_kw, targets=members),
                        timeout=self.call_timeout, settle=self.settle, phase="init",
                        version=version)
        return not self.judge(report, outs[:n], outs[n:], "init").failed

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
