"""A vLLM rollout worker for Ray (or in-process use) and the demo's replica factory.

:class:`VLLMRolloutWorker` writes a config-built model (random weights) to a temp
folder, starts a :class:`~weightsync.rollout.vllm.VLLMRolloutReplica` on it and exposes
the calls :class:`~weightsync.orchestration.manager.CheckpointEngineManager` makes (through
:class:`~weightsync.integrations.ray.mixins.RolloutWorkerMixin`).
"""

from __future__ import annotations

import shutil
import tempfile
from typing import Any, Optional

import torch

from weightsync.orchestration.calls import Call, call_all, values_or_raise
from weightsync.integrations.ray.mixins import RolloutWorkerMixin

__all__ = ["VLLMRolloutWorker", "vllm_replicas"]


class VLLMRolloutWorker(RolloutWorkerMixin):
    def __init__(self, config: dict, *, dtype: Optional[torch.dtype] = None, seed: int = 1234,
                 name: str = "vllm", options: Any = None, **llm_kwargs: Any) -> None:
        from weightsync.rollout.vllm.replica import VLLMRolloutReplica, model_folder_from_config

        dtype = dtype or torch.float32
        folder = tempfile.mkdtemp(prefix="wsvllm-model-")
        try:
            model_folder_from_config(config, folder, dtype=dtype, seed=seed)
            self.rollout = VLLMRolloutReplica(folder, dtype=dtype, seed=seed, name=name,
                                              options=options, **llm_kwargs)
        finally:
            # vLLM has loaded it and the workers have read its manifest: nothing reads
            # the folder again, and a killed actor leaves nothing behind.
            shutil.rmtree(folder, ignore_errors=True)

    def worker_states(self) -> list:
        return self.rollout.worker_states()

    def close(self) -> None:
        self.rollout.close()


def vllm_replicas(n: int, config: dict, *, dtype: Any = None, seed: int = 1234,
                  timeout: float = 600.0, options: Any = None, **llm_kwargs: Any) -> list:
    """``n`` vLLM replica actors (threaded, so pause can interrupt generation).

    Without ``options``: :class:`~weightsync.rollout.vllm.VLLMOptions` from the
    environment, with LoRA enabled (the demo's ``--lora`` syncs adapters only).
    """
    import ray

    from weightsync.rollout.vllm.replica import VLLMOptions

    options = options if options is not None else VLLMOptions(enable_lora=True)
    cls = ray.remote(num_cpus=0, max_concurrency=4)(VLLMRolloutWorker)
    actors = [cls.remote(config, dtype=dtype, seed=seed + i, name=f"vllm-{i}", options=options,
                         **llm_kwargs) for i in range(n)]
    values_or_raise(call_all([Call(f"replica {i}", a, "ws_version") for i, a in enumerate(actors)],
                             timeout=timeout, phase="setup"))
    return actors
