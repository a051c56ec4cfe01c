"""weightsync: move trainer weights into rollout engines fast and safely.

Quick start (two processes, shared memory; the whole program: examples/quickstart.py)::

    engine = weightsync.connect("shm", role="trainer", address="127.0.0.1:29555", token=secret)
    stats = engine.send(model.state_dict(), version=1)              # the trainer process
    stats = engine.receive(into=model.state_dict(), version=1)      # the rollout process
    engine.finalize()

See README.md for the whole lifecycle and docs/architecture.md for the layers.
"""

from typing import Any

from weightsync.core.config import EngineConfig
from weightsync.core.remote import normalize_version
from weightsync.core.errors import (AuthenticationError, BackendUnavailable, IntegrityError, PeerFailed,
                                    PlanMismatch, SyncTimeout, TopologyError, VersionMismatch,
                                    WeightSyncError, WireError)
from weightsync.orchestration.manager import CheckpointEngineManager
from weightsync.orchestration.report import ReplicaStatus, SyncReport, VerifyReport
from weightsync.rollout.vllm.util import VLLMOptions
from weightsync.transport import CheckpointEngine, CheckpointEngineRegistry
from weightsync.transport.base import SyncStats
from weightsync.transport.rendezvous import connect

__version__ = "0.1.0"

__all__ = [
    "__version__",
    "CheckpointEngine",
    "CheckpointEngineRegistry",
    "EngineConfig",
    "connect",
    "SyncStats",
    "CheckpointEngineManager",
    "SyncReport",
    "ReplicaStatus",
    "VerifyReport",
    "ShmOptions",
    "CollectiveOptions",
    "CudaIpcOptions",
    "NixlOptions",
    "CodecOptions",
    "plan",
    "VLLMOptions",
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

#: Importable from here as before, no longer advertised: the bucket plan's internals
#: live in :mod:`weightsync.core.plan`.
_PLAN_NAMES = ("TensorMeta", "Bucket", "WeightPlan", "PlanBuilder", "build_plan")


#: Each backend's options dataclass, by the module that defines it.
_OPTIONS = {"ShmOptions": "weightsync.transport.backends.shm.engine",
            "CollectiveOptions": "weightsync.transport.backends.collective",
            "CudaIpcOptions": "weightsync.transport.backends.cuda_ipc.engine",
            "NixlOptions": "weightsync.transport.backends.nixl.engine",
            "CodecOptions": "weightsync.transport.codec.options"}


def __getattr__(name: str) -> Any:
    if name in _PLAN_NAMES:
        from weightsync.core import plan
        return getattr(plan, name)
    if name == "plan":  # the planner imports transformers on use: not at import time
        from weightsync.tools.planner import plan
        return plan
    if name in _OPTIONS:  # backend modules load on first use (none needs CUDA or NIXL)
        import importlib
        return getattr(importlib.import_module(_OPTIONS[name]), name)
    raise AttributeError(f"module 'weightsync' has no attribute {name!r}")
