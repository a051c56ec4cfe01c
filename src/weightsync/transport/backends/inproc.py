"""``inproc``: trainer and rollout in one process (the hybrid / "naive" case).

No buffers and no copies: each ``(name, tensor)`` the trainer yields is handed to every
receiver as is (cast first when ``dtype`` is set), and the trainer waits until every
receiver has moved past it before taking the next one, so views from the trainer's
iterator stay valid while they are read. Sender and receivers may run in one event loop
(``asyncio.gather``) or in different threads.

Lifecycle: ``prepare`` -> ``build_topology`` (a random rendezvous key) ->
``init_process_group`` (join the in-process hub) -> syncs -> ``finalize`` (leave it).
"""

from __future__ import annotations

import asyncio
import secrets
import threading
import time
from typing import Any, AsyncIterator, Optional

import torch

from weightsync.core.errors import PeerFailed, SyncTimeout, VersionMismatch, WeightSyncError
from weightsync.core.remote import normalize_version
from weightsync.transport.tensors import aiter_items, wire_dtype
from weightsync.transport.base import CheckpointEngine, check_topology, per_worker
from weightsync.transport.registry import CheckpointEngineRegistry

__all__ = ["InprocEngine"]

_hubs: dict[str, "_Hub"] = {}
_hubs_lock = threading.Lock()


class _Mailbox:
    """Where one receiver takes items from; items are put from any thread."""

    def __init__(self) -> None:
        self.loop: Optional[asyncio.AbstractEventLoop] = None
        self.queue: Optional[asyncio.Queue] = None
        self.seq = 0
        self.failed: Optional[tuple[int, BaseException]] = None   # (seq, why) of a skipped sync

    def put(self, item: tuple) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:    # the receiver's loop has ended (it left that receive)
            pass


class _Hub:
    def __init__(self, world: int, num_receivers: int) -> None:
        self.world = world
        self.num_receivers = num_receivers
        self.boxes = {r: _Mailbox() for r in range(num_receivers)}
        self.members = 0


class _Ack:
    """Counts receivers done with one item; completes a future in the sender's loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, count: int) -> None:
        self.loop = loop
        self.future = loop.create_future()
        self.count = count
        self.lock = threading.Lock()

    def done(self, error: Optional[BaseException] = None) -> None:
        with self.lock:
            self.count -= 1
            finished = self.count <= 0 or error is not None
        if finished:
            self.loop.call_soon_threadsafe(self._set, error)

    def _set(self, error: Optional[BaseException]) -> None:
        if not self.future.done():
            if error is None:
                self.future.set_result(None)
            else:
                self.future.set_exception(error)


@CheckpointEngineRegistry.register("inproc")
class InprocEngine(CheckpointEngine):
    """Trainer and rollout in one process; zero copies."""

    capabilities = frozenset({"cpu", "cuda", "same_process"})

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._hub: Optional[_Hub] = None
        self._key = ""
        self._rank = -1
        self._seq = 0

    def prepare(self) -> dict[str, Any]:
        return {"role": self.config.role, "pid": __import__("os").getpid()}

    @classmethod
    def build_topology(cls, trainer_world_size: int, rollout_world_size: int,
                       metadata: list[dict[str, Any]]):
        check_topology("inproc", trainer_world_size, rollout_world_size, metadata)
        pids = {m.get("pid") for m in metadata if isinstance(m, dict)}
        if len(pids) > 1:
            raise ValueError(f"inproc needs every worker in one process, got pids {sorted(pids)}")
        common = {"key": secrets.token_hex(16), "world": trainer_world_size,
                  "num_receivers": rollout_world_size}
        return (per_worker([dict(common, role="trainer", rank=i)
                            for i in range(trainer_world_size)]),
                per_worker([dict(common, role="rollout", rank=j)
                            for j in range(rollout_world_size)]))

    def init_process_group(self, *, key: str, role: str, rank: int, world: int,
                           num_receivers: int) -> None:
        if role not in ("trainer", "rollout"):
            raise ValueError(f"role must be 'trainer' or 'rollout', got {role!r}")
        self.finalize()
        with _hubs_lock:
            hub = _hubs.setdefault(key, _Hub(world, num_receivers))
            hub.members += 1
        self._hub, self._key, self._rank, self._seq = hub, key, rank, 0
        self.config.role = role

    def finalize(self) -> None:
        if self._hub is None:
            return
        with _hubs_lock:
            self._hub.members -= 1
            if self._hub.members <= 0:
                _hubs.pop(self._key, None)
        self._hub, self._rank = None, -1

    # -- sender -------------------------------------------------------------------------
    async def _wait_receivers(self, seq: int, version: Any) -> list[_Mailbox]:
        deadline = time.monotonic() + self.config.timeout
        boxes = list(self._hub.boxes.values())
        while any(b.seq != seq for b in boxes):
            failed = [b.failed[1] for b in boxes if b.failed is not None and b.failed[0] == seq]
            if failed:        # a receiver skipped this sync (abort_receive): end it for all
                for b in boxes:
                    if b.seq == seq:
                        b.put(("error", version, f"trainer rank {self._rank}", failed[0], None))
                raise failed[0]
            if time.monotonic() > deadline:
                late = [r for r, b in self._hub.boxes.items() if b.seq != seq]
                raise SyncTimeout(f"rollout ranks {late} never started receiving",
                                  peer=f"rollout rank {late[0]}", phase="send", version=version)
            await asyncio.sleep(0.0005)
        return boxes

    async def _deliver(self, boxes: list[_Mailbox], item: tuple, version: Any) -> None:
        ack = _Ack(asyncio.get_running_loop(), len(boxes))
        for box in boxes:
            box.put(item + (ack,))
        try:
            await asyncio.wait_for(ack.future, self.config.timeout)
        except asyncio.TimeoutError:
            raise SyncTimeout("a receiver did not take the next tensor in time",
                              peer="rollout ranks", phase="send", version=version) from None

    async def send_weights(self, named_tensors: Any, version: Any = None) -> dict[str, Any]:
        version = normalize_version(version)
        if self._hub is None or self.config.role != "trainer":
            raise RuntimeError("inproc: send_weights needs a trainer engine after init_process_group")
        self._seq += 1
        start = time.perf_counter()
        boxes = await self._wait_receivers(self._seq, version)
        count = nbytes = 0
        try:
            async for name, tensor in aiter_items(named_tensors):
                dtype = wire_dtype(tensor, self.config.dtype)
                out = tensor if dtype == tensor.dtype else tensor.to(dtype)
                await self._deliver(boxes, ("item", version, name, out), version)
                count += 1
                nbytes += out.numel() * out.element_size()
            await self._deliver(boxes, ("done", version, self._rank, None), version)
        except BaseException as exc:
            for box in boxes:
                box.put(("error", version, f"trainer rank {self._rank}", exc, None))
            raise
        secs = time.perf_counter() - start
        return {"version": version, "bytes": nbytes, "seconds": secs, "tensors": count,
                "gbps": nbytes / secs / 1e9 if secs else 0.0, "backend": "inproc"}

    # -- receiver -----------------------------------------------------------------------
    def _abort_unread(self, error: BaseException, version: Any) -> None:
        """:meth:`abort_receive`: the trainer ranks waiting for this receiver fail now."""
        if self._hub is None or self.config.role != "rollout":
            raise RuntimeError("inproc: abort_receive needs a rollout engine after "
                               "init_process_group")
        self._seq += 1
        me = f"rollout rank {self._rank}"
        box = self._hub.boxes[self._rank]
        box.failed = (self._seq, PeerFailed(f"{me} failed in receive: {type(error).__name__}: "
                                            f"{error}", peer=me, phase="send", version=version,
                                            origin=me))
        box.seq = -self._seq

    async def receive_weights(self, version: Any = None) -> AsyncIterator[tuple[str, torch.Tensor]]:
        version = normalize_version(version)
        if self._hub is None or self.config.role != "rollout":
            raise RuntimeError("inproc: receive_weights needs a rollout engine after init_process_group")
        self._seq += 1
        box = self._hub.boxes[self._rank]
        box.loop, box.queue = asyncio.get_running_loop(), asyncio.Queue()
        box.seq = self._seq
        remaining, seen, pending = self._hub.world, set(), None
        try:
            while remaining:
                try:
                    kind, ver, name, obj, ack = await asyncio.wait_for(box.queue.get(),
                                                                       self.config.timeout)
                except asyncio.TimeoutError:
                    raise SyncTimeout("no tensor from the trainer in time", peer="trainer ranks",
                                      phase="receive", version=version) from None
                pending = ack
                if kind == "error":
                    raise PeerFailed(f"{name} failed: {type(obj).__name__}: {obj}", peer=name,
                                     phase="receive", version=ver)
                if version is not None and ver != version:
                    raise VersionMismatch(f"expected version {version!r}, trainer sends {ver!r}",
                                          peer="trainer", phase="receive", version=ver)
                if kind == "done":
                    remaining -= 1
                elif name not in seen:
                    seen.add(name)
                    yield name, obj
                pending = None
                ack.done()
        except BaseException as exc:
            if pending is not None:
                err = exc if isinstance(exc, WeightSyncError) else PeerFailed(
                    f"rollout rank {self._rank} stopped: {type(exc).__name__}: {exc}",
                    peer=f"rollout rank {self._rank}", phase="receive", version=version)
                pending.done(err)
            raise
        finally:
            box.seq = -self._seq
