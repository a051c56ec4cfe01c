"""A local Ray cluster and worker groups for tests and the demo.

``start_local_ray`` starts (or joins) a small local Ray cluster with authentication off,
a temp dir of the caller's choosing, few CPUs, a small object store, and a runtime env
that lets workers import this copy of weightsync and keeps each worker to one thread.
``trainer_group`` / ``hf_replicas`` create the ready-made workers of
:mod:`weightsync.integrations.ray.workers` as actors (zero CPUs each, so any number fit).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional

from weightsync.orchestration.calls import Call, call_all, values_or_raise
from weightsync.orchestration import workers as ws

__all__ = ["start_local_ray", "stop_local_ray", "trainer_group", "hf_replicas", "kill_actors"]

_SRC = str(Path(__file__).resolve().parents[2])


def start_local_ray(*, num_cpus: int = 2, temp_dir: Optional[str] = None,
                    object_store_mb: int = 256, env: Optional[dict] = None) -> Any:
    """``ray.init`` for one machine; returns Ray's context (joins a running one)."""
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    import ray

    if ray.is_initialized():
        return ray.get_runtime_context()
    if not isinstance(num_cpus, int) or num_cpus < 1:
        raise ValueError(f"num_cpus must be an int >= 1, got {num_cpus!r}")
    path = os.pathsep.join(p for p in (_SRC, os.environ.get("PYTHONPATH", "")) if p)
    env_vars = {"PYTHONPATH": path, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
                "RAY_AUTH_MODE": "disabled", "TOKENIZERS_PARALLELISM": "false",
                "TRANSFORMERS_VERBOSITY": "error", "TORCH_CPP_LOG_LEVEL": "ERROR",
                "PYTHONWARNINGS": "ignore"}
    env_vars.update(env or {})
    if temp_dir is not None:
        temp_dir = str(Path(temp_dir).resolve())
        Path(temp_dir).mkdir(parents=True, exist_ok=True)
    return ray.init(num_cpus=num_cpus, include_dashboard=False, _temp_dir=temp_dir,
                    object_store_memory=object_store_mb * 1024 * 1024,
                    runtime_env={"env_vars": env_vars}, namespace="weightsync",
                    log_to_driver=os.environ.get("WEIGHTSYNC_RAY_LOGS", "0") == "1",
                    configure_logging=False)


def stop_local_ray() -> None:
    import ray

    if ray.is_initialized():
        ray.shutdown()


def trainer_group(world: int, config: dict, *, fsdp: bool = True, lora: Optional[dict] = None,
                  seed: int = 0, lr: float = 0.05, timeout: float = 120.0) -> list:
    """``world`` trainer actors in one gloo group, each holding the built model."""
    import ray

    from weightsync.integrations.ray.workers import ToyTrainerWorker

    cls = ray.remote(num_cpus=0)(ToyTrainerWorker)
    actors = [cls.remote(rank, world) for rank in range(world)]
    if world > 1 or fsdp:
        port = values_or_raise(call_all([Call("trainer rank 0", actors[0], "dist_master")],
                                        timeout=timeout, phase="setup"))[0]
        values_or_raise(call_all([Call(f"trainer rank {i}", a, "dist_init", (port, timeout))
                                  for i, a in enumerate(actors)], timeout=timeout, phase="setup"))
    values_or_raise(call_all([Call(f"trainer rank {i}", a, "build", (config,),
                                   {"seed": seed, "fsdp": fsdp, "lora": lora, "lr": lr})
                              for i, a in enumerate(actors)], timeout=timeout, phase="setup"))
    return actors


def hf_replicas(n: int, config: dict, *, dtype: Any = None, seed: int = 1234,
                timeout: float = 120.0, share_memory: bool = False) -> list:
    """``n`` HF rollout replica actors (threaded, so pause can interrupt generation);
    ``share_memory``: their weights in shared memory (an ``shm`` trainer writes into them)."""
    import ray

    from weightsync.integrations.ray.workers import HFRolloutWorker

    cls = ray.remote(num_cpus=0, max_concurrency=4)(HFRolloutWorker)
    actors = [cls.remote(config, dtype=dtype, seed=seed + i, name=f"hf-{i}",
                         share_memory=share_memory) for i in range(n)]
    values_or_raise(call_all([Call(f"replica {i}", a, ws.VERSION) for i, a in enumerate(actors)],
                             timeout=timeout, phase="setup"))
    return actors


def kill_actors(actors: list) -> None:
    import ray

    for a in actors:
        try:
            ray.kill(a, no_restart=True)
        except Exception:  # already gone
            pass
