"""``nixl``: rollout workers pull what they keep from every trainer rank, with one-sided
NIXL READs on a plan compiled once.

Trainer ranks *serve*: each one keeps the bytes it yields in memory registered with its
NIXL agent once and reused by every sync whose layout is the same. An FSDP2 rank yields
its local ``Shard(0)`` shards as they are (DTensors: no gather); what it holds of each
tensor is an element range of the full tensor. Receivers *pull*: from every trainer
rank's layout (:class:`~weightsync.core.wire.SourceMsg`, sent only when it changes) and
what the receiver keeps, :func:`~weightsync.core.xferplan.compile_plan` computes the reads
once (coalesced, sources balanced where ranks hold the same bytes). A warm sync is
*pipelined*: each trainer rank sends its
:class:`~weightsync.core.wire.PullMsg` before it stages, then a small
:class:`~weightsync.core.wire.StagedMsg` as each staging block is written, and receivers
re-post that block's prepared NIXL transfer at once, so staging and reading overlap; one
:class:`~weightsync.core.wire.PulledMsg` goes back. A layout that changes half way is
published at the end; receivers finish what they started (the rank keeps those blocks
until every receiver reported) and read the version again on the new layout.

Consistent reads: ``send_weights`` returns only once every receiver reported that it has
read all it needs of this version from this rank, so a trainer that updates its weights
right after cannot change bytes a reader still reads (no snapshot is needed for that).
Where a rank serves from (``serve``, :class:`NixlOptions`, ``WEIGHTSYNC_NIXL_SERVE``): ``auto``
(default) serves a contiguous tensor in the wire dtype from its own storage once it came
from the same storage two syncs in a row (parameters, FSDP2 local shards: no copy, no
extra memory), and stages the others (casts, merged LoRA weights, fresh temporaries) into
an arena it owns; ``staging`` copies everything it yields into that arena (one copy;
memory: its share, kept across syncs; the layout, so the plan, is replayed whatever the
export allocates; the arena keeps the version after ``send_weights`` returns, so a joiner
can read it from the trainer while training goes on); ``params`` serves every eligible
tensor from its own storage from the first sync. A rank serving live parameters offers
no join (training moves those bytes on): a joiner reads from a healthy replica instead.

CPU receivers' agents run without NIXL's progress thread (trainers and GPU receivers keep
it): that thread polls UCX without pause, a core per agent, and a receiver progresses its
reads as it polls them anyway; while a joiner may read from a receiver, a poller
progresses its agent.

Receivers land the bytes in the caller's own tensors with ``receive_into`` (no copy), or in
a registered buffer of what they keep (memory: that size, kept across syncs) whose views
are yielded, valid until the next sync. Every wait is bounded; a
peer that goes away is a ``PeerFailed`` naming it; per-sync messages travel on the
token-checked control links, never pickled.

Lifecycle: ``prepare`` (trainers start their control store) -> ``build_topology`` ->
``init_process_group`` (agents, control links) -> syncs -> ``finalize`` (handles,
registrations, agents and sockets released).
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import secrets
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Mapping, Optional

import torch

from weightsync.core.config import option
from weightsync.core.errors import PlanMismatch, SyncTimeout, VersionMismatch, WeightSyncError
from weightsync.core.remote import error_msg, normalize_version, raise_remote, wire_version
from weightsync.core.wire import (ErrorMsg, PulledMsg, PullMsg, SourceMsg, StagedMsg, WantsMsg,
                                  decode, encode)
from weightsync.core.xferplan import Keep, TransferPlan, box_is_run
from weightsync.transport.backends.nixl.agent import (NixlAgent, Poller, mem_type, require_nixl,
                                                    ucx_transports, wait_all)
from weightsync.transport.backends.nixl.layout import Arena, layout_digest
from weightsync.transport.backends.nixl.pull import OWN, PullPlan, plan_key, union_of
from weightsync.transport.base import CheckpointEngine
from weightsync.transport.control.group import StoreGroupMixin
from weightsync.transport.control.links import Link, LinkHub
from weightsync.transport.protocol.receiver import patience
from weightsync.transport.registry import CheckpointEngineRegistry
from weightsync.transport.tensors import aiter_items, resolve_device, wire_dtype

__all__ = ["NixlEngine", "NixlOptions"]

logger = logging.getLogger(__name__)

#: tensors up to this size are staged on the caller's loop (a copy of at most a few
#: microseconds); bigger ones in the engine's thread, so the loop stays free
_INLINE_PUT_BYTES = 64 << 10
_SERVE = ("auto", "staging", "params")
#: how often a receiver's agent without NIXL's progress thread is progressed while a
#: joiner may read from it (connections need the served side to answer)
_LEASE_POLL_S = 0.5e-3


def _serve(raw: str) -> str:
    """``WEIGHTSYNC_NIXL_SERVE`` (any case); another value is a ``ValueError``."""
    mode = raw.strip().lower()
    if mode not in _SERVE:
        raise ValueError(raw)
    return mode


@dataclass(kw_only=True)
class NixlOptions:
    """Options of ``nixl`` beyond :class:`~weightsync.core.config.EngineConfig`.

    Keyword arguments of the engine (``connect("nixl", ..., serve="staging")``) or one
    object (``options=NixlOptions(...)``).
    """

    serve: str = option(
        "NIXL_SERVE", _serve, "auto",
        "Where a trainer rank serves from: \"auto\" (parameters from their own storage, the "
        "rest staged), \"staging\" (copy all into its arena, which keeps the last version "
        "for joiners) or \"params\" (own storage from the first sync).")
    ucx_tls: str = option(
        "NIXL_UCX_TLS", str.strip, "auto",
        "UCX transports, set once per process before its first agent: \"auto\" (shared "
        "memory and TCP on a host without RDMA devices), \"ucx\" (UCX's own choice) or a "
        "UCX_TLS value; an explicit UCX_TLS wins.")

    def __post_init__(self) -> None:
        if self.serve not in _SERVE:
            raise ValueError(f"serve must be one of {_SERVE}, got {self.serve!r}")
        if not isinstance(self.ucx_tls, str) or not self.ucx_tls.strip():
            raise ValueError(f"ucx_tls must be a non-empty str, got {self.ucx_tls!r}")


@CheckpointEngineRegistry.register("nixl")
class NixlEngine(StoreGroupMixin, CheckpointEngine):
    """Point-to-point pull over NIXL (UCX): DRAM->DRAM on CPU, VRAM->VRAM on GPUs."""

    capabilities = frozenset({"cpu", "cuda", "same_host", "multi_host", "shards", "slices",
                              "join"})
    options_cls = NixlOptions
    options: NixlOptions

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        require_nixl()
        self._errors_ahead: dict[int, ErrorMsg] = {}   # receivers' reports of later syncs
        self._serve_mode = self.options.serve
        self._lease_poller: Optional[Poller] = None
        self._seq, self._rank, self._world, self._num_receivers = 0, -1, 0, 0
        self._agent: Optional[NixlAgent] = None
        self._hub: Optional[LinkHub] = None
        self._links: dict[int, Link] = {}
        self._pool: Optional[ThreadPoolExecutor] = None
        self._arena: Optional[Arena] = None
        self._published: Optional[str] = None      # layout digest receivers have
        self._sources: dict[int, SourceMsg] = {}
        self._pull_plan: Optional[PullPlan] = None
        self._plan_key: Optional[tuple] = None
        self._keep_fn: Optional[Callable[[list], Keep]] = None
        # (trainer layouts, the tensors they serve, what is kept of them)
        self._keep: Optional[tuple[tuple, tuple, Keep]] = None
        self.last_plan: Optional[TransferPlan] = None
        self.restarts = 0           # receiver: pipelined pulls begun again on a new layout
        # the version the memory this engine serves joiners from holds (a trainer: its
        # arena; a receiver: where its last pull landed), whether that is complete, and
        # the joiners reading it (lease -> deadline; a lease ended before it was offered
        # is remembered, so a late offer under it is refused)
        self._served_version: Any = None
        self._served = False
        self._leases: dict[str, float] = {}
        self._revoked: collections.deque = collections.deque(maxlen=256)
        self._lease_cv = threading.Condition()
        # joiner: {source: (version, lease seconds)}; the one receive it may do; who the
        # sources are (trainer ranks, or a healthy replica's worker)
        self._joined: Optional[dict[int, tuple[Any, float]]] = None
        self._peers: dict[int, str] = {}
        self._device = torch.device(self.config.device)    # resolved at init (receivers)
        # trainer: what each receiver keeps in part, by rank ({name: boxes}); receiver:
        # what it last told the trainers of that
        self._wants: dict[int, dict[str, tuple]] = {}
        self._wants_new = False         # trainer: boxes changed since the last sync
        self._wants_sent: tuple = ()

    # -- set-up ---------------------------------------------------------------------------
    def _executor(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix=f"weightsync-nixl-{self._rank}")
        return self._pool

    def _init_sender(self) -> None:
        self._agent = NixlAgent(f"ws-{self._token[:16]}-t{self._rank}",
                                ucx_tls=self.options.ucx_tls)
        host, t = self.config.host, self.config.timeout
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._hub = LinkHub(family, (host, 0), self._token, t)
        self._server.set(self._prefix(self._rank) + "/link", json.dumps([host, self._hub.address[1]]))
        self._hub.accept(self._num_receivers, time.monotonic() + t)
        self._arena = Arena(self._agent, self.config.bucket_size, mode=self._serve_mode)
        logger.info("weightsync nixl: trainer rank %d serving over UCX (UCX_TLS=%s)", self._rank,
                    ucx_transports())

    def _reader_agent(self, name: str) -> NixlAgent:
        """A receiver's (or joiner's) agent: without NIXL's progress thread on a CPU
        receiver; a GPU receiver keeps it."""
        return NixlAgent(name, progress_thread=self._device.type == "cuda",
                         ucx_tls=self.options.ucx_tls)

    def _init_receiver(self) -> None:
        self._agent = self._reader_agent(f"ws-{self._token[:16]}-r{self._rank}")
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
        self._plan_key = None

    def keep_slices(self, fn: Optional[Callable[[list], Keep]]) -> None:
        """Receivers: pull only part of some tensors. ``fn`` gets ``[(name, shape, dtype),
        ...]`` of what the trainer ranks serve (whenever that layout changes, in the
        engine's thread, during a receive) and returns a
        :class:`~weightsync.core.xferplan.Keep`; a tensor kept in part is then yielded in
        its full shape with only its kept boxes holding the version's bytes (see
        :func:`~weightsync.transport.tensors.partial_boxes`), except where ``receive_into``
        is given a tensor of its one box's shape (a tensor-parallel worker's own shard):
        the box lands in that tensor, which is yielded. ``None``: every tensor whole."""
        if fn is not None and not callable(fn):
            raise ValueError(f"keep_slices takes a callable or None, got {type(fn).__name__}")
        if self.config.role != "rollout":
            raise RuntimeError("nixl: keep_slices is for rollout engines")
        self._keep_fn, self._keep = fn, None
        self._drop_reads()
        self._plan_key = None

    def _keep_for(self, sources: list) -> Optional[Keep]:
        """What this receiver keeps; the callable runs again only when the tensors served
        (names, shapes, dtypes) change, not when only where they live does."""
        if self._keep_fn is None:
            return None
        digests = tuple(s.digest for s in sources)
        if self._keep is not None and self._keep[0] == digests:
            return self._keep[2]
        union = tuple(union_of(sources))
        if self._keep is None or self._keep[1] != union:
            keep = self._keep_fn(list(union))
            if not isinstance(keep, Keep):
                raise TypeError(f"keep_slices: the callable returned {type(keep).__name__}, "
                                "not a Keep")
        else:
            keep = self._keep[2]
        self._keep = (digests, union, keep)
        return keep

    def _receiver_boxes(self) -> list[str]:
        return [f"r{r}" for r in range(self._num_receivers)]

    # -- trainer --------------------------------------------------------------------------
    async def send_weights(self, named_tensors: Any, version: Any = None) -> dict[str, Any]:
        if self.config.role != "trainer" or self._rank < 0:
            raise RuntimeError("nixl: send_weights needs a trainer engine after init_process_group")
        version = normalize_version(version)
        self._seq += 1
        seq, start = self._seq, time.perf_counter()
        loop = asyncio.get_running_loop()
        pool = self._executor()
        try:
            held = self._errors_ahead.pop(seq, None)
            self._errors_ahead = {k: m for k, m in self._errors_ahead.items() if k > seq}
            if held is not None:              # a receiver skipped this sync, read earlier
                raise_remote(held, phase="send")
            if self._leases:                  # a joiner still reads the last version
                await loop.run_in_executor(pool, self._wait_leases, version)
            self._served = False              # the arena is about to be written
            recut = False
            if self._wants_new:       # the layout changes with it
                self._wants_new = False
                recut = self._arena.set_cuts(self._cuts())
            # warm: receivers start reading each staging block as soon as it is written
            pipelined = self._published is not None and \
                self._published == self._arena.digest and not recut
            self._arena.begin(pipelined)
            if pipelined:
                self._hub_push(PullMsg(version=wire_version(version), seq=seq,
                                       stream=self._rank, digest=self._published,
                                       staged=False))
            count = 0
            async for name, tensor in aiter_items(named_tensors, shards=True):
                dtype = wire_dtype(tensor, self.config.dtype)
                if tensor.device.type == "cpu" and \
                        tensor.numel() * dtype.itemsize <= _INLINE_PUT_BYTES:
                    done = self._arena.put(name, tensor, dtype)   # a hop would cost more
                else:
                    done = await loop.run_in_executor(pool, self._arena.put, name, tensor, dtype)
                if done:
                    self._staged(seq, done)
                count += 1
            staged_s = time.perf_counter() - start
            served = await loop.run_in_executor(pool, self._serve, seq, version, pipelined)
        except BaseException as exc:
            self._abort(seq, version, exc, "send", self._hub_tell_all)
            raise
        self._served_version, self._served = version, True
        seconds = time.perf_counter() - start
        nbytes = sum(served.values())
        gbps = nbytes / seconds / 1e9 if seconds > 0 else 0.0
        logger.info("weightsync nixl: served version %s: %d tensors, %d bytes in %.4f s "
                    "(%.2f GB/s) to %d receivers%s", version, count, nbytes, seconds, gbps,
                    self._num_receivers, " (new layout)" if self._arena.changed else "")
        return {"version": version, "bytes": nbytes, "seconds": seconds, "gbps": gbps,
                "tensors": count, "layout_sent": self._arena.changed, "pipelined": pipelined,
                "stage_seconds": staged_s,
                "held_bytes": self._arena.nbytes, "tensor_bytes": self._arena.tensor_bytes,
                "served": served, "backend": self.backend_name}

    def _cuts(self) -> dict[str, tuple]:
        """Tensors every receiver keeps only in part, with the boxes they keep: the arena
        stages those box by box (each receiver's box is then one read, not one per row)."""
        if self._num_receivers == 0 or len(self._wants) < self._num_receivers:
            return {}
        wants = list(self._wants.values())
        names = set(wants[0]).intersection(*wants[1:])
        return {n: tuple({b for w in wants for b in w[n]}) for n in names}

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

    def _staged(self, seq: int, blocks: list[str]) -> None:
        # A receiver waits only for the blocks it reads from this rank: it may have read
        # them, reported and closed its link while this rank still names blocks others
        # read (its last sync). A closed link is skipped here; _await_pulled then reads
        # the receiver's report (or the end of its stream before one, a PeerFailed).
        if blocks:
            self._hub.push_many(self._receiver_boxes(),
                                StagedMsg(seq=seq, stream=self._rank, blocks=tuple(blocks)),
                                gone_ok=True)

    def _serve(self, seq: int, version: Any, pipelined: bool = False) -> dict[int, int]:
        """Publish the layout if it changed, tell receivers to pull (unless a pipelined
        sync told them already and the layout held), wait until all have."""
        arena = self._arena
        arena.finish()
        if arena.digest != self._published:
            # a new layout (a pipelined sync's readers drop what they started and begin
            # again on it; the blocks they may still read are kept until they are done)
            self._hub_push(SourceMsg(seq=seq, stream=self._rank, agent=self._agent.name,
                                     metadata=self._agent.metadata(), mem=arena.mem,
                                     digest=arena.digest, regions=arena.regions(),
                                     held=arena.held()))
            self._published = arena.digest
            pipelined = False
        if pipelined:      # the layout held: what it serves from its own storage is ready too
            self._staged(seq, [OWN])
        else:
            self._hub_push(PullMsg(version=wire_version(version), seq=seq, stream=self._rank,
                                   digest=arena.digest))
        served = self._await_pulled(seq, version)
        arena.release_deferred()
        return served

    def _await_pulled(self, seq: int, version: Any) -> dict[int, int]:
        served: dict[int, int] = {}
        deadline = time.monotonic() + self.config.timeout
        while len(served) < self._num_receivers:
            left = deadline - time.monotonic()
            missing = sorted(set(range(self._num_receivers)) - set(served))
            if left <= 0:     # those that pulled hold the version (``confirmed``)
                raise SyncTimeout(f"rollout ranks {missing} did not finish pulling",
                                  peer=f"rollout rank {missing[0]}", phase="send",
                                  version=version, confirmed=tuple(served))
            self._hub.expect(set(missing))
            try:
                msg = self._hub.pop(timeout=left, peer=f"rollout rank {missing[0]}",
                                    phase="send", version=version)
                if isinstance(msg, ErrorMsg) and msg.seq == seq:
                    raise_remote(msg, phase="send")
                if isinstance(msg, ErrorMsg) and msg.seq > seq:   # a later sync's, kept
                    self._errors_ahead[msg.seq] = msg
            except WeightSyncError as exc:
                if exc.confirmed is None:
                    exc.confirmed = tuple(served)
                raise
            if isinstance(msg, WantsMsg) and 0 <= msg.rank < self._num_receivers:
                self._wants[msg.rank] = dict(msg.wants)     # staged so from the next sync
                self._wants_new = True
            if isinstance(msg, PulledMsg) and msg.seq == seq:
                served[msg.rank] = msg.nbytes
        return served

    # -- receiver -------------------------------------------------------------------------
    async def receive_weights(self, version: Any = None) -> AsyncIterator[tuple[str, torch.Tensor]]:
        async for item in self._receive(version, None):
            yield item

    async def receive_into(self, params: Mapping[str, torch.Tensor], version: Any = None
                           ) -> AsyncIterator[tuple[str, torch.Tensor]]:
        """Pull straight into ``params`` where a tensor there has the same shape, dtype and
        device and is contiguous (registered once; no copy at all), or, for a tensor kept
        as one box (:meth:`keep_slices`), the shape of that box (a tensor-parallel
        worker's own shard); others land in the landing buffer and are copied into
        ``params[name]`` if present."""
        if not isinstance(params, Mapping):
            raise ValueError(f"params must be a mapping of name -> tensor, got {type(params).__name__}")
        async for item in self._receive(version, params):
            yield item

    async def _receive(self, version: Any, into: Optional[Mapping[str, torch.Tensor]]
                       ) -> AsyncIterator[tuple[str, torch.Tensor]]:
        if self.config.role != "rollout" or self._rank < 0:
            raise RuntimeError("nixl: receive_weights needs a rollout engine after init_process_group")
        version = normalize_version(version)
        self._seq += 1
        loop = asyncio.get_running_loop()
        try:
            views = await loop.run_in_executor(self._executor(), self._pull, version, into)
        except BaseException as exc:
            self._abort(self._seq, version, exc, "receive", self._links_push)
            raise
        for name, tensor in views:
            yield name, tensor

    def _abort_unread(self, error: BaseException, version: Any) -> None:
        """:meth:`abort_receive`: the error of the sync this receiver skips, to every
        trainer rank (each fails at its next look at its links)."""
        if self.config.role != "rollout" or self._rank < 0:
            raise RuntimeError("nixl: abort_receive needs a rollout engine after "
                               "init_process_group")
        self._seq += 1
        self._abort(self._seq, version, error, "receive", self._links_push)

    def _links_push(self, msg: Any) -> None:
        for link in self._links.values():
            try:
                link.push("t", msg)
            except WeightSyncError:
                continue          # that trainer is gone; tell the others

    def _pull(self, version: Any, into: Optional[Mapping[str, torch.Tensor]]
              ) -> list[tuple[str, torch.Tensor]]:
        if self._joined is not None:
            return self._pull_joined(version, into)
        if self._leases:                  # a joiner still reads what the last pull landed
            self._wait_leases(version)
        self._served = False              # this pull overwrites it
        deadline = time.monotonic() + patience(self.config.timeout)
        got = {s: self._await_pull(s, version, deadline) for s in range(self._world)}
        pull = self._ensure_plan(into)
        posted: list = []
        waiting = {s: set(pull.reads_by[s]) for s, m in got.items() if not m.staged}
        for s, by in enumerate(pull.reads_by):
            if s not in waiting:
                for r in by.values():
                    r.post(version=version)
                    posted.append(r)
        changed = []
        for s in sorted(waiting):     # pipelined: each block as soon as the rank wrote it
            while waiting[s]:
                msg = self._await_staged(s, got[s].seq, version, deadline)
                if isinstance(msg, SourceMsg):     # its layout changed while it staged
                    changed.append(s)
                    break
                for group in msg.blocks:
                    if group in waiting[s]:
                        waiting[s].discard(group)
                        r = pull.reads_by[s][group]
                        r.post(version=version)
                        posted.append(r)
        if changed:
            self.restarts += 1
            # finish what was started (the ranks keep those blocks until this receiver
            # reports), then read the version anew on the new layouts
            wait_all(posted, deadline, version=version)
            for s in changed:
                got[s] = self._await_pull(s, version, deadline)
            pull = self._ensure_plan(into)
            for r in pull.reads:
                r.post(version=version)
            posted = pull.reads
        wait_all(posted, deadline, version=version)
        for s, link in self._links.items():
            link.push("t", PulledMsg(seq=got[s].seq, stream=s, rank=self._rank,
                                     nbytes=pull.bytes_from.get(s, 0), plan=pull.plan.digest))
        out = pull.tensors(into)
        self._served_version, self._served = normalize_version(got[0].version), True
        return out

    def _await_staged(self, s: int, seq: int, version: Any, deadline: float) -> Any:
        """The next ``StagedMsg`` of sync ``seq`` from rank ``s``, or its ``SourceMsg`` (the
        layout changed while it staged: kept, the caller starts over)."""
        peer = f"trainer rank {s}"
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise SyncTimeout(f"{peer} never finished writing version {version!r}",
                                  peer=peer, phase="receive", version=version)
            msg = self._links[s].pop(timeout=left, peer=peer, phase="receive", version=version)
            if isinstance(msg, ErrorMsg) and msg.seq >= seq:
                raise_remote(msg, phase="receive")
            if isinstance(msg, StagedMsg) and msg.seq == seq:
                return msg
            if isinstance(msg, SourceMsg) and msg.seq == seq:
                self._sources[s] = msg
                return msg

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
                continue                     # left over from an aborted sync (or staged)
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

    def _ensure_plan(self, into: Optional[Mapping[str, torch.Tensor]]) -> PullPlan:
        sources = [self._sources[s] for s in range(self._world)]
        device = self._device
        keep = self._keep_for(sources)
        key = plan_key(sources, into, device, keep)
        if key == self._plan_key and self._pull_plan is not None:
            return self._pull_plan
        self._drop_reads()
        start = time.perf_counter()
        self._pull_plan = PullPlan(self._agent, f"rollout rank {self._rank}", sources, into,
                                   device, self.config.bucket_size, keep,
                                   peers=self._peers, spread=max(self._rank, 0))
        self._plan_key, self.last_plan = key, self._pull_plan.plan
        self._tell_wants(sources, keep)
        plan = self._pull_plan.plan
        logger.info("weightsync nixl: rollout rank %d compiled a plan in %.3f s: %d reads, "
                    "%d bytes from %d trainer ranks, %d tensors straight into the caller's, "
                    "%d kept in part", self._rank, time.perf_counter() - start, len(plan.reads),
                    plan.total_bytes, self._world, self._pull_plan.direct,
                    self._pull_plan.partial)
        return self._pull_plan

    def _tell_wants(self, sources: list, keep: Optional[Keep]) -> None:
        """Tell every trainer rank the boxes this receiver keeps of the tensors where some
        box it keeps is not contiguous (a row-parallel weight's columns) or that it keeps
        none of, when that changed: where every receiver says so and their boxes partition
        the tensor, trainers stage it box by box, each then one read instead of one per row
        (:func:`~weightsync.core.xferplan.cut_boxes`)."""
        if self._joined is not None:
            return
        wants = ()
        if keep is not None:
            # a tensor kept not at all is listed too (an expert another worker keeps)
            wants = tuple((n, boxes) for n, shape, _ in union_of(sources)
                          if not (boxes := keep.of(n, shape)) or
                          any(not box_is_run(shape, b) for b in boxes))
        if wants != self._wants_sent:
            self._links_push(WantsMsg(rank=self._rank, wants=wants))
            self._wants_sent = wants

    def _drop_reads(self) -> None:
        if getattr(self, "_pull_plan", None) is not None:
            self._pull_plan.release()
        self._pull_plan = None

    # -- elastic joiners --------------------------------------------------------------------
    def join_offer(self, joiner: str, lease_s: float = 60.0,
                   lease: Optional[str] = None) -> dict[str, Any]:
        """Let ``joiner`` (a replica added between syncs) read the version this engine
        holds, for at most ``lease_s`` seconds: the next sync of this engine waits (bounded
        by the lease) before it overwrites that memory; ``join_done`` ends the lease early.

        A trainer rank offers what it served last from its staging arena; it refuses
        when it serves some tensor from its live parameters (``WEIGHTSYNC_NIXL_SERVE=auto``
        / ``params``: those bytes move on with training) or has served nothing yet. A
        receiver (a healthy replica's worker) offers what its last pull landed (its landing
        buffer and the caller's own tensors it pulled into), so a replica can join while
        the trainer ranks are busy; it refuses when it keeps some tensor only in part (a
        tensor-parallel worker) or its last pull did not complete. ``lease``: the caller's
        name for the lease (so it can end a lease whose offer it stopped waiting for;
        an offer under a lease already ended is refused). Returns the offer (JSON-able:
        the layout as a wire ``SourceMsg``, the version, the lease, who serves it) for
        :meth:`join_topology`."""
        role = self.config.role
        if self._rank < 0 or (self._arena is None if role == "trainer" else self._agent is None):
            raise RuntimeError("nixl: join_offer needs an engine after init_process_group")
        if not isinstance(lease_s, (int, float)) or isinstance(lease_s, bool) or \
                not 0 < lease_s <= 3600:
            raise ValueError(f"lease_s must be a number of seconds in (0, 3600], got {lease_s!r}")
        if lease is not None and (not isinstance(lease, str) or not 0 < len(lease) <= 64):
            raise ValueError(f"lease must be a non-empty str of at most 64 characters, "
                             f"got {lease!r}")
        who = f"{role} rank {self._rank}"
        if not self._served or (role != "trainer" and self._pull_plan is None):
            raise WeightSyncError(f"{who} holds no complete version to offer {joiner}",
                                  peer=who, phase="join")
        if role == "trainer":
            if self._arena.serves_live:
                raise WeightSyncError(f"{who} serves tensors from its live parameters "
                                      f"(serve={self._serve_mode!r}): they no "
                                      f"longer hold version {self._served_version!r}, so "
                                      f"{joiner} cannot read it here", peer=who, phase="join",
                                      version=self._served_version)
            stream, mem = self._rank, self._arena.mem
            regions, held, digest = self._arena.regions(), self._arena.held(), self._arena.digest
        else:
            layout = self._pull_plan.served_layout()
            if layout is None:
                raise WeightSyncError(f"{who} keeps some tensors only in part (tensor "
                                      f"parallel): it holds no whole copy to offer {joiner}",
                                      peer=who, phase="join", version=self._served_version)
            stream, mem = 0, mem_type(self._device)
            regions, held = layout
            digest = layout_digest(held, regions)
        lease = lease or secrets.token_hex(8)
        with self._lease_cv:
            if lease in self._revoked or lease in self._leases:
                raise WeightSyncError(f"{who}: the join lease {lease} of {joiner} was already "
                                      "ended or given", peer=who, phase="join",
                                      version=self._served_version)
            self._leases[lease] = time.monotonic() + float(lease_s)
            if not self._agent.progress_thread and self._lease_poller is None:
                # a joiner's connection and reads need this side to answer: progressed
                # until the last lease ends or expires
                self._lease_poller = Poller(self._agent, _LEASE_POLL_S, needed=self._leased)
        src = SourceMsg(seq=self._seq, stream=stream, agent=self._agent.name,
                        metadata=self._agent.metadata(), mem=mem, digest=digest,
                        regions=regions, held=held)
        logger.info("weightsync nixl: %s offers version %s to %s (lease %.0f s)", who,
                    self._served_version, joiner, lease_s)
        return {"rank": stream, "version": wire_version(self._served_version),
                "lease": lease, "lease_s": float(lease_s), "source": encode(src).decode(),
                "peer": who}

    def join_done(self, lease: str) -> bool:
        """End the join lease ``lease`` (the joiner read what it needs, or its caller gave
        up on the offer). False: no such lease was given (it is then remembered as ended,
        so an offer still on its way under it is refused) or it had expired."""
        with self._lease_cv:
            found = self._leases.pop(lease, None) is not None
            if not found:
                self._revoked.append(lease)
            self._lease_cv.notify_all()
        return found

    def _leased(self) -> bool:
        """The lease poller's condition: whether a joiner's lease is open. A poller told
        False ends without another call into the agent, so it is forgotten here, under the
        same lock as a new lease: a lease opened a moment later starts a new poller instead
        of counting on one that is ending."""
        with self._lease_cv:
            now = time.monotonic()
            if any(d > now for d in self._leases.values()):
                return True
            if self._lease_poller is not None and self._lease_poller.is_current():
                self._lease_poller = None
            return False

    def _stop_lease_poller(self) -> None:
        """Stop the lease poller (bounded join) before the agent is written or closed;
        called without ``_lease_cv`` held (the poller takes it)."""
        with self._lease_cv:
            poller, self._lease_poller = self._lease_poller, None
        if poller is not None:
            poller.stop()

    def _wait_leases(self, version: Any) -> None:
        with self._lease_cv:
            while self._leases:
                now = time.monotonic()
                for k in [k for k, d in self._leases.items() if d <= now]:
                    logger.warning("weightsync nixl: %s rank %d: a joiner's lease expired "
                                   "before it said it was done; version %s overwrites it",
                                   self.config.role, self._rank, version)
                    del self._leases[k]
                if self._leases:
                    self._lease_cv.wait(min(self._leases.values()) - now)
        # the poller is between two calls into the agent at most: let it end first
        self._stop_lease_poller()

    @classmethod
    def join_weights(cls, offers: list) -> list[list]:
        """``[[name, shape, dtype], ...]``: the weight set the offers serve together (what
        a joiner will receive), from their layouts alone; the manager checks a joiner
        against it before any byte moves when the trainer ranks are not asked."""
        out, seen = [], {}
        for offer in offers:
            msg = decode(offer["source"])
            if not isinstance(msg, SourceMsg):
                raise PlanMismatch(f"the join offer of {offer.get('peer', '?')} holds no layout",
                                   peer=str(offer.get("peer", "")), phase="join")
            for name, shape, dtype, *_ in msg.held:
                if seen.setdefault(name, (list(shape), dtype)) != (list(shape), dtype):
                    raise PlanMismatch(f"the join offers give {name} two shapes or dtypes",
                                       peer=str(offer.get("peer", "")), phase="join")
                if len(seen) > len(out):
                    out.append([name, list(shape), dtype])
        return out

    @classmethod
    def join_topology(cls, offers: list, rollout_world_size: int) -> list[dict[str, Any]]:
        """The ``init_process_group`` keywords of each of a joining replica's
        ``rollout_world_size`` workers, from the :meth:`join_offer` of every trainer rank
        (or the one offer of a healthy replica's worker): each worker pulls that version
        from there in its next receive (once; it is in no group and takes no further
        sync)."""
        if not isinstance(offers, (list, tuple)) or not offers:
            raise ValueError("join_topology needs one offer per trainer rank, or a replica's")
        ranks = sorted(int(o["rank"]) for o in offers)
        if ranks != list(range(len(offers))):
            raise ValueError(f"join offers must come from trainer ranks 0..{len(offers) - 1}, "
                             f"got {ranks}")
        versions = {json.dumps(o["version"]) for o in offers}
        if len(versions) != 1:
            raise VersionMismatch(f"the offers hold different versions: {sorted(versions)}",
                                  phase="join")
        if isinstance(rollout_world_size, bool) or not isinstance(rollout_world_size, int) or \
                rollout_world_size < 1:
            raise ValueError(f"rollout_world_size must be an int >= 1, got {rollout_world_size!r}")
        ordered = sorted((dict(o) for o in offers), key=lambda o: int(o["rank"]))
        return [{"role": "rollout", "rank": j, "world": len(ordered),
                 "num_receivers": rollout_world_size, "join": ordered}
                for j in range(rollout_world_size)]

    def init_process_group(self, **kwargs: Any) -> None:
        # "cuda" as the device this process is on now, so the caller's tensors there
        # compare equal to it (they land straight in them) and reads name its index
        self._device = resolve_device(self.config.device)
        # a new group: trainers hear the receivers' boxes anew, receivers tell them anew
        self._wants, self._wants_sent = {}, ()
        self._wants_new = True                    # trainers: drop any cuts of before
        if "join" not in kwargs:
            return super().init_process_group(**kwargs)
        self._init_joiner(**kwargs)

    def _init_joiner(self, *, role: str, rank: int, world: int, num_receivers: int,
                     join: list) -> None:
        if role != "rollout" or self.config.role not in (None, "rollout"):
            raise ValueError("only a rollout engine joins from offers")
        if not (isinstance(rank, int) and 0 <= rank < num_receivers) or len(join) != world:
            raise ValueError(f"a join entry needs rank in [0, {num_receivers}) and {world} offers")
        if self._rank >= 0:
            self._release()
        sources, joined, peers = {}, {}, {}
        for s, offer in enumerate(join):
            peers[s] = str(offer.get("peer") or f"trainer rank {s}")
            msg = decode(offer["source"])
            if not isinstance(msg, SourceMsg) or msg.stream != s:
                raise PlanMismatch(f"the join offer of {peers[s]} holds no layout of "
                                   "that rank", peer=peers[s], phase="join")
            sources[s] = msg
            joined[s] = (normalize_version(offer["version"]), float(offer["lease_s"]))
        self.config.role = "rollout"
        self._rank, self._world, self._num_receivers, self._seq = rank, world, num_receivers, 0
        self._errors_ahead = {}
        self._token = secrets.token_hex(16)
        self.reset_plan()
        self._agent = self._reader_agent(f"ws-join-{self._token[:12]}-r{rank}")
        self._sources, self._joined, self._peers = sources, joined, peers
        logger.info("weightsync nixl: rollout rank %d joins version %s from %s", rank,
                    joined[0][0], ", ".join(peers.values()))

    def _pull_joined(self, version: Any, into: Optional[Mapping[str, torch.Tensor]]
                     ) -> list[tuple[str, torch.Tensor]]:
        joined, self._joined = self._joined, {}
        if not joined:
            raise WeightSyncError("a joined nixl engine receives once (the version it was "
                                  "offered); the next sync puts the replica in the group",
                                  peer=f"rollout rank {self._rank}", phase="receive",
                                  version=version)
        offered = joined[0][0]
        if version is not None and offered != version:
            raise VersionMismatch(f"{self._peers.get(0)} offered version {offered!r}, this "
                                  f"receiver expects {version!r}", phase="receive",
                                  version=version)
        # finish well inside the shortest lease (counted from when the offer was made,
        # which was before now), so no source writes what is still being read
        lease = min(t for _, t in joined.values())
        deadline = time.monotonic() + min(patience(self.config.timeout), 0.9 * lease)
        pull = self._ensure_plan(into)
        for r in pull.reads:
            r.post(version=offered)
        wait_all(pull.reads, deadline, version=offered)
        out = pull.tensors(into)
        self._served_version, self._served = offered, True
        return out

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
        self._joined = None
        with self._lease_cv:
            self._leases.clear()
            self._lease_cv.notify_all()
        self._stop_lease_poller()
        self._served = False
        self.reset_plan()
        if self._arena is not None:
            self._arena.close()
        self._arena = None
        if self._hub is not None:
            self._hub.close()
        for link in self._links.values():
            link.close()
        self._hub, self._links, self._sources, self._peers = None, {}, {}, {}
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

