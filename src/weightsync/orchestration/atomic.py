"""Atomic syncs (``CheckpointEngineManager(atomic=True)``): a two-phase commit over the
replicas of a sync, and the abort that leaves each of them serving its previous version.

Phase 1 (the manager's usual steps): every replica is told ``ws_begin_sync(version, kinds,
staged=True)`` and receives the version into a staging copy; its live weights, version and
fence do not change. Phase 2 (here): :func:`commit_all` calls ``ws_commit`` on every
replica (each swaps its copy in and keeps the old weights), the manager resets caches, and
then the sync is *decided*: :func:`release_all` frees the old copies (a failure there is
only logged: the version is committed everywhere). Generation stays paused from ``pause``
to ``resume``, so no output of the new version exists before the decision.

A failure in any step before the decision aborts the sync for every replica (no isolation
and re-run within the call): :func:`abort_all` calls ``ws_abort`` on each, which drops its
staged copy or, after its commit, swaps the old weights back. A replica that confirms
(answers with the version the manager knew it at, and no receive still running) keeps
serving that version, healthy, and its ``ReplicaStatus.kept_version`` says which. One that
does not (it died, did not answer in time, failed its abort, or is stuck in a receive
past its bound) is isolated (``isolate_failures=True``) or marked stale and fenced: it is
never routed to with a version nobody can vouch for.

:func:`check_staging` refuses, before anything is paused or sent, replicas that cannot
stage every round of the sync: their ``capabilities()["staged_kinds"]`` must list it.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

from weightsync.orchestration.calls import Call, Outcome, call_all
from weightsync.orchestration.group import ReplicaGroup
from weightsync.orchestration.isolation import describe_error
from weightsync.orchestration.replicas import ReplicaRecord, ReplicaSet
from weightsync.orchestration.report import SyncReport
from weightsync.orchestration import workers as ws

__all__ = ["check_staging", "commit_all", "release_all", "abort_all"]

logger = logging.getLogger("weightsync.orchestration.manager")

_VLLM = ("vLLM applies a version at the end of its own receive, even with apply='staged' "
         "(the worker loads its staged copy inside weightsync_receive), so there is no "
         "separate commit that could wait for the other replicas")


def check_staging(replicas: ReplicaSet, kinds: list[str]) -> None:
    """``ValueError`` naming the first replica that cannot stage every round of ``kinds``."""
    for r in replicas.managed():
        staged = r.caps.get("staged_kinds")
        bad = [k for k in kinds if k not in (staged or [])]
        if not bad:
            continue
        engine = r.caps.get("name", "its adapter")
        if r.caps.get("name") == "vllm":
            why = _VLLM
        elif staged is None:
            why = f"{engine} has no staged apply (capabilities() lists no 'staged_kinds')"
        else:
            why = r.caps.get("reasons", {}).get("atomic") or f"{engine} stages only {staged}"
        raise ValueError(f"atomic=True: {r.name} ({engine}) cannot stage {bad} syncs for a "
                         f"separate commit: {why}")


def commit_all(group: ReplicaGroup, replicas: ReplicaSet, report: SyncReport,
               version: Any) -> None:
    """``ws_commit`` on every replica; any failure raises (the caller aborts)."""
    targets = replicas.managed()
    group.replica_step(report, "commit", ws.COMMIT, (version,), targets=targets)
    for r in targets:
        replicas.status(r, report).committed = True


def release_all(group: ReplicaGroup, report: SyncReport, version: Any) -> None:
    """The sync is decided: every replica frees its old copy (failures are logged)."""
    report.phases.append("release")
    for o in call_all(group.replica_calls(ws.RELEASE, version), timeout=group.timeout,
                      phase="release", version=version):
        if not o.ok:
            logger.warning("weightsync: release on %s failed (it keeps its old copy until "
                           "its next sync): %s", o.label, o.error)


def abort_all(group: ReplicaGroup, replicas: ReplicaSet, report: SyncReport) -> None:
    """Every replica back to the version it held before the sync (see the module doc)."""
    report.phases.append("abort")
    version, records = report.version, replicas.managed()
    outs = call_all([Call(r.name, r.handle, ws.ABORT, (version,)) for r in records],
                    timeout=group.timeout, phase="abort", version=version)
    for r, o in zip(records, outs):
        st = replicas.status(r, report)
        st.committed, st.version = False, None
        why = _unconfirmed(r, o)
        if why is None:
            st.kept_version = o.value.get("version")
            st.rolled_back = bool(o.value.get("rolled_back"))
            continue
        logger.warning("weightsync: %s did not confirm the abort of version %r: %s",
                       r.name, version, why)
        if group.isolate_failures:
            group.isolate(report, r.name, why, "abort")
            continue
        replicas.mark_stale(r)
        st.ok, st.error = False, f"abort: {why}"
        call_all([Call(r.name, r.handle, ws.FENCE, (f"atomic abort: {why}",))],
                 timeout=min(group.timeout, 10.0), phase="abort")


def _unconfirmed(record: ReplicaRecord, outcome: Outcome) -> Optional[str]:
    """Why ``record``'s answer to ``ws_abort`` does not vouch for its version (None: it
    does)."""
    if not outcome.ok:
        return describe_error(outcome.error)
    value = outcome.value if isinstance(outcome.value, dict) else {}
    if value.get("busy"):
        return "a receive is still running past its bound"
    if record.state == "healthy" and value.get("version") != record.version:
        return f"it serves version {value.get('version')!r}, not {record.version!r}"
    return None
