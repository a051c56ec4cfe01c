"""weightsync under ms-swift's own ``CheckpointEngineManager`` (tested with ms-swift 4.6.0).

ms-swift's Ray manager (``swift/ray/megatron/checkpoint_engine/``) hard-codes its NCCL
engine; its one seam is ``CheckpointEngineMixin._get_or_create_checkpoint_engine`` on the
trainer actors (``MegatronWorker``) and the rollout actors (``VllmServer``). Here it returns
a :class:`WeightsyncSwiftEngine` driving any weightsync backend by name (``shm``,
``collective``, ``nixl``, ``cuda_ipc``), so ``CheckpointEngineManager.sync_weights()`` runs
unchanged: full sync, LoRA merge -> sync -> unmerge, adapter-only after ``base_sync_done``,
colocated sleep/wake with tags. Two ways in:

* mix :class:`WeightsyncCheckpointMixin` into your actor classes, before ms-swift's::

      class Trainer(WeightsyncCheckpointMixin, MegatronWorker):
          weightsync_backend = "collective"
          weightsync_options = {"device": "cuda", "host": "auto", "timeout": 300}

* or, where ms-swift builds the actors itself, run :func:`install` in every Ray worker
  process (``runtime_env={"worker_process_setup_hook":
  "weightsync.integrations.swift.install", "env_vars": {"WEIGHTSYNC_SWIFT_BACKEND": ...}}``;
  engine options from ``WEIGHTSYNC_*``).

Modules: :mod:`.engine` (ms-swift's engine contract over a weightsync engine),
:mod:`.rendezvous` (how trainer rank 0 builds the real topology behind ms-swift's
NCCL-shaped one, and checks every sync before bytes move), :mod:`.layout` (the names,
shapes and dtypes of a sync, checked by the rollouts before bytes move, and the export
held to them), :mod:`.mixin` (the actor side: the seam, intent of each sync, peft checks,
the ``weightsync_describe_weights`` / ``weightsync_check_weights`` hooks, :func:`install`). The CPU test harness is
``tests/harness_swift.py`` of the repository.
"""

from __future__ import annotations

try:
    import swift.ray.megatron.checkpoint_engine  # noqa: F401
except ImportError as _exc:  # pragma: no cover - exercised in a subprocess test
    raise ImportError(
        "weightsync.integrations.swift needs ms-swift (tested with ms-swift==4.6.0), which is "
        f"not importable here ({type(_exc).__name__}: {_exc}). Install it without its pins: "
        "`pip install --no-deps ms-swift==4.6.0 modelscope==1.40.2 modelscope_hub==0.5.1 "
        "datasets==4.8.4 multiprocess==0.70.19 pyarrow==26.0.1 pandas==3.1.1`, or run "
        "`make swift` in the weightsync checkout.") from _exc

from weightsync.integrations.swift.engine import DEFAULT_BACKEND, WeightsyncSwiftEngine, new_engine
from weightsync.integrations.swift.mixin import (WeightsyncCheckpointMixin, install,
                                                 peft_config_problems, uninstall)

__all__ = ["WeightsyncSwiftEngine", "WeightsyncCheckpointMixin", "install", "uninstall",
           "new_engine", "peft_config_problems", "DEFAULT_BACKEND"]
