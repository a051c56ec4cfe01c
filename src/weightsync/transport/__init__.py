"""The transport layer: the engine contract, its registry, and the backends.

``CheckpointEngine`` (:mod:`~weightsync.transport.base`) is the lifecycle every backend
implements; ``CheckpointEngineRegistry`` creates one by name, importing its module on first
use. The bucketed sync protocol shared by several backends is in ``protocol/``, the
control plane (store, links, groups) in ``control/``, one module or folder per transport in
``backends/``. Nothing here knows about Ray or the manager.
"""

from weightsync.transport.base import CheckpointEngine
from weightsync.transport.registry import CheckpointEngineRegistry

__all__ = ["CheckpointEngine", "CheckpointEngineRegistry"]

for _name, _module in (
    ("inproc", "weightsync.transport.backends.inproc"),
    ("shm", "weightsync.transport.backends.shm.engine"),
    ("collective", "weightsync.transport.backends.collective"),
    ("cuda_ipc", "weightsync.transport.backends.cuda_ipc.engine"),
    ("nixl", "weightsync.transport.backends.nixl.engine"),
):
    CheckpointEngineRegistry.register_lazy(_name, _module)

# the codec layer over each of them (delta updates, FP8 on the fly): ``delta+shm``,
# ``fp8+shm``, ``delta+fp8+shm``, ... (weightsync.transport.codec)
for _inner in ("inproc", "shm", "collective", "cuda_ipc", "nixl"):
    for _prefix in ("delta", "fp8", "delta+fp8"):
        CheckpointEngineRegistry.register_lazy(f"{_prefix}+{_inner}",
                                               f"weightsync.transport.codec.wrapped.{_inner}")
