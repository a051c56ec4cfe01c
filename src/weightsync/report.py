"""What one ``CheckpointEngineManager.update_weights`` did: :class:`SyncReport`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

__all__ = ["SyncReport", "ReplicaStatus"]


@dataclass
class ReplicaStatus:
    """One rollout replica's part of a sync."""

    index: int
    name: str
    ok: bool
    seconds: float = 0.0          # time spent receiving and loading (all rounds)
    bytes: int = 0
    version: Any = None           # the version it holds after the sync (None if failed)
    error: Optional[str] = None


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

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.replicas)

    @property
    def failed(self) -> list:
        return [r for r in self.replicas if not r.ok]

    def summary(self) -> str:
        status = "ok" if self.ok else f"FAILED: {[r.name for r in self.failed]}"
        return (f"version {self.version} [{'+'.join(self.kinds)}]: {self.bytes / 1e6:.2f} MB in "
                f"{self.seconds:.3f} s ({self.gbps:.2f} GB/s), total {self.total_seconds:.3f} s, "
                f"{len(self.replicas)} replicas {status}")
