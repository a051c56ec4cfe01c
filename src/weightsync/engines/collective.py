"""``collective``: bucket broadcast over a torch ProcessGroup (gloo on CPU, NCCL on CUDA).

Each trainer rank forms one group with all rollout ranks (itself as rank 0), built
directly from its TCPStore (no ``init_process_group``, so it never touches the caller's
default group). Buckets go out with asynchronous broadcasts from a ring of ``num_slots``
buffers: the trainer fills bucket k+1 while bucket k is on the wire. A receiver posts the
broadcast of a bucket into its own slot only after its consumer released that slot, so no
buffer is overwritten while read. Headers travel through the store, so after the first
sync only bucket indices do.

For CUDA (NCCL): buffers are allocated once, outside the per-sync path; broadcasts run on
NCCL's stream and each receiver waits on the work before handing views to the consumer.
Set ``NCCL_CUMEM_ENABLE=0`` when processes share GPUs with an engine that uses CUDA IPC.
"""

from __future__ import annotations

import datetime
import threading
from typing import Any

import torch
import torch.distributed as dist

from ..errors import SyncTimeout
from ..wire import BucketMsg
from ._bucketed import BucketedEngine
from ._ctlserver import C10dStore
from ._group import StoreGroupMixin
from ._receiver import ReceiverMixin
from .registry import CheckpointEngineRegistry

__all__ = ["CollectiveEngine"]


def _make_group(store: dist.Store, rank: int, size: int, device: torch.device,
                timeout: float, host: str) -> dist.ProcessGroup:
    td = datetime.timedelta(seconds=timeout)
    if device.type == "cuda":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = td
        return dist.ProcessGroupNCCL(store, rank, size, opts)
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = td
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]  # bind to one interface
    return dist.ProcessGroupGloo(store, rank, size, opts)


@CheckpointEngineRegistry.register("collective")
class CollectiveEngine(StoreGroupMixin, ReceiverMixin, BucketedEngine):
    """Multi-host transport: double-buffered broadcasts over gloo or NCCL."""

    capabilities = frozenset({"cpu", "cuda", "same_host", "multi_host"})

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._groups: dict[int, dist.ProcessGroup] = {}
        self._bufs: list[torch.Tensor] = []
        self._rx_bufs: dict[int, list[torch.Tensor]] = {}
        self._free: dict[tuple[int, int], threading.Event] = {}
        self._works: dict[int, Any] = {}

    def init_process_group(self, **kwargs: Any) -> None:
        self._join(**kwargs)
        dev = torch.device(self.config.device)
        size = self._num_receivers + 1
        t = self.config.timeout
        try:
            host = self.config.host
            if self.config.role == "trainer":
                client = self._server.clone()
                self._clients.append(client)
                store = C10dStore(client, self._prefix(self._rank) + "/pg", t)
                self._groups[self._rank] = _make_group(store, 0, size, dev, t, host)
                self._bufs = [self._alloc(dev) for _ in range(self.config.num_slots)]
                return
            for s in range(self._world):
                client = self._clients[s].clone()
                self._clients.append(client)
                store = C10dStore(client, self._prefix(s) + "/pg", t)
                self._groups[s] = _make_group(store, self._rank + 1, size, dev, t, host)
                self._rx_bufs[s] = [self._alloc(dev) for _ in range(self.config.num_slots)]
                for slot in range(self.config.num_slots):
                    ev = threading.Event()
                    ev.set()
                    self._free[(s, slot)] = ev
        except (RuntimeError, dist.DistError) as exc:
            raise SyncTimeout(f"process group did not form: {exc}", phase="init",
                              peer="collective group") from None

    def _alloc(self, dev: torch.device) -> torch.Tensor:
        buf = torch.empty(self.config.bucket_size, dtype=torch.uint8, device=dev)
        if dev.type == "cpu":
            buf.zero_()  # fault the pages in now, not during the first sync
        return buf

    # -- data path ------------------------------------------------------------------------
    def _tx_buffer(self, slot: int) -> torch.Tensor:
        return self._bufs[slot]

    def _tx_publish(self, slot: int, msg: BucketMsg) -> None:
        self._tx_inbox.push_many(self._receiver_boxes(), msg)
        view = self._bufs[slot][: msg.nbytes]
        self._works[slot] = self._groups[self._rank].broadcast(view, 0)

    def _wait_work(self, work: Any, peer: str, version: Any) -> None:
        try:
            work.wait(datetime.timedelta(seconds=self.config.timeout))
        except (RuntimeError, dist.DistError) as exc:
            raise SyncTimeout(f"broadcast did not complete: {exc}", peer=peer,
                              phase="broadcast", version=version) from None

    def _tx_wait_free(self, slot: int, state: Any) -> None:
        work = self._works.pop(slot, None)
        if work is not None:
            self._wait_work(work, "rollout ranks", state.version)

    def _finish_stream(self, state: Any) -> None:
        for slot in list(self._works):
            self._tx_wait_free(slot, state)
        super()._finish_stream(state)

    def _rx_fetch(self, stream: int, msg: BucketMsg) -> torch.Tensor:
        peer = f"trainer rank {stream}"
        free = self._free[(stream, msg.slot)]
        if not free.wait(self.config.timeout):
            raise SyncTimeout(f"consumer did not release slot {msg.slot}", peer="consumer",
                              phase="receive", version=msg.version)
        free.clear()
        buf = self._rx_bufs[stream][msg.slot]
        self._wait_work(self._groups[stream].broadcast(buf[: msg.nbytes], 0), peer,
                        msg.version)
        return buf

    def _rx_release(self, stream: int, msg: BucketMsg) -> None:
        self._free[(stream, msg.slot)].set()

    # -- teardown -------------------------------------------------------------------------
    def _release(self) -> None:
        for work in self._works.values():
            try:
                work.wait(datetime.timedelta(seconds=1))
            except Exception:
                pass
        for pg in self._groups.values():
            shutdown = getattr(pg, "shutdown", None)
            if shutdown is not None:
                try:
                    shutdown()
                except Exception:
                    pass
        self._groups, self._works, self._free = {}, {}, {}
        self._bufs, self._rx_bufs = [], {}
        self._leave()

    def finalize(self) -> None:
        self._release()
        self.close_server()
