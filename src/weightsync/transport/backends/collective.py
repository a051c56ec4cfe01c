"""``collective``: bucket broadcast over a torch ProcessGroup (gloo on CPU, NCCL on CUDA).

Each trainer rank forms one group with all rollout ranks (itself as rank 0), built
directly from its TCPStore (no ``init_process_group``, so it never touches the caller's
default group). Buckets go out with asynchronous broadcasts from a ring of ``num_slots``
buffers: the trainer fills bucket k+1 while bucket k is on the wire. A receiver posts the
broadcast of a bucket into its own slot only after its consumer released that slot, so no
buffer is overwritten while read. Headers travel on one socket per receiver (set up in
``init_process_group`` through the store), so after the first sync only bucket indices do.
On CPU, a contiguous tensor of at least ``direct_min_bytes`` (:class:`CollectiveOptions`,
8 MiB; 0 turns it off) is broadcast as it is, from the trainer's tensor into the receiver's
(its own tensor with ``receive_into``): no packing or unpacking copy. A CPU receiver
posts the broadcast of the next bucket or direct tensor whose header is already here while
the last one is in flight (up to :data:`RX_AHEAD` at once; items still reach the consumer
in the order sent), so gloo has the next receive waiting when the last one's bytes end.
Waits on gloo block on the operation itself, in slices that look at the control channel
(a peer's reported failure) and the deadline.

CUDA (NCCL), reviewed for streams: slot buffers are allocated once, in
``init_process_group``, from PyTorch's caching allocator (NCCL only reads and writes them;
nothing registers or exports them, so no special allocator is needed). A trainer launches
each broadcast behind the stream that was current when ``send_weights`` was called (where
its bucket copies were queued), and refills a slot only once the broadcast that last read
it completed. A receiver posts a broadcast into a slot behind an event recorded on its
consumer's stream (the one current while it iterates) when the consumer released the slot,
and hands out views only once the broadcast completed (polled, bounded by ``timeout``;
``Work.wait`` on NCCL only orders the calling thread's stream, not the consumer's). NCCL's
own timeout is set longer
than ``timeout`` so that a dead peer becomes ``SyncTimeout`` here (the group is then
aborted) rather than NCCL's watchdog tearing the process down.

``NCCL_CUMEM_ENABLE`` is left as the process has it (it must be set before the process's
first NCCL communicator, so an engine cannot change it safely). These buffers work either
way; vLLM once forced it to 0 for a memory cost of NCCL's cuMem buffers with CUDA graphs,
fixed in NCCL 2.22.3; some colocated frameworks still require 0. Its value is logged when
a group is created. Multiple trainer ranks give a receiver one communicator per trainer,
used concurrently: NCCL runs those only while their kernels fit on the GPU together.

Owns the collective data path; the bucket protocol is :mod:`weightsync.transport.protocol`.
Created by name through ``CheckpointEngineRegistry`` (registered in :mod:`weightsync.transport`).
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import socket
import threading
import time
from contextlib import nullcontext as _nullcontext
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

from weightsync.core.config import option
from weightsync.core.errors import PeerFailed, SyncTimeout, WeightSyncError, WireError
from weightsync.core.wire import AckMsg, BucketMsg, ErrorMsg
from weightsync.transport.protocol.sender import (DIRECT_WINDOW, BucketedEngine, DirectTensors,
                                                 wait_stream)
from weightsync.core.remote import raise_remote
from weightsync.transport.control.links import Link, LinkHub
from weightsync.transport.control.server import C10dStore, StoreTimeout
from weightsync.transport.control.group import StoreGroupMixin
from weightsync.transport.protocol.receiver import Abandoned, ReceiverMixin, patience
from weightsync.transport.registry import CheckpointEngineRegistry
from weightsync.transport.tensors import as_bytes

__all__ = ["CollectiveEngine", "CollectiveOptions", "COLLECTIVE_DIRECT_MIN", "RX_AHEAD"]

logger = logging.getLogger(__name__)
_CAUSE_GRACE_S = 2.0  # how long a broken broadcast waits to learn from whom (see below)
_CHECK_EVERY_S = 0.05  # how often a broadcast's wait looks at the control channel

#: ``direct_min_bytes``'s default: contiguous CPU tensors this big are broadcast as they
#: are, without the bucket copies.
COLLECTIVE_DIRECT_MIN = 8 << 20
#: Broadcasts a CPU receiver has in flight at once (gloo runs a group's operations on two
#: threads): the next one is posted while the last one's bytes arrive.
RX_AHEAD = 2


@dataclass(kw_only=True)
class CollectiveOptions:
    """Options of ``collective`` beyond :class:`~weightsync.core.config.EngineConfig`.

    Keyword arguments of the engine (``connect("collective", ..., direct_min_bytes=0)``)
    or one object (``options=CollectiveOptions(...)``).
    """

    direct_min_bytes: int = option(
        None, int, COLLECTIVE_DIRECT_MIN,
        "On CPU, contiguous tensors of at least this many bytes are broadcast as they are, "
        "without the bucket copies (0: never).")

    def __post_init__(self) -> None:
        n = self.direct_min_bytes
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"direct_min_bytes must be an int >= 0, got {n!r}")


def _wait_at_most(work: Any, seconds: float) -> None:
    """Block on a gloo ``work`` (without the GIL) until it completes or ``seconds`` pass.
    A wait that times out raises inside torch although the work goes on; that is not an
    error here (the caller loops), nor is a failure, which ``work.wait()`` raises once
    ``is_completed()`` says so."""
    try:
        work.wait(datetime.timedelta(seconds=max(seconds, 1e-3)))
    except (RuntimeError, dist.DistError):
        pass


def _drop_later(doomed: list, until: float) -> None:
    """Thread: hold an aborted sync's groups until ``until``, when every operation posted
    on them has ended on its own (each is bounded by its group's timeout), then drop them:
    gloo's destructor then has nothing left to wait out. The wait is in Python, so
    interpreter exit neither waits for this thread (a daemon) nor finds it inside that
    destructor; groups still held then end with the process (NCCL's aborted groups go at
    once: ``until`` is now)."""
    time.sleep(max(0.0, until - time.monotonic()))
    doomed.clear()


def _make_group(store: dist.Store, rank: int, size: int, device: torch.device,
                timeout: float, host: str) -> dist.ProcessGroup:
    td = datetime.timedelta(seconds=timeout)
    if device.type == "cuda":
        logger.debug("NCCL group of %d ranks, NCCL_CUMEM_ENABLE=%s", size,
                     os.environ.get("NCCL_CUMEM_ENABLE", "(unset)"))
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = datetime.timedelta(seconds=2 * timeout + 60)  # ours fires first
        return dist.ProcessGroupNCCL(store, rank, size, opts)
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = td
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]  # bind to one interface
    return dist.ProcessGroupGloo(store, rank, size, opts)


def _connect(pg: dist.ProcessGroup, device: torch.device, timeout: float, peer: str) -> None:
    """One tiny broadcast, bounded: NCCL makes a communicator at its first collective and
    blocks there until every member joins, so it is done here, in init, rather than at the
    first bucket of a sync (where a receiver that fails early would leave the trainer in
    it, and an abort would meet a half-made communicator). On gloo it checks the links."""
    probe = torch.zeros(1, device=device)
    errors: list = []

    def run() -> None:
        try:
            with torch.cuda.device(device) if device.type == "cuda" else _nullcontext():
                pg.broadcast(probe, 0).wait()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
        except BaseException as exc:  # raised below, in the caller's thread
            errors.append(exc)

    t = threading.Thread(target=run, daemon=True, name="weightsync-connect")
    t.start()
    t.join(timeout)
    if t.is_alive() or errors:
        why = f"{type(errors[0]).__name__}: {errors[0]}" if errors else f"not within {timeout:.1f}s"
        raise SyncTimeout(f"the collective group did not connect ({why})", peer=peer,
                          phase="init")


@CheckpointEngineRegistry.register("collective")
class CollectiveEngine(StoreGroupMixin, ReceiverMixin, DirectTensors, BucketedEngine):
    """Multi-host transport: double-buffered broadcasts over gloo or NCCL."""

    capabilities = frozenset({"cpu", "cuda", "same_host", "multi_host"})
    options_cls = CollectiveOptions
    options: CollectiveOptions
    _direct_window = DIRECT_WINDOW

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._groups: dict[int, dist.ProcessGroup] = {}
        self._bufs: list[torch.Tensor] = []
        self._rx_bufs: dict[int, list[torch.Tensor]] = {}
        self._free: dict[tuple[int, int], threading.Event] = {}
        self._works: dict[int, Any] = {}
        self._stores: list[Any] = []
        self._cuda = torch.device(self.config.device).type == "cuda"
        self._released: dict[tuple[int, int], Any] = {}  # slot -> consumer-stream event
        # CPU: tensors at least this big are broadcast as they are (0: never)
        self._direct_min = self.options.direct_min_bytes
        # CPU receivers: broadcasts in flight at once
        self._rx_ahead = 1 if self._cuda else RX_AHEAD
        self._aborted = False
        self._hub: Any = None
        self._links: dict[int, Link] = {}

    def init_process_group(self, **kwargs: Any) -> None:
        self._join(**kwargs)
        self._aborted = False
        dev = torch.device(self.config.device)
        size = self._num_receivers + 1
        t = self.config.timeout
        try:
            host = self.config.host
            if self.config.role == "trainer":
                client = self._server.clone()
                self._clients.append(client)
                store = C10dStore(client, self._prefix(self._rank) + "/pg", t)
                self._stores.append(store)  # pybind trampolines need the Python object alive
                self._groups[self._rank] = _make_group(store, 0, size, dev, t, host)
                _connect(self._groups[self._rank], dev, t, "rollout ranks")
                self._bufs = [self._alloc(dev) for _ in range(self.config.num_slots)]
                self._open_hub(client, host, t)
                return
            for s in range(self._world):
                client = self._clients[s].clone()
                self._clients.append(client)
                store = C10dStore(client, self._prefix(s) + "/pg", t)
                self._stores.append(store)  # pybind trampolines need the Python object alive
                self._groups[s] = _make_group(store, self._rank + 1, size, dev, patience(t),
                                              host)
                _connect(self._groups[s], dev, patience(t), f"trainer rank {s}")
                self._rx_bufs[s] = [self._alloc(dev) for _ in range(self.config.num_slots)]
                for slot in range(self.config.num_slots):
                    ev = threading.Event()
                    ev.set()
                    self._free[(s, slot)] = ev
            for s in range(self._world):
                self._open_link(s, t)
        except WeightSyncError:
            self._abort_groups()
            raise
        except (RuntimeError, dist.DistError) as exc:
            self._abort_groups()
            raise SyncTimeout(f"process group did not form: {exc}", phase="init",
                              peer="collective group") from exc

    # -- control links: per-bucket headers and acks bypass the store ---------------------
    def _open_hub(self, client: Any, host: str, timeout: float) -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._hub = LinkHub(family, (host, 0), self._token, timeout)
        port = self._hub.address[1]
        client.set(self._prefix(self._rank) + "/link", json.dumps([host, port]))
        self._hub.accept(self._num_receivers, time.monotonic() + timeout)

    def _open_link(self, stream: int, timeout: float) -> None:
        peer = f"trainer rank {stream}"
        try:
            raw = self._clients[stream].get(self._prefix(stream) + "/link", timeout)
        except StoreTimeout as exc:
            raise SyncTimeout(f"no control link address from {peer}: {exc}", peer=peer,
                              phase="init") from exc
        except (ConnectionError, OSError) as exc:   # the store went away with its process
            raise PeerFailed(f"lost the store while asking {peer} for its link address: "
                             f"{exc}", peer=peer, phase="init") from exc
        try:
            host, port = json.loads(raw)
            port = int(port)
        except (ValueError, TypeError) as exc:  # malformed (json's errors are ValueErrors)
            raise WireError(f"malformed control link address from {peer}: {exc}",
                            peer=peer, phase="init") from exc
        family = socket.AF_INET6 if ":" in str(host) else socket.AF_INET
        self._links[stream] = Link(family, (str(host), port), self._token, self._rank,
                                   timeout, peer=peer)

    def _alloc(self, dev: torch.device) -> torch.Tensor:
        buf = torch.empty(self.config.bucket_size, dtype=torch.uint8, device=dev)
        if dev.type == "cpu":
            buf.zero_()  # fault the pages in now, not during the first sync
        return buf

    # -- data path ------------------------------------------------------------------------
    def _tx_buffer(self, slot: int) -> torch.Tensor:
        return self._bufs[slot]

    # -- CUDA streams (no-ops on CPU) ----------------------------------------------------
    def _tx_ready(self, slot: int, buf: torch.Tensor, version: Any) -> None:
        """NCCL's broadcast is queued behind the stream the caller packed on (see
        ``_tx_publish``): no host wait, except for a checksum, which reads the bucket on the
        host at once: it waits for that stream, not this thread's (default) one."""
        if self._cuda and self.config.checksum:
            wait_stream(self._tx_copy_stream, self.config.timeout, peer="trainer stream",
                        phase="send", version=version)

    def _tx_publish(self, slot: int, msg: BucketMsg) -> None:
        self._tx_control().push_many(self._receiver_boxes(), msg)
        view = self._bufs[slot][: msg.nbytes]
        pg = self._groups[self._rank]
        if self._cuda:  # NCCL's stream waits for the stream the bucket was packed on
            with torch.cuda.stream(self._tx_copy_stream):
                self._works[slot] = pg.broadcast(view, 0)
        else:
            self._works[slot] = pg.broadcast(view, 0)

    def _wait_work(self, work: Any, version: Any, *, stream: Optional[int] = None,
                   seq: int = 0) -> None:
        """Until the broadcast completed (bounded); then its error, if any, is raised.

        On the trainer (``stream`` None) the control channel is checked meanwhile, so a
        rollout rank that failed and reported it ends the wait at once instead of at the
        timeout (a broadcast never completes without every rank). A receiver (of trainer
        ``stream``, sync ``seq``) waits a little longer than the trainer (``patience``).
        """
        trainer = stream is None
        peer = "rollout ranks" if trainer else f"trainer rank {stream}"
        timeout = self.config.timeout if trainer else patience(self.config.timeout)
        try:
            deadline = time.monotonic() + timeout
            next_check = time.monotonic() + _CHECK_EVERY_S
            delay, cap = 20e-6, 100e-6
            while not work.is_completed():
                now = time.monotonic()
                if now > deadline:
                    self._abort_groups()
                    raise SyncTimeout(f"broadcast did not complete in {timeout:.1f}s",
                                      peer=peer, phase="broadcast", version=version)
                if now >= next_check:
                    if trainer:
                        self._check_receivers(version)
                    elif self._rx_over():
                        self._abort_groups()
                        raise Abandoned("the receive ended", phase="receive", version=version)
                    next_check = now + _CHECK_EVERY_S
                if self._cuda:  # NCCL's wait orders a stream, not this thread: poll
                    time.sleep(delay)
                    delay = min(2 * delay, cap)
                else:           # gloo: sleep on the work itself, woken when it completes
                    _wait_at_most(work, min(next_check, deadline) - now)
            work.wait()  # completed: only surfaces an error the backend recorded
        except WeightSyncError:
            raise
        except (RuntimeError, dist.DistError) as exc:
            self._cause_of_broken_group(stream, seq, version)
            raise SyncTimeout(f"broadcast did not complete: {exc}", peer=peer,
                              phase="broadcast", version=version) from exc

    def _cause_of_broken_group(self, stream: Optional[int], seq: int, version: Any) -> None:
        """A broadcast failed inside the backend: a member of the group went away, but the
        backend does not say which. The control channel tells, usually a moment later (a
        lost link, a peer's report of who failed): raise that if it comes within a grace."""
        deadline = time.monotonic() + _CAUSE_GRACE_S
        while (left := deadline - time.monotonic()) > 0 and not (stream is not None
                                                                  and self._rx_over()):
            if stream is None:
                self._check_receivers(version)
                time.sleep(min(left, 0.02))
                continue
            try:
                msg = self._rx_pump_inbox(stream).pop(timeout=min(left, 0.1), phase="receive",
                                                      peer=f"trainer rank {stream}",
                                                      version=version)
            except SyncTimeout:
                continue   # look at the receive's stop, then wait on
            if isinstance(msg, ErrorMsg) and msg.seq in (seq, 0):
                raise_remote(msg, phase="broadcast")

    def _check_receivers(self, version: Any) -> None:
        """Non-blocking: raise a receiver's reported failure; keep acks for later."""
        ctl = self._tx_control()
        while True:
            try:
                msg = ctl.pop(timeout=0.0, peer="rollout ranks", phase="broadcast",
                              version=version)
            except SyncTimeout:
                return
            if isinstance(msg, ErrorMsg) and msg.seq in (self._seq, 0):
                self._abort_groups()
                raise_remote(msg, phase="broadcast")
            if isinstance(msg, ErrorMsg):
                self._hold_error(msg, self._seq)
            if isinstance(msg, AckMsg):
                self._acks.add((msg.seq, -1 if msg.final else msg.index, msg.rank))

    def _abort_send(self, state: Any, exc: BaseException) -> None:
        super()._abort_send(state, exc)   # first the report, which names who failed
        self._abort_groups()

    def _abort_receive(self, state: Any, exc: BaseException) -> None:
        super()._abort_receive(state, exc)
        self._abort_groups()
        self._rx_ready, self._rx_inflight = {}, {}

    def _abort_unread(self, error: BaseException, version: Any) -> None:
        super()._abort_unread(error, version)
        self._abort_groups()

    def _check_usable(self, version: Any) -> None:
        if self._aborted:   # its broadcasts would wait out the timeout: fail now
            side = "trainer" if self.config.role == "trainer" else "rollout"
            raise WeightSyncError("the collective group was aborted by a failed sync; "
                                  "re-initialize (finalize, prepare, init_process_group)",
                                  peer=f"{side} rank {self._rank}", phase="sync",
                                  version=version)

    def _abort_groups(self) -> None:
        """After a failed sync the groups' broadcasts can no longer pair up: abort them, so
        a peer blocked in one fails now (and reads the report) instead of at its timeout.
        The engine is then re-initialized (finalize, prepare, init), as the manager does."""
        self._aborted = True
        for pg in self._groups.values():
            abort = getattr(pg, "abort", None) or getattr(pg, "_abort", None)
            if abort is not None:
                try:
                    abort()
                except Exception:  # best effort: the group is unusable either way
                    logger.debug("abort of a process group failed", exc_info=True)

    def _tx_wait_free(self, slot: int, state: Any) -> None:
        work = self._works.pop(slot, None)
        if work is not None:
            self._wait_work(work, state.version)

    def _finish_stream(self, state: Any) -> None:
        self._drain_direct(state)
        for slot in list(self._works):
            self._tx_wait_free(slot, state)
        super()._finish_stream(state)

    def _rx_fetch(self, stream: int, msg: BucketMsg) -> torch.Tensor:
        free = self._free[(stream, msg.slot)]
        self._rx_wait(free, self.config.timeout, what=f"slot {msg.slot}", version=msg.version)
        if not self._cuda:      # the slot is free now: post as ahead, then wait for it
            buf, work = self._rx_fetch_post(stream, msg)
            self._rx_complete(stream, msg, work)
            return buf
        free.clear()
        buf = self._rx_bufs[stream][msg.slot]
        released = self._released.pop((stream, msg.slot), None)
        if released is not None:  # NCCL writes only after the consumer's reads of the slot
            torch.cuda.current_stream(buf.device).wait_event(released)
        self._wait_work(self._groups[stream].broadcast(buf[: msg.nbytes], 0), msg.version,
                        stream=stream, seq=msg.seq)
        return buf

    # -- direct tensors (DirectTensors; CPU): broadcast from the trainer's tensor into the
    # receiver's own, no packing or unpacking copy; the header goes first, so every rank
    # posts the broadcasts of one group in the same order ---------------------------------
    def _direct_on(self) -> bool:
        return not self._cuda and self._direct_min > 0 and not self.config.checksum

    def _direct_deliver(self, state: Any, msg: BucketMsg, tensor: torch.Tensor) -> None:
        self._tx_control().push_many(self._receiver_boxes(), msg)
        work = self._groups[self._rank].broadcast(as_bytes(tensor), 0)
        # waited for before we return unless the tensor's bytes outlive the item
        self._await_direct(state, msg, work,
                           lambda w: self._wait_work(w, state.version))

    def _rx_direct(self, stream: int, msg: BucketMsg, aux: int, dest: torch.Tensor) -> None:
        self._rx_complete(stream, msg, self._rx_direct_post(stream, msg, aux, dest))

    # -- CPU receivers post the next broadcast while the last is in flight (the receiver
    # mixin's ``_rx_ahead``): gloo then has the next receive waiting when the bytes of the
    # last end, instead of a round trip through this pump between two broadcasts ---------
    def _rx_direct_post(self, stream: int, msg: BucketMsg, aux: int, dest: torch.Tensor) -> Any:
        return self._groups[stream].broadcast(as_bytes(dest), 0)

    def _rx_fetch_post(self, stream: int, msg: BucketMsg) -> Optional[tuple[torch.Tensor, Any]]:
        free = self._free[(stream, msg.slot)]
        if self._cuda or not free.is_set():
            return None
        free.clear()
        buf = self._rx_bufs[stream][msg.slot]
        return buf, self._groups[stream].broadcast(buf[: msg.nbytes], 0)

    def _rx_complete(self, stream: int, msg: BucketMsg, handle: Any) -> None:
        self._wait_work(handle, msg.version, stream=stream, seq=msg.seq)

    def _rx_release(self, stream: int, msg: BucketMsg) -> None:
        if self._cuda:  # runs in the consumer's thread: its current stream did the reads
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(torch.device(self.config.device)))
            self._released[(stream, msg.slot)] = event
        self._free[(stream, msg.slot)].set()

    # -- teardown -------------------------------------------------------------------------
    def _release(self) -> None:
        self._stop_threads()
        if self._aborted:
            # nothing to drain; gloo's destructor would wait out an op stuck on a peer that
            # never posts its side (up to the group's timeout): the groups go to a daemon
            # thread that drops them once those ops ended on their own (_drop_later)
            doomed = [self._groups, self._works]
            self._groups, self._works = {}, {}
            linger = 0.0 if self._cuda else patience(self.config.timeout) + 1.0
            threading.Thread(target=_drop_later, args=(doomed, time.monotonic() + linger),
                             name="weightsync-drop", daemon=True).start()
        for work in self._works.values():
            try:
                work.wait(datetime.timedelta(seconds=1))
            except Exception:  # teardown goes on; the sync that posted it already failed
                logger.debug("a broadcast failed at teardown", exc_info=True)
        for pg in self._groups.values():
            shutdown = getattr(pg, "shutdown", None)
            if shutdown is not None:
                try:
                    shutdown()
                except Exception:  # teardown goes on: the group is dropped either way
                    logger.warning("shutdown of a process group failed", exc_info=True)
        self._groups, self._works, self._free, self._released = {}, {}, {}, {}
        if self._hub is not None:
            self._hub.close()
        for link in self._links.values():
            link.close()
        self._hub, self._links = None, {}
        self._bufs, self._rx_bufs = [], {}
        self._leave()

    def finalize(self) -> None:
        self._release()
        self.close_server()
