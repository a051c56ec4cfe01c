"""Checkpoint engines (transport backends) and their registry."""

from .base import CheckpointEngine
from .registry import CheckpointEngineRegistry

__all__ = ["CheckpointEngine", "CheckpointEngineRegistry"]

for _name, _module in (
    ("inproc", "weightsync.engines.inproc"),
    ("shm", "weightsync.engines.shm"),
    ("collective", "weightsync.engines.collective"),
    ("cuda_ipc", "weightsync.engines.cuda_ipc"),
    ("nixl", "weightsync.engines.nixl"),
):
    CheckpointEngineRegistry.register_lazy(_name, _module)
