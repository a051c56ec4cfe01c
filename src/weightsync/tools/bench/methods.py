"""What the bench times: weightsync backends and the physical limits.

Every method runs in the trainer process (rank 0) and the receiver processes (ranks
1..R) at once. ``setup`` may exchange small objects through ``ctx.gather``; ``step`` is one
timed sync from the trainer's tensors (``ctx.params`` on rank 0) into every receiver's
own, preallocated tensors (``ctx.params`` on ranks >= 1). Baselines live in
:mod:`weightsync.tools.bench.baselines`.
"""

from __future__ import annotations

import asyncio
import os

import torch

from weightsync.tools.bench.common import Method, gloo_group, shutdown_group
from weightsync.tools.bench.workloads import GiB

__all__ = ["Method", "method_table", "gloo_group"]

#: flat buffers of the limits are capped (and reused) so that 4 GiB runs fit in memory
FLAT_CAP = GiB


class _FlatBytes:
    """Same byte count as the workload, as repeated passes over one capped flat buffer."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self.size = min(nbytes, FLAT_CAP)
        self.passes = [(min(self.size, nbytes - off)) for off in range(0, nbytes, self.size)]


class Memcpy(Method):
    """Limit: one memcpy of the same bytes in one process (flat buffer -> flat buffer)."""

    trainer_only = True
    verify = False

    def setup(self) -> None:
        if self.ctx.is_trainer:
            self.flat = _FlatBytes(self.ctx.workload.nbytes)
            self.src = torch.ones(self.flat.size, dtype=torch.uint8)
            self.dst = torch.zeros(self.flat.size, dtype=torch.uint8)

    def step(self, version: int) -> None:
        if self.ctx.is_trainer:
            for n in self.flat.passes:
                self.dst[:n].copy_(self.src[:n])

    def teardown(self) -> None:
        self.src = self.dst = None

    def info(self) -> dict:
        return {"threads": torch.get_num_threads()} if self.ctx.is_trainer else {}


class MemcpyParallel(Method):
    """Reference: every receiver copies the same bytes at once (the machine's copy ceiling
    for R receivers that each must write a full model)."""

    verify = False

    def participates(self) -> bool:
        return not self.ctx.is_trainer

    def setup(self) -> None:
        if not self.ctx.is_trainer:
            self.flat = _FlatBytes(self.ctx.workload.nbytes)
            self.src = torch.ones(self.flat.size, dtype=torch.uint8)
            self.dst = torch.zeros(self.flat.size, dtype=torch.uint8)

    def step(self, version: int) -> None:
        if not self.ctx.is_trainer:
            for n in self.flat.passes:
                self.dst[:n].copy_(self.src[:n])

    def teardown(self) -> None:
        self.src = self.dst = None


class GlooFlat(Method):
    """Limit: one raw gloo broadcast of one flat buffer of the same size."""

    verify = False

    def setup(self) -> None:
        self.pg, self.store = gloo_group(self.ctx, "flat")
        self.flat = _FlatBytes(self.ctx.workload.nbytes)
        fill = torch.ones if self.ctx.is_trainer else torch.zeros
        self.buf = fill(self.flat.size, dtype=torch.uint8)
        self.pg.broadcast(self.buf[:4096], 0).wait()  # connect before timing

    def step(self, version: int) -> None:
        for n in self.flat.passes:
            self.pg.broadcast(self.buf[:n], 0).wait()

    def teardown(self) -> None:
        shutdown_group(getattr(self, "pg", None))
        self.pg = self.store = self.buf = None


class WeightSync(Method):
    """A weightsync backend: trainer ``send_weights``, receivers ``receive_weights``."""

    kind = "weightsync"
    backend = ""

    def setup(self) -> None:
        from weightsync.transport import CheckpointEngineRegistry
        ctx = self.ctx
        self.cls = CheckpointEngineRegistry.get(self.backend)
        role = "trainer" if ctx.is_trainer else "rollout"
        self.engine = self.cls(role=role, bucket_size=int(self.opts["bucket_size"]),
                               timeout=ctx.timeout)
        metas = ctx.gather(self.engine.prepare())
        topo = None
        if ctx.is_trainer:  # one build_topology for all: it draws the group's token
            from weightsync.transport.base import worker_kwargs
            tk, rk = self.cls.build_topology(1, ctx.receivers, metas)
            topo = [worker_kwargs(tk, 0)] + [worker_kwargs(rk, j) for j in range(ctx.receivers)]
        self.engine.init_process_group(**ctx.gather(topo)[0][ctx.rank])
        self.loop = asyncio.new_event_loop()
        self.metrics: list[dict] = []

    def step(self, version: int) -> None:
        if self.ctx.is_trainer:
            self.metrics.append(self.loop.run_until_complete(
                self.engine.send_weights(self.ctx.params.items(), version=version)))
        else:
            self.loop.run_until_complete(self._receive(version))

    async def _receive(self, version: int) -> None:
        params = self.ctx.params
        recv = getattr(self.engine, "receive_into", None)
        stream = None
        if recv is not None and self.opts.get("into", True):
            try:
                stream = recv(params, version=version)
            except TypeError:  # a subclass whose receive_weights takes no ``into``
                stream = None
        if stream is not None:
            async for _ in stream:
                pass
            return
        async for name, tensor in self.engine.receive_weights(version=version):
            params[name].copy_(tensor)

    def teardown(self) -> None:
        try:
            if getattr(self, "engine", None) is not None:
                self.engine.finalize()
        finally:
            if getattr(self, "loop", None) is not None:
                self.loop.close()

    def info(self) -> dict:
        if not self.metrics:
            return {}
        last = self.metrics[-1]
        return {k: last.get(k) for k in ("buckets", "buckets_with_layout", "tensors")}


class Shm(WeightSync):
    backend = "shm"


class ShmShared(Shm):
    """``shm`` with the trainer's tensors in torch's shared memory (the README's
    ``model.share_memory()`` for CPU trainers): receivers copy them out of a mapping. The
    bench's own tensors are put back for the methods after this one."""

    side = "trainer"

    def setup(self) -> None:
        self._private = None
        if self.ctx.is_trainer == (self.side == "trainer"):
            self._private = self.ctx.params
            self.ctx.params = {n: t.clone().share_memory_() for n, t in self._private.items()}
        super().setup()

    def teardown(self) -> None:
        try:
            super().teardown()
        finally:
            if self._private is not None:
                for n, t in self.ctx.params.items():   # carry the last version back
                    self._private[n].copy_(t)
                self.ctx.params, self._private = self._private, None


class ShmPush(ShmShared):
    """``shm`` with the receivers' tensors in torch's shared memory (``model.share_memory()``
    on a CPU rollout engine): the trainer writes into them, one copy, no ring."""

    side = "rollout"


class ShmBuckets(WeightSync):
    """``shm`` with direct (cross-memory-attach) reads turned off: every byte goes
    through the shared-memory bucket ring (two copies, pipelined). For analysis."""

    direct = "0"

    backend = "shm"

    def setup(self) -> None:
        old = os.environ.get("WEIGHTSYNC_SHM_DIRECT")
        os.environ["WEIGHTSYNC_SHM_DIRECT"] = self.direct
        try:
            super().setup()
        finally:
            if old is None:
                os.environ.pop("WEIGHTSYNC_SHM_DIRECT", None)
            else:
                os.environ["WEIGHTSYNC_SHM_DIRECT"] = old


class ShmDirect(ShmBuckets):
    """``shm`` with direct reads forced on whatever the receiver count. For analysis."""

    direct = "1"


class Collective(WeightSync):
    backend = "collective"


class Nixl(WeightSync):
    backend = "nixl"

    def info(self) -> dict:
        if not self.metrics:
            return {}
        last = self.metrics[-1]
        return {k: last.get(k) for k in ("tensors", "layout_sent", "held_bytes")}


class Delta(WeightSync):
    """A backend with the codec's delta layer (``delta+<backend>``): run with
    ``--changed F`` so that each sync changes a fraction of the elements, as training does."""

    def info(self) -> dict:
        if not self.metrics:
            return {}
        last = self.metrics[-1]
        codec = last.get("codec") or {}
        out = {k: codec.get(k) for k in ("mode", "dense_bytes", "record_bytes",
                                         "sent_dense_bytes", "resent")}
        # did the inner transport replay its plan (a layout that moves every sync does not)
        out["layout_resent"] = [m.get("layout_sent", m.get("buckets_with_layout"))
                                for m in self.metrics[1:]]
        out["changed_per_sync"] = [(m.get("codec") or {}).get("changed_fraction")
                                   for m in self.metrics]
        return out


DELTA_OVER = ("shm", "collective", "nixl")      # the bench's delta+<backend> methods


class NixlRaw(Method):
    """Limit: one NIXL READ per pass of one flat registered region of the same bytes
    (trainer -> every receiver), the agents and handles set up before timing.

    The bench pairs it with ``nixl`` in the same processes, so its agents live through every
    step of the engine's too. None of them runs NIXL's progress thread, which would keep a
    core busy all along and slow the engine's steps beside it: the readers progress their
    reads as they poll them, and the trainer's agent, read from, is progressed by a
    :class:`~weightsync.transport.backends.nixl.agent.Poller`."""

    verify = False

    def setup(self) -> None:
        from weightsync.transport.backends.nixl.agent import NixlAgent, Poller
        from weightsync.transport.backends.nixl.engine import NixlOptions
        ctx = self.ctx
        self.flat = _FlatBytes(ctx.workload.nbytes)
        self.agent = NixlAgent(f"bench-raw-{os.getpid()}-{ctx.rank}", progress_thread=False,
                               ucx_tls=NixlOptions().ucx_tls)
        self.poller = Poller(self.agent) if ctx.is_trainer else None
        self.buf = torch.ones(self.flat.size, dtype=torch.uint8)
        self.agent.register(self.buf)
        mine = (self.agent.name, self.agent.metadata(), self.buf.data_ptr())
        name, meta, addr = ctx.gather(mine)[0]
        self.reads = []
        if not ctx.is_trainer:
            self.agent.add_remote(name, meta, peer="trainer rank 0")
            for n in self.flat.passes:
                self.reads.append(self.agent.reads(name, [(self.buf.data_ptr(), n)], [(addr, n)],
                                                   mem="DRAM", remote_mem="DRAM",
                                                   peer="trainer rank 0"))
        ctx.gather(None)

    def step(self, version: int) -> None:
        from weightsync.transport.backends.nixl.agent import wait_all
        import time
        for r in self.reads:
            r.post(version=version)
            wait_all([r], time.monotonic() + self.ctx.timeout, version=version)

    def teardown(self) -> None:
        try:
            self.ctx.gather(None)            # the trainer's memory stays until all read it
        finally:
            for r in getattr(self, "reads", []):
                r.release()
            if getattr(self, "poller", None) is not None:
                self.poller.stop()
            if getattr(self, "agent", None) is not None:
                self.agent.close()
            self.agent = self.buf = self.poller = None


class CmaRaw(Method):
    """Limit: every receiver reads the trainer's flat buffer of the same bytes with
    cross-memory reads (``process_vm_readv``), all at once, each split over the copy threads
    an shm receiver of this many receivers uses: the rate shm's direct reads can reach."""

    verify = False

    def setup(self) -> None:
        from concurrent.futures import ThreadPoolExecutor

        from weightsync.transport.backends.shm.engine import ShmOptions
        from weightsync.transport.fastcopy import copy_threads
        ctx = self.ctx
        self.flat = _FlatBytes(ctx.workload.nbytes)
        # the trainer's bytes are ones, a receiver's zeros until read (checked at teardown)
        self.buf = (torch.ones if ctx.is_trainer else torch.zeros)(self.flat.size,
                                                                    dtype=torch.uint8)
        self.src = ctx.gather((os.getpid(), self.buf.data_ptr()))[0]
        self.parts = copy_threads(ctx.receivers, threads=ShmOptions().copy_threads)
        self.pool = ThreadPoolExecutor(self.parts - 1) if not ctx.is_trainer and \
            self.parts > 1 else None

    def step(self, version: int) -> None:
        from weightsync.transport.fastcopy import cma_read
        if self.ctx.is_trainer:
            return
        for n in self.flat.passes:
            cma_read(self.src[0], self.src[1], self.buf[:n], self.pool, self.parts)

    def teardown(self) -> None:
        try:
            self.ctx.gather(None)            # the trainer's memory stays until all read it
            if not self.ctx.is_trainer and self.flat.passes and \
                    int(self.buf[:self.flat.passes[0]].sum()) != self.flat.passes[0]:
                raise RuntimeError("cma-raw: the receiver's buffer does not hold the "
                                   "trainer's bytes")
        finally:
            if getattr(self, "pool", None) is not None:
                self.pool.shutdown()
            self.buf = self.pool = None


_TABLE: dict[str, type[Method]] = {}


def method_table() -> dict[str, type[Method]]:
    """Every method by name (baselines imported on first use)."""
    if not _TABLE:
        from weightsync.tools.bench.baselines import BASELINES
        _TABLE.update({"shm": Shm, "collective": Collective, "shm-buckets": ShmBuckets,
                       "shm-shared": ShmShared, "shm-push": ShmPush,
                       "shm-direct": ShmDirect, "nixl": Nixl, "nixl-raw": NixlRaw,
                       "cma-raw": CmaRaw})
        _TABLE.update({f"delta+{b}": type(f"Delta_{b}", (Delta,), {"backend": f"delta+{b}"})
                       for b in DELTA_OVER})
        _TABLE.update(BASELINES)
        _TABLE.update({"memcpy": Memcpy, "gloo-flat": GlooFlat,
                       "memcpy-parallel": MemcpyParallel})
    return _TABLE
