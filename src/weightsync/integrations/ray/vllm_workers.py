"""vLLM rollout workers for Ray (or in-process use) and the demo's replica factories.

:class:`VLLMRolloutWorker` writes a config-built model (random weights) to a temp
folder, starts a :class:`~weightsync.rollout.vllm.VLLMRolloutReplica` on it and exposes
the calls :class:`~weightsync.orchestration.manager.CheckpointEngineManager` makes (through
:class:`~weightsync.integrations.ray.mixins.RolloutWorkerMixin`). :class:`VLLMServerWorker`
does the same with a :class:`~weightsync.rollout.vllm.server_replica.VLLMServerReplica`
(a ``vllm serve`` process driven over HTTP); :func:`vllm_server_replicas` makes them in
this process (the replica is an HTTP client; vLLM runs in the server processes).
"""

from __future__ import annotations

import concurrent.futures
import logging
import shutil
import tempfile
import time
from typing import Any, Optional

import torch

from weightsync.orchestration.calls import Call, call_all, values_or_raise
from weightsync.integrations.ray.mixins import RolloutWorkerMixin
from weightsync.orchestration import workers as ws

__all__ = ["VLLMRolloutWorker", "vllm_replicas", "VLLMServerWorker", "vllm_server_replicas"]

logger = logging.getLogger(__name__)


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

    def last_sync_stats(self) -> Any:
        return self.rollout.last_sync_stats()

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
    values_or_raise(call_all([Call(f"replica {i}", a, ws.VERSION) for i, a in enumerate(actors)],
                             timeout=timeout, phase="setup"))
    return actors


class VLLMServerWorker(RolloutWorkerMixin):
    """A :class:`~weightsync.rollout.vllm.server_replica.VLLMServerReplica` on a
    config-built model (random weights) in a temp folder, which it keeps until ``close()``
    (the server reads the checkpoint's headers for its checks)."""

    def __init__(self, config: dict, *, dtype: Optional[torch.dtype] = None, seed: int = 1234,
                 name: str = "vllm-server", options: Any = None) -> None:
        from dataclasses import replace

        from weightsync.rollout.vllm.server_replica import VLLMServerOptions, VLLMServerReplica
        from weightsync.rollout.vllm.util import model_folder_from_config

        dtype = dtype or torch.float32
        options = options if options is not None else VLLMServerOptions()
        options = replace(options, dtype=str(dtype).replace("torch.", ""))
        self.folder = tempfile.mkdtemp(prefix="wsvllm-serve-model-")
        try:
            model_folder_from_config(config, self.folder, dtype=dtype, seed=seed)
            self.rollout = VLLMServerReplica(self.folder, name=name, options=options)
        except BaseException:
            shutil.rmtree(self.folder, ignore_errors=True)
            raise

    def worker_states(self) -> list:
        return self.rollout.worker_states()

    def close(self) -> None:
        try:
            self.rollout.close()
        finally:
            shutil.rmtree(self.folder, ignore_errors=True)


def vllm_server_replicas(n: int, config: dict, *, dtype: Any = None, seed: int = 1234,
                         timeout: float = 900.0, options: Any = None,
                         backend: Optional[str] = None) -> list:
    """``n`` :class:`VLLMServerWorker` objects in this process, their servers started at
    once (each a ``vllm serve`` process; at most ``timeout`` seconds in all), receiving
    with ``backend`` (default: the options', ``shm``). Call ``close()`` on each when done
    (the demo does)."""
    from dataclasses import replace

    from weightsync.rollout.vllm.server_replica import VLLMServerOptions

    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be an int >= 1, got {n!r}")
    options = options if options is not None else VLLMServerOptions()
    if backend is not None:
        options = replace(options, backend=backend)
    pool = concurrent.futures.ThreadPoolExecutor(n, thread_name_prefix="weightsync-serve")
    futures = [pool.submit(VLLMServerWorker, config, dtype=dtype, seed=seed + i,
                           name=f"vllm-server-{i}", options=options) for i in range(n)]
    deadline = time.monotonic() + timeout
    workers, error = [], None
    for fut in futures:
        try:
            workers.append(fut.result(max(0.0, deadline - time.monotonic())))
        except BaseException as exc:   # keep going: the ones that started must be closed
            error = error or exc
            if not fut.done():          # still starting: close it once it is up
                fut.add_done_callback(_close_late)
    pool.shutdown(wait=False)
    if error is not None:
        for w in workers:
            try:
                w.close()
            except Exception as exc:  # the original failure is what matters
                logger.warning("weightsync: closing a server replica failed: %s", exc)
        if isinstance(error, concurrent.futures.TimeoutError):
            raise TimeoutError(f"{n} vllm serve replicas did not start within {timeout:.0f} s")
        raise error
    return workers


def _close_late(fut: concurrent.futures.Future) -> None:
    if fut.exception() is None:
        fut.result().close()
