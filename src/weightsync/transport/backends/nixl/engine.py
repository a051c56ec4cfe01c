"""``nixl``: rollout workers pull what they keep from every trainer rank, with one-sided
NIXL READs on a plan compiled once.

Trainer ranks *serve*: each one keeps the bytes it yields in memory registered with its
NIXL agent once and reused by every sync whose layout is the same. An FSDP2 rank yields
its local ``Shard(0)`` shards as they are (DTensors: no gather); what it holds of each
tensor is an element range of the full tensor. Receivers *pull*: from every trainer
rank's layout (:class:`~weightsync.core.wire.SourceMsg`, sent only when it changes) and
what the receiver keeps, :func:`~weightsync.core.xferplan.compile_plan` computes the reads
once (coalesced, sources balanced where ranks hold the same bytes). A warm sync is one
small :class:`~weightsync.core.wire.PullMsg` per trainer rank, one re-posted NIXL transfer
per source rank, and one :class:`~weightsync.core.wire.PulledMsg` back.

Consistent reads: ``send_weights`` returns only once every receiver reported that it has
read all it needs of this version from this rank, so a trainer that updates its weights
right after cannot change bytes a reader still reads. What a rank serves lives in a
staging arena it owns (one copy of what it yields; memory: its share of the model, kept
across syncs) unless ``WEIGHTSYNC_NIXL_SERVE=params``: then contiguous tensors are served
from their own storage (no copy, no extra memory; registered once while their storage
stays the same).

Receivers land the bytes in a registered buffer of what they keep (memory: that size, kept
across syncs) and yield views of it, valid until the next sync. Every wait is bounded; a
peer that goes away is a ``PeerFailed`` naming it; per-sync messages travel on the
token-checked control links, never pickled.

Lifecycle: ``prepare`` (trainers start their control store) -> ``build_topology`` ->
``init_process_group`` (agents, control links) -> syncs -> ``finalize`` (handles,
registrations, agents and sockets released).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, AsyncIterator, Optional

import torch

from weightsync.core.errors import PlanMismatch, SyncTimeout, VersionMismatch, WeightSyncError
from weightsync.core.plan import dtype_from_name, dtype_name
from weightsync.core.remote import error_msg, raise_remote, wire_version
from weightsync.core.wire import ErrorMsg, PulledMsg, PullMsg, SourceMsg
from weightsync.core.xferplan import DestLayout, HeldRange, SourceLayout, TransferPlan, Want, compile_plan
from weightsync.transport.backends.nixl.agent import (NixlAgent, Reads, mem_type, require_nixl,
                                                     ucx_transports, wait_all)
from weightsync.transport.backends.nixl.layout import Arena, held_of
from weightsync.transport.base import CheckpointEngine
from weightsync.transport.control.group import StoreGroupMixin
from weightsync.transport.control.links import Link, LinkHub
from weightsync.transport.protocol.receiver import patience
from weightsync.transport.registry import CheckpointEngineRegistry
from weightsync.transport.tensors import aiter_items, wire_dtype

__all__ = ["NixlEngine"]

logger = logging.getLogger(__name__)
_SERVE = ("staging", "params")


@CheckpointEngineRegistry.register("nixl")
class NixlEngine(StoreGroupMixin, CheckpointEngine):
    """Point-to-point pull over NIXL (UCX): DRAM->DRAM on CPU, VRAM->VRAM on GPUs."""

    capabilities = frozenset({"cpu", "cuda", "same_host", "multi_host", "shards"})

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        require_nixl()
        serve = os.environ.get("WEIGHTSYNC_NIXL_SERVE", "staging").strip().lower() or "staging"
        if serve not in _SERVE:
            raise ValueError(f"WEIGHTSYNC_NIXL_SERVE must be one of {_SERVE}, got {serve!r}")
        self._serve_mode = serve
        self._seq, self._rank, self._world, self._num_receivers = 0, -1, 0, 0
        self._agent: Optional[NixlAgent] = None
        self._hub: Optional[LinkHub] = None
        self._links: dict[int, Link] = {}
        self._pool: Optional[ThreadPoolExecutor] = None
        self._arena: Optional[Arena] = None
        self._published: Optional[str] = None      # layout digest receivers have
        self._sources: dict[int, SourceMsg] = {}
        self._plan: Optional[TransferPlan] = None
        self._plan_key: Optional[tuple] = None
        self._reads: list[Reads] = []
        self._landing: Optional[torch.Tensor] = None
        self._landing_reg: Any = None
        self._plan_bytes: dict[int, int] = {}
        self._views: list[tuple[str, tuple, str, int, int]] = []
        self.last_plan: Optional[TransferPlan] = None

    # -- set-up ---------------------------------------------------------------------------
    def _executor(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix=f"weightsync-nixl-{self._rank}")
        return self._pool

    def _init_sender(self) -> None:
        self._agent = NixlAgent(f"ws-{self._token[:16]}-t{self._rank}")
        host, t = self.config.host, self.config.timeout
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._hub = LinkHub(family, (host, 0), self._token, t)
        self._server.set(self._prefix(self._rank) + "/link", json.dumps([host, self._hub.address[1]]))
        self._hub.accept(self._num_receivers, time.monotonic() + t)
        self._arena = Arena(self._agent, self.config.bucket_size,
                            zero_copy=self._serve_mode == "params")
        logger.info("weightsync nixl: trainer rank %d serving over UCX (UCX_TLS=%s)", self._rank,
                    ucx_transports())

    def _init_receiver(self) -> None:
        self._agent = NixlAgent(f"ws-{self._token[:16]}-r{self._rank}")
        t = self.config.timeout
        for s in range(self._world):
            peer = f"trainer rank {s}"
            try:
                host, port = json.loads(self._clients[s].get(self._prefix(s) + "/link", t))
            except Exception as exc:  # StoreTimeout, a closed store, a malformed value
                raise SyncTimeout(f"no control link address from {peer}: {exc}", peer=peer,
                                  phase="init") from None
            family = socket.AF_INET6 if ":" in str(host) else socket.AF_INET
            self._links[s] = Link(family, (str(host), int(port)), self._token, self._rank, t,
                                  peer=peer)

    def reset_plan(self) -> None:
        self._published = None
        self._drop_reads()
        self._plan = self._plan_key = None

    def _receiver_boxes(self) -> list[str]:
        return [f"r{r}" for r in range(self._num_receivers)]

    # -- trainer --------------------------------------------------------------------------
    async def send_weights(self, named_tensors: Any, version: Any = None) -> dict[str, Any]:
        if self.config.role != "trainer" or self._rank < 0:
            raise RuntimeError("nixl: send_weights needs a trainer engine after init_process_group")
        self._seq += 1
        seq, start = self._seq, time.perf_counter()
        loop = asyncio.get_running_loop()
        pool = self._executor()
        try:
            self._arena.begin()
            count = 0
            async for name, tensor in aiter_items(named_tensors, shards=True):
                dtype = wire_dtype(tensor, self.config.dtype)
                await loop.run_in_executor(pool, self._arena.put, name, tensor, dtype)
                count += 1
            served = await loop.run_in_executor(pool, self._serve, seq, version)
        except BaseException as exc:
            self._abort(seq, version, exc, "send", self._hub_tell_all)
            raise
        seconds = time.perf_counter() - start
        nbytes = sum(served.values())
        gbps = nbytes / seconds / 1e9 if seconds > 0 else 0.0
        logger.info("weightsync nixl: served version %s: %d tensors, %d bytes in %.4f s "
                    "(%.2f GB/s) to %d receivers%s", version, count, nbytes, seconds, gbps,
                    self._num_receivers, " (new layout)" if self._arena.changed else "")
        return {"version": version, "bytes": nbytes, "seconds": seconds, "gbps": gbps,
                "tensors": count, "layout_sent": self._arena.changed,
                "held_bytes": self._arena.nbytes, "served": served, "backend": self.backend_name}

    def _hub_push(self, msg: Any) -> None:
        self._hub.push_many(self._receiver_boxes(), msg)

    def _hub_tell_all(self, msg: Any) -> None:
        """Push to every receiver that is still there (one that is gone does not keep the
        others from hearing about the failure)."""
        for box in self._receiver_boxes():
            try:
                self._hub.push(box, msg)
            except WeightSyncError:
                continue

    def _serve(self, seq: int, version: Any) -> dict[int, int]:
        """Publish the layout if it changed, tell receivers to pull, wait until all have."""
        arena = self._arena
        arena.finish()
        if arena.digest != self._published:
            self._hub_push(SourceMsg(seq=seq, stream=self._rank, agent=self._agent.name,
                                     metadata=self._agent.metadata(), mem=arena.mem,
                                     digest=arena.digest, regions=arena.regions(),
                                     held=arena.held()))
            self._published = arena.digest
        self._hub_push(PullMsg(version=wire_version(version), seq=seq, stream=self._rank,
                               digest=arena.digest))
        served: dict[int, int] = {}
        deadline = time.monotonic() + self.config.timeout
        while len(served) < self._num_receivers:
            left = deadline - time.monotonic()
            missing = sorted(set(range(self._num_receivers)) - set(served))
            if left <= 0:
                raise SyncTimeout(f"rollout ranks {missing} did not finish pulling",
                                  peer=f"rollout rank {missing[0]}", phase="send", version=version)
            self._hub.expect(set(missing))
            msg = self._hub.pop(timeout=left, peer=f"rollout rank {missing[0]}", phase="send",
                                version=version)
            if isinstance(msg, ErrorMsg) and msg.seq >= seq:
                raise_remote(msg, phase="send")
            if isinstance(msg, PulledMsg) and msg.seq == seq:
                served[msg.rank] = msg.nbytes
        return served

    # -- receiver -------------------------------------------------------------------------
    async def receive_weights(self, version: Any = None) -> AsyncIterator[tuple[str, torch.Tensor]]:
        if self.config.role != "rollout" or self._rank < 0:
            raise RuntimeError("nixl: receive_weights needs a rollout engine after init_process_group")
        self._seq += 1
        loop = asyncio.get_running_loop()
        try:
            views = await loop.run_in_executor(self._executor(), self._pull, version)
        except BaseException as exc:
            self._abort(self._seq, version, exc, "receive", self._links_push)
            raise
        for name, tensor in views:
            yield name, tensor

    def _links_push(self, msg: Any) -> None:
        for link in self._links.values():
            try:
                link.push("t", msg)
            except WeightSyncError:
                continue          # that trainer is gone; tell the others

    def _pull(self, version: Any) -> list[tuple[str, torch.Tensor]]:
        deadline = time.monotonic() + patience(self.config.timeout)
        got = {s: self._await_pull(s, version, deadline) for s in range(self._world)}
        self._ensure_plan()
        for r in self._reads:
            r.post(version=version)
        wait_all(self._reads, deadline, version=version)
        for s, link in self._links.items():
            link.push("t", PulledMsg(seq=got[s].seq, stream=s, rank=self._rank,
                                     nbytes=self._plan_bytes.get(s, 0), plan=self._plan.digest))
        return self._tensors()

    def _await_pull(self, s: int, version: Any, deadline: float) -> PullMsg:
        peer = f"trainer rank {s}"
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise SyncTimeout(f"{peer} never offered a version to pull", peer=peer,
                                  phase="receive", version=version)
            msg = self._links[s].pop(timeout=left, peer=peer, phase="receive", version=version)
            if isinstance(msg, ErrorMsg):
                if msg.seq >= self._seq:
                    raise_remote(msg, phase="receive")
                continue                     # the report of a sync that is already over
            if isinstance(msg, SourceMsg):
                self._sources[s] = msg
                continue
            if not isinstance(msg, PullMsg) or msg.seq < self._seq:
                continue                     # left over from an aborted sync
            self._seq = msg.seq
            if version is not None and msg.version != wire_version(version):
                raise VersionMismatch(f"{peer} serves version {msg.version!r}, this receiver "
                                      f"expects {version!r}", peer=peer, phase="receive",
                                      version=version)
            src = self._sources.get(s)
            if src is None or src.digest != msg.digest:
                raise PlanMismatch(f"{peer} serves layout {msg.digest[:12]} but sent no "
                                   "description of it", peer=peer, phase="receive",
                                   version=version)
            return msg

    def _ensure_plan(self) -> None:
        key = tuple(self._sources[s].digest for s in range(self._world))
        if key == self._plan_key and self._plan is not None:
            return
        self._drop_reads()
        sources = [SourceLayout(rank=s, held=held_of(self._sources[s]))
                   for s in range(self._world)]
        wants, views, offset = [], [], 0
        for name, shape, dtype in _union(self._sources, self._world):
            nbytes = _numel(shape) * dtype_from_name(dtype).itemsize
            wants.append(Want(name=name, dtype=dtype, box=tuple((0, d) for d in shape),
                              dest="landing", offset=offset))
            views.append((name, shape, dtype, offset, nbytes))
            offset += -(-nbytes // 256) * 256 if nbytes else 0
        me = f"rollout rank {self._rank}"
        # pieces of at most a bucket, so ranks that hold the same bytes share the serving
        plan = compile_plan(sources, [DestLayout(worker=me, wants=tuple(wants))],
                            max_read_bytes=self.config.bucket_size)
        device = torch.device(self.config.device)
        self._landing = torch.empty(max(offset, 1), dtype=torch.uint8, device=device)
        self._landing_reg = self._agent.register(self._landing)
        self._reads, self._plan_bytes = [], {}
        base = self._landing.data_ptr()
        for s in range(self._world):
            src = self._sources[s]
            regions = {name: (addr, dev) for name, addr, _, dev in src.regions}
            peer = f"trainer rank {s}"
            self._agent.remove_remote(src.agent)      # its metadata lists its registrations
            self._agent.add_remote(src.agent, src.metadata, peer=peer)
            mine = plan.reads_from(s)
            local = [(base + r.dst_offset, r.nbytes) for r in mine]
            remote = [(regions[r.src_region][0] + r.src_offset, r.nbytes) for r in mine]
            rdev = regions[mine[0].src_region][1] if mine else 0
            self._reads.append(self._agent.reads(src.agent, local, remote, mem=mem_type(device),
                                                 remote_mem=src.mem, device=device.index or 0,
                                                 remote_device=rdev, peer=peer))
            self._plan_bytes[s] = sum(r.nbytes for r in mine)
        self._plan, self._plan_key, self._views, self.last_plan = plan, key, views, plan
        logger.info("weightsync nixl: rollout rank %d compiled a plan: %d reads, %d bytes "
                    "from %d trainer ranks", self._rank, len(plan.reads), plan.total_bytes,
                    self._world)

    def _tensors(self) -> list[tuple[str, torch.Tensor]]:
        out = []
        for name, shape, dtype, offset, nbytes in self._views:
            flat = self._landing[offset:offset + nbytes]
            out.append((name, flat.view(dtype_from_name(dtype)).view(shape)))
        return out

    def _drop_reads(self) -> None:
        for r in getattr(self, "_reads", []):
            r.release()
        self._reads = []
        if self._agent is not None:
            self._agent.deregister(self._landing_reg)
        self._landing, self._landing_reg = None, None

    # -- failures and teardown --------------------------------------------------------------
    def _abort(self, seq: int, version: Any, exc: BaseException, phase: str, push) -> None:
        """Tell every peer this side of the sync failed (best effort), and forget the plan:
        the next sync starts from a fresh layout."""
        who = f"{self.config.role} rank {self._rank}"
        if isinstance(exc, (asyncio.CancelledError, GeneratorExit)) or not isinstance(exc, Exception):
            exc = WeightSyncError(f"{who}: the {phase} was abandoned", peer=who, phase=phase,
                                  version=version)
        try:
            push(error_msg(exc, seq=seq, version=version, peer=who, phase=phase))
        except Exception:  # the control links may be gone with the peer
            logger.debug("nixl: could not report a failed sync", exc_info=True)
        self.reset_plan()
        if self._arena is not None:
            self._arena.reset()

    def _release(self) -> None:
        self.reset_plan()
        if self._arena is not None:
            self._arena.close()
        self._arena = None
        if self._hub is not None:
            self._hub.close()
        for link in self._links.values():
            link.close()
        self._hub, self._links, self._sources = None, {}, {}
        if self._agent is not None:
            self._agent.close()
        self._agent = None
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)  # its waits are bounded
        self._pool = None
        self._leave()

    def finalize(self) -> None:
        self._release()
        self.close_server()


def _numel(shape: tuple) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def _union(sources: dict[int, SourceMsg], world: int) -> list[tuple[str, tuple, str]]:
    """Every tensor some trainer rank serves, in the order the ranks list them."""
    seen, out = set(), []
    for s in range(world):
        for name, shape, dtype, *_ in sources[s].held:
            if name not in seen:
                seen.add(name)
                out.append((name, tuple(shape), dtype))
    return out

