"""What one ``CheckpointEngineManager.update_weights`` did: :class:`SyncReport`.

Atomic syncs (``atomic=True``) add, per replica, whether it committed the version
(``committed``), the version it kept serving when the sync was aborted (``kept_version``;
``rolled_back`` if it had committed) and the bytes of its staging copy (``staged_bytes``: one copy of its weights); the report
sums the staging memory (``staged_bytes``) and maps who kept what (``kept``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

__all__ = ["SyncReport", "ReplicaStatus", "VerifyReport"]


@dataclass
class ReplicaStatus:
    """One rollout replica's part of a sync."""

    index: int
    name: str
    ok: bool
    seconds: float = 0.0          # time spent receiving and loading (all rounds)
    bytes: int = 0
    version: Any = None           # the version it holds after the sync (None if failed)
    error: Optional[str] = None   # why it failed (its own failure, or the sync's)
    isolated: bool = False        # removed from the topology and from generation routing
    attempts: int = 0             # transfers it took part in (more than 1: re-run)
    committed: bool = False       # atomic: it committed this sync's version
    kept_version: Any = None      # atomic, aborted: the previous version it still serves
    rolled_back: bool = False     # atomic, aborted: it had committed and swapped back
    staged_bytes: int = 0         # atomic: memory of its staging copy (one copy of weights)


@dataclass
class SyncReport:
    """Figures of one sync: ``bytes`` moved from the trainer ranks, ``seconds`` of transfer
    (send and receive running concurrently, every round), ``gbps`` = bytes / seconds / 1e9,
    ``total_seconds`` including pause, sleep/wake, cache reset and resume."""

    version: Any
    kinds: list = field(default_factory=list)       # rounds: "full" / "base" / "adapter"
    bytes: int = 0
    seconds: float = 0.0
    total_seconds: float = 0.0
    replicas: list = field(default_factory=list)    # [ReplicaStatus]
    trainer: list = field(default_factory=list)     # per trainer rank: engine metrics
    phases: list = field(default_factory=list)      # the manager's calls, in order
    sleep_level: Optional[int] = None               # effective level (colocated)
    rebuilt: bool = False                           # the group was (re)built first
    isolated: list = field(default_factory=list)    # names of replicas removed by this sync
    retries: int = 0                                # re-runs after isolating a replica
    atomic: bool = False                            # two-phase: stage on all, then commit
    validated: list = field(default_factory=list)   # replicas whose check_weights ran (the
                                                    # others had accepted this weight set)
    late: list = field(default_factory=list)        # replicas that completed the version
                                                    # after a trainer rank gave up waiting
                                                    # for their confirmation (they hold it)

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0

    @property
    def manager_seconds(self) -> float:
        """Everything of the sync but the transfer: validation, pause, fence, sleep/wake,
        cache reset, resume and the calls that carry them."""
        return max(0.0, self.total_seconds - self.seconds)

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.replicas)

    @property
    def failed(self) -> list:
        return [r for r in self.replicas if not r.ok]

    @property
    def completed(self) -> list:
        """Names of the replicas that hold this version."""
        return [r.name for r in self.replicas if r.ok]

    @property
    def staged_bytes(self) -> int:
        """Atomic: extra memory the staging copies took, all replicas together."""
        return sum(r.staged_bytes for r in self.replicas)

    @property
    def kept(self) -> dict:
        """Atomic, aborted: name -> the previous version each replica kept serving."""
        return {r.name: r.kept_version for r in self.replicas
                if self.atomic and not r.committed and not r.isolated}

    def summary(self) -> str:
        status = "ok" if self.ok else f"FAILED: {[r.name for r in self.failed]}"
        if self.isolated:
            status += f" (isolated {self.isolated}, {self.retries} re-run(s))"
        if self.late:
            status += f" (confirmed late: {self.late})"
        if self.atomic:
            status += f" (atomic, staging {self.staged_bytes / 1e6:.2f} MB)"
        return (f"version {self.version} [{'+'.join(self.kinds)}]: {self.bytes / 1e6:.2f} MB in "
                f"{self.seconds:.3f} s ({self.gbps:.2f} GB/s), total {self.total_seconds:.3f} s "
                f"(manager {self.manager_seconds * 1e3:.0f} ms), "
                f"{len(self.replicas)} replicas {status}")


@dataclass
class VerifyReport:
    """What ``CheckpointEngineManager.verify`` found: per replica, the names whose digest
    differs from the trainer's (``mismatched``), or the error that kept it from answering."""

    version: Any
    trainer: dict = field(default_factory=dict)     # weight set -> combined trainer digest
    replicas: dict = field(default_factory=dict)    # name -> {"ok", "digest", "mismatched", "error"}
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return bool(self.replicas) and all(r["ok"] for r in self.replicas.values())

    @property
    def bad(self) -> list:
        return [n for n, r in self.replicas.items() if not r["ok"]]
