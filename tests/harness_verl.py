"""Drive verl's real ``CheckpointEngineManager`` on CPU: no GPU, no inference server.

Trainer ranks are verl ``Worker`` actors that hold a small model sharded with FSDP2 over
a gloo mesh and hand the manager ``DTensor.full_tensor()`` of every weight (like verl's
FSDP engine); rollout ranks are verl's own ``CheckpointEngineWorker`` with a server
adapter that records what it receives. Replicas have no servers, so verl's
abort/release/resume steps are no-ops. Everything stays on loopback.

Try a backend and measure its per-update cycle (prepare + init + finalize)::

    python tests/harness_verl.py --backend weightsync-shm --bucket-mb 256

The worker classes live in this module, which the Ray workers import (the cluster puts
this folder on their ``PYTHONPATH``): Ray pickles classes by reference.
"""

from __future__ import annotations

import os

os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
# Keep Ray (and verl's MASTER_ADDR) on 127.0.0.1; read when ray is first imported.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import argparse  # noqa: E402
import asyncio  # noqa: E402
import datetime  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import zlib  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Iterator, Optional  # noqa: E402

import ray  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402
from torch.distributed.tensor import Replicate, Shard, distribute_tensor  # noqa: E402
from verl.checkpoint_engine import (CheckpointEngineManager, CheckpointEngineRegistry,  # noqa: E402
                                    CheckpointEngineWorker)
from verl.single_controller.base import Worker  # noqa: E402
from verl.single_controller.base.decorator import Dispatch, register  # noqa: E402
from verl.single_controller.ray import (RayClassWithInitArgs, RayResourcePool,  # noqa: E402
                                        RayWorkerGroup)
from verl.utils.import_utils import import_external_libs  # noqa: E402
from verl.workers.config import CheckpointEngineConfig, RolloutConfig  # noqa: E402
from verl.workers.rollout import BaseRollout, RolloutReplica  # noqa: E402

import weightsync  # noqa: E402

__all__ = ["VerlCluster", "expected_weights", "ce_config", "main"]

MODULE = "weightsync.integrations.verl"
#: (name, shape, dtype) of the extra DTensors next to the FSDP2 model's parameters.
EXTRA = (("stats.counter", (5,), torch.int64), ("stats.empty", (0, 3), torch.float32),
         ("stats.scale", (), torch.float16))


def _step_key(step: Optional[int]) -> int:
    return 1_000_003 if step is None else int(step)


def _value(name: str, shape: tuple, dtype: torch.dtype, step: Optional[int]) -> torch.Tensor:
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()) * 7919 + _step_key(step))
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(-2**40, 2**40, shape, generator=g, dtype=dtype)


class _Net(torch.nn.Module):
    def __init__(self, big_rows: int) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(257, 24)                     # uneven shards
        self.proj = torch.nn.Linear(24, 33).to(torch.bfloat16)
        self.big = torch.nn.Linear(512, big_rows, bias=False)       # > 1 MiB: chunked


def _specs(big_rows: int) -> list[tuple[str, tuple, torch.dtype]]:
    net = _Net(big_rows)
    return [(n, tuple(p.shape), p.dtype) for n, p in net.named_parameters()] + list(EXTRA)


def expected_weights(step: Optional[int], big_rows: int = 640) -> dict[str, torch.Tensor]:
    """The full weights every trainer rank produces for ``global_steps=step``."""
    return {n: _value(n, s, d, step) for n, s, d in _specs(big_rows)}


def ce_config(backend: str, bucket_mb: int = 1, **engine_kwargs: Any) -> CheckpointEngineConfig:
    return CheckpointEngineConfig(backend=backend, update_weights_bucket_megabytes=bucket_mb,
                                  custom_backend_module=MODULE,
                                  engine_kwargs={backend: dict(engine_kwargs)})


def _new_engine(ce: CheckpointEngineConfig, **extra: Any) -> Any:
    """Exactly verl's construction call (``engine_workers.py`` / ``CheckpointEngineWorker``)."""
    import_external_libs(ce.custom_backend_module or None)
    size = ce.update_weights_bucket_megabytes << 20
    return CheckpointEngineRegistry.new(ce.backend, bucket_size=size, **extra,
                                        **ce.engine_kwargs.get(ce.backend, {}))


def _close(engine: Any) -> None:
    close = getattr(engine, "close", None) or getattr(engine, "finalize", None)
    if close is not None:
        close()


class TrainerWorker(Worker):
    """What ``CheckpointEngineManager`` calls on ``actor_wg`` (as ``ActorRolloutRefWorker``)."""

    def __init__(self, ce: CheckpointEngineConfig, big_rows: int = 640) -> None:
        super().__init__()
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
        self.mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        self.model = _Net(big_rows)
        fully_shard(self.model, mesh=self.mesh)
        self.extra = {n: distribute_tensor(torch.zeros(s, dtype=d), self.mesh,
                                           [Shard(0)] if len(s) else [Replicate()])
                      for n, s, d in EXTRA}
        self.checkpoint_engine = _new_engine(ce, is_master=(self.rank == 0))

    def _sharded(self) -> Iterator[tuple[str, Any]]:
        yield from self.model.named_parameters()
        yield from self.extra.items()

    @torch.no_grad()
    def _set_step(self, step: Optional[int]) -> None:
        for name, dt in self._sharded():
            full = _value(name, tuple(dt.shape), dt.dtype, step)
            local = distribute_tensor(full, self.mesh, dt.placements, src_data_rank=None)
            dt.to_local().copy_(local.to_local())

    def _full_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, dt in self._sharded():
            yield name, dt.full_tensor()   # an all-gather: every rank walks the same order

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def use_backend(self, ce: CheckpointEngineConfig) -> None:
        _close(self.checkpoint_engine)
        self.checkpoint_engine = _new_engine(ce, is_master=(self.rank == 0))

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    async def update_weights(self, global_steps: Optional[int] = None, mode: str = "auto") -> dict:
        self._set_step(global_steps)
        metrics = await self.checkpoint_engine.send_weights(self._full_tensors(),
                                                            global_steps=global_steps)
        return metrics or {}

    @register(dispatch_mode=Dispatch.DP_COMPUTE, blocking=False)
    def execute_checkpoint_engine(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.checkpoint_engine, method)(*args, **kwargs)


class RecordingAdapter(BaseRollout):
    """Stands in for vLLM's server adapter: consumes the stream like verl's adapters do."""

    def __init__(self, config: Any, model_config: Any) -> None:
        super().__init__(config, model_config, device_mesh=None)
        self.received: list[tuple[str, torch.Tensor]] = []
        self.global_steps: Any = "never"
        self.updates = 0
        self.fail_after: Optional[int] = None   # raise after this many tensors (fault test)

    async def resume(self, tags: list[str]) -> None:
        pass

    async def release(self) -> None:
        pass

    async def update_weights(self, weights: Any, global_steps: Any = None,
                             wire_format: str = "named_tensors", **kwargs: Any) -> None:
        if wire_format != "named_tensors":
            raise ValueError(f"unexpected wire_format {wire_format!r}")
        self.received, self.global_steps = [], global_steps
        async for name, tensor in weights:
            if self.fail_after is not None and len(self.received) >= self.fail_after:
                self.fail_after = None
                raise RuntimeError("injected adapter failure")
            self.received.append((name, tensor.clone()))
        self.updates += 1


class RolloutWorker(CheckpointEngineWorker):
    """verl's real ``CheckpointEngineWorker`` with a recording adapter."""

    def __init__(self, rollout_config: Any, model_config: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(rollout_config, model_config,
                         RecordingAdapter(rollout_config, model_config), *args, **kwargs)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def use_backend(self, ce: CheckpointEngineConfig) -> None:
        _close(self.checkpoint_engine)
        self.checkpoint_engine = _new_engine(ce)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def get_received(self) -> tuple[Any, int, list[tuple[str, torch.Tensor]]]:
        a = self.server_adapter
        return a.global_steps, a.updates, a.received

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def fail_next_update(self, rank: int, after: int) -> None:
        if self.rank == rank:
            self.server_adapter.fail_after = after


class CPUReplica(RolloutReplica):
    """A replica without servers: verl's abort/release/resume steps do nothing."""

    async def init_hybrid(self, worker_group: RayWorkerGroup) -> None:
        n = self.world_size
        self.workers = worker_group.workers[n * self.replica_rank: n * (self.replica_rank + 1)]

    async def launch_servers(self) -> None:
        pass


class VerlCluster:
    """Local Ray cluster: ``trainers`` trainer ranks, ``replicas`` x ``tp`` rollout ranks."""

    def __init__(self, ce: CheckpointEngineConfig, *, trainers: int = 2, replicas: int = 2,
                 tp: int = 2, big_rows: int = 640, num_cpus: int = 8) -> None:
        if ray.is_initialized():
            ray.shutdown()
        import ray._private.ray_constants as rc
        rc.ENABLE_RAY_CLUSTER = False   # loopback even if ray was imported before us
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        env = {"GLOO_SOCKET_IFNAME": "lo", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
               "RAY_AUTH_MODE": "disabled", "TORCH_CPP_LOG_LEVEL": "ERROR",
               "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
               "PYTHONPATH": os.pathsep.join([str(Path(weightsync.__file__).resolve().parents[1]),
                                              str(Path(__file__).resolve().parent)])}
        ray.init(num_cpus=num_cpus, include_dashboard=False, logging_level="WARNING",
                 object_store_memory=256 << 20, runtime_env={"env_vars": env},
                 log_to_driver=os.environ.get("WEIGHTSYNC_RAY_LOGS", "0") == "1")
        self.big_rows = big_rows
        self.rollout_config = RolloutConfig(name="vllm", tensor_model_parallel_size=tp,
                                            checkpoint_engine=ce)
        self.actor_wg = RayWorkerGroup(
            resource_pool=RayResourcePool([trainers], use_gpu=False, max_colocate_count=1,
                                          name_prefix="ws_trainer"),
            ray_cls_with_init=RayClassWithInitArgs(cls=ray.remote(TrainerWorker), ce=ce,
                                                   big_rows=big_rows),
            device_name="cpu")
        self.rollout_wg = RayWorkerGroup(
            resource_pool=RayResourcePool([replicas * tp], use_gpu=False, max_colocate_count=1,
                                          name_prefix="ws_rollout"),
            ray_cls_with_init=RayClassWithInitArgs(cls=ray.remote(RolloutWorker),
                                                   rollout_config=self.rollout_config,
                                                   model_config=None),
            device_name="cpu")
        self.replicas = [CPUReplica(replica_rank=i, config=self.rollout_config, model_config=None)
                         for i in range(replicas)]

        async def _init() -> None:
            await asyncio.gather(*[r.init_hybrid(self.rollout_wg) for r in self.replicas])

        asyncio.run(_init())
        self.ce = ce
        self.manager = CheckpointEngineManager(config=ce, actor_wg=self.actor_wg,
                                               replicas=list(self.replicas))

    def use_backend(self, ce: CheckpointEngineConfig) -> None:
        """Rebuild every worker's engine for another backend (verl's constructor call)."""
        self.actor_wg.use_backend(ce)
        self.rollout_wg.use_backend(ce)
        self.ce = ce
        self.manager = CheckpointEngineManager(config=ce, actor_wg=self.actor_wg,
                                               replicas=list(self.replicas))

    def update(self, global_steps: Optional[int]) -> dict:
        return self.manager.update_weights(global_steps=global_steps)

    def received(self) -> list[tuple[Any, int, list[tuple[str, torch.Tensor]]]]:
        return self.rollout_wg.get_received()

    def cycle_stats(self) -> list[dict]:
        refs = []
        for wg in (self.actor_wg, self.rollout_wg):
            refs += wg.execute_checkpoint_engine(["cycle_stats"] * wg.world_size)
        return ray.get(refs, timeout=60)

    def shutdown(self) -> None:
        ray.shutdown()


def _bench(args: argparse.Namespace) -> None:
    kwargs: dict[str, Any] = {"timeout": args.timeout}
    cluster = VerlCluster(ce_config(args.backend, args.bucket_mb, reuse=True, **kwargs))
    try:
        for reuse in (False, True):
            cluster.use_backend(ce_config(args.backend, args.bucket_mb, reuse=reuse, **kwargs))
            cycle, total = [], []
            for step in range(args.updates):
                t0 = time.perf_counter()
                cluster.update(step)
                total.append(time.perf_counter() - t0)
                stats = cluster.cycle_stats()
                cycle.append(max(s["prepare_s"] + s["init_s"] + s["finalize_s"] for s in stats))
            steady = cycle[1:] or cycle
            med = 1e3 * statistics.median(steady)
            upd = 1e3 * statistics.median(total[1:] or total)
            print(f"{args.backend} reuse={reuse} bucket={args.bucket_mb} MiB: per-update "
                  f"prepare+init+finalize (slowest worker) median {med:.3f} ms (first "
                  f"{1e3 * cycle[0]:.1f} ms); manager.update_weights median {upd:.1f} ms")
    finally:
        cluster.shutdown()


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backend", default="weightsync-shm")
    parser.add_argument("--bucket-mb", type=int, default=256)
    parser.add_argument("--updates", type=int, default=6)
    parser.add_argument("--timeout", type=float, default=120.0)
    _bench(parser.parse_args(argv))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from harness_verl import main as run   # the worker classes of the importable module
    run()
