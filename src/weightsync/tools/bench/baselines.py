"""What users do today, implemented in the bench harness as plainly as they do it.

* ``ray``: the trainer ``ray.put``\\s its state dict; every replica ``ray.get``\\s it and
  loads it into its own model (``load_state_dict`` semantics: one ``copy_`` per tensor).
* ``gloo-per-tensor``: one gloo broadcast per tensor (OpenRLHF style): the receiver
  allocates an empty tensor, receives into it and loads it into its model.
* ``safetensors-shm``: the trainer saves a safetensors file in ``/dev/shm``; every replica
  loads it and copies it into its model.

A baseline whose package is missing raises :class:`Unavailable`; the runner records the
reason and the table shows the row as skipped.
"""

from __future__ import annotations

import os
import secrets
from typing import Any

import torch

from weightsync.tools.bench.common import Method, gloo_group, shutdown_group

__all__ = ["BASELINES", "Unavailable", "RayCluster"]


class Unavailable(RuntimeError):
    """A baseline cannot run here (package missing)."""


def _copy_into(params: dict[str, torch.Tensor], state: dict[str, torch.Tensor]) -> None:
    """What ``load_state_dict`` does: one in-place copy per tensor, without autograd."""
    with torch.no_grad():
        for name, dst in params.items():
            dst.copy_(state[name])


class GlooPerTensor(Method):
    kind = "baseline"

    def setup(self) -> None:
        self.pg, self.store = gloo_group(self.ctx, "per-tensor")
        self.pg.broadcast(torch.zeros(16), 0).wait()

    def step(self, version: int) -> None:
        pg = self.pg
        if self.ctx.is_trainer:
            for t in self.ctx.params.values():
                pg.broadcast(t.contiguous(), 0).wait()
            return
        for name, dst in self.ctx.params.items():
            buf = torch.empty(dst.shape, dtype=dst.dtype)
            pg.broadcast(buf, 0).wait()
            with torch.no_grad():
                dst.copy_(buf)

    def teardown(self) -> None:
        shutdown_group(getattr(self, "pg", None))
        self.pg = self.store = None


class SafetensorsShm(Method):
    kind = "baseline"

    def setup(self) -> None:
        try:
            from safetensors.torch import load_file, save_file
        except ImportError:
            raise Unavailable("safetensors is not installed (pip install safetensors)") from None
        self.save_file, self.load_file = save_file, load_file
        token = secrets.token_hex(6) if self.ctx.is_trainer else None
        token = self.ctx.gather(token)[0]
        self.path = f"/dev/shm/weightsync-bench-{token}.safetensors"

    def step(self, version: int) -> None:
        if self.ctx.is_trainer:
            self.save_file(self.ctx.params, self.path)
        self.ctx.gather(None)  # the file is complete
        if not self.ctx.is_trainer:
            state = self.load_file(self.path)
            _copy_into(self.ctx.params, state)
            del state

    def teardown(self) -> None:
        if self.ctx.is_trainer and hasattr(self, "path"):
            try:
                os.unlink(self.path)
            except OSError:
                pass


class RayCluster:
    """A throwaway local Ray head started by the bench's parent process."""

    def __init__(self, object_store_bytes: int, temp_dir: str) -> None:
        try:
            import ray
        except ImportError:
            raise Unavailable("ray is not installed (pip install 'weightsync[ray]')") from None
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        # Ray's OOM killer looks at the whole host, which other processes share here: the
        # bench checks memory itself before each case
        os.environ.setdefault("RAY_memory_monitor_refresh_ms", "0")
        self.ray = ray
        info = ray.init(num_cpus=2, include_dashboard=False, _temp_dir=temp_dir,
                        object_store_memory=int(object_store_bytes), log_to_driver=False,
                        namespace="weightsync-bench", configure_logging=False)
        self.address = info.address_info["address"] if hasattr(info, "address_info") \
            else info["address"]

    def shutdown(self) -> None:
        self.ray.shutdown()


def _holder_class(ray):
    """A tiny actor through which the trainer hands its ObjectRef to the replicas (the way
    refs travel between Ray processes; it keeps Ray's reference counting intact)."""

    @ray.remote(num_cpus=0)
    class RefHolder:
        def __init__(self) -> None:
            self.version, self.refs = None, None

        def put(self, version, refs):
            self.version, self.refs = version, refs  # drops the previous version's refs

        def get(self, version):
            return self.refs if version == self.version else None

    return RefHolder


class RayObjectStore(Method):
    kind = "baseline"

    def setup(self) -> None:
        address = self.opts.get("ray_address")
        if not address:
            raise Unavailable(self.opts.get("ray_note") or "ray is not available")
        import ray
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        self.ray = ray
        if not ray.is_initialized():
            ray.init(address=address, namespace="weightsync-bench", log_to_driver=False,
                     configure_logging=False)
        ctx = self.ctx
        self.ref = None
        name = None
        if ctx.is_trainer:
            name = f"ws-bench-holder-{secrets.token_hex(6)}"
            self.holder = _holder_class(ray).options(name=name).remote()
            ray.get(self.holder.put.remote(None, None), timeout=ctx.timeout)
        name = ctx.gather(name)[0]
        if not ctx.is_trainer:
            self.holder = ray.get_actor(name)

    def step(self, version: int) -> None:
        ray, ctx = self.ray, self.ctx
        if ctx.is_trainer:
            ref = ray.put(ctx.params)
            ray.get(self.holder.put.remote(version, [ref]), timeout=ctx.timeout)
            self.ref = ref
        ctx.gather(None)  # "new weights are in the store" (an RPC in a real system)
        if not ctx.is_trainer:
            (ref,) = ray.get(self.holder.get.remote(version), timeout=ctx.timeout)
            state = ray.get(ref, timeout=ctx.timeout)
            _copy_into(ctx.params, state)
            del state, ref

    def teardown(self) -> None:
        self.ref = None
        if self.ctx.is_trainer and getattr(self, "holder", None) is not None:
            try:
                self.ray.kill(self.holder)
            except Exception:
                pass
        self.holder = None


BASELINES: dict[str, Any] = {"ray": RayObjectStore, "gloo-per-tensor": GlooPerTensor,
                             "safetensors-shm": SafetensorsShm}
