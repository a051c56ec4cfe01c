"""weightsync: move trainer weights into rollout engines fast and safely.

Quick start (two processes, shared memory)::

    from weightsync import CheckpointEngineRegistry
    eng = CheckpointEngineRegistry.new("shm", role="trainer")
    ...

See README.md for the whole lifecycle.
"""

from .config import EngineConfig
from .engines import CheckpointEngine, CheckpointEngineRegistry
from .errors import (AuthenticationError, BackendUnavailable, IntegrityError, PeerFailed, PlanMismatch, SyncTimeout,
                     TopologyError, VersionMismatch, WeightSyncError, WireError)
from .manager import CheckpointEngineManager
from .plan import Bucket, PlanBuilder, TensorMeta, WeightPlan, build_plan
from .report import ReplicaStatus, SyncReport, VerifyReport
from .rendezvous import connect

__version__ = "0.1.0"

__all__ = [
    "__version__",
    "CheckpointEngine",
    "CheckpointEngineRegistry",
    "EngineConfig",
    "connect",
    "CheckpointEngineManager",
    "SyncReport",
    "ReplicaStatus",
    "VerifyReport",
    "TensorMeta",
    "Bucket",
    "WeightPlan",
    "PlanBuilder",
    "build_plan",
    "WeightSyncError",
    "SyncTimeout",
    "PeerFailed",
    "PlanMismatch",
    "VersionMismatch",
    "WireError",
    "IntegrityError",
    "BackendUnavailable",
    "TopologyError",
    "AuthenticationError",
]
