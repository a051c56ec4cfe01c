"""``shm``: trainer and rollout processes on one host, through shared memory.

Each trainer rank owns a ring of ``num_slots`` shared-memory buckets, allocated and
pre-faulted once in ``init_process_group`` and reused by every sync. The trainer fills
bucket k+1 while the rollout ranks copy out of bucket k; a slot is refilled only after
every rollout rank acknowledged the bucket it held, so a buffer is never overwritten
while someone reads it. Rollout ranks get views straight into the shared buckets (the
consumer's copy into its model is the only copy on their side). Waiting is blocking on a
socket, never spinning. Segments are unlinked as soon as all readers mapped them.

Lifecycle (per worker): ``prepare`` (trainers start their control store) ->
``build_topology`` -> ``init_process_group`` (trainers create the ring, rollout ranks map
it) -> any number of ``send_weights``/``receive_weights`` -> ``finalize``.
"""

from __future__ import annotations

import socket
import time
from typing import Any

import torch

from ..errors import SyncTimeout, TopologyError
from ..wire import BucketMsg, HelloMsg
from ._bucketed import BucketedEngine
from ._group import StoreGroupMixin
from ._receiver import ReceiverMixin
from ._shmseg import Segment, sweep_stale
from .registry import CheckpointEngineRegistry

__all__ = ["ShmEngine"]


@CheckpointEngineRegistry.register("shm")
class ShmEngine(StoreGroupMixin, ReceiverMixin, BucketedEngine):
    """Same-host, multi-process transport over shared memory."""

    capabilities = frozenset({"cpu", "same_host"})

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if torch.device(self.config.device).type != "cpu":
            raise ValueError("shm moves CPU tensors; use cuda_ipc or collective for GPUs")
        self._segments: list[Segment] = []
        self._rx_segments: dict[int, list[Segment]] = {}

    @classmethod
    def _check_hosts(cls, metadata: list[dict[str, Any]]) -> None:
        hosts = {m.get("hostname") for m in metadata if isinstance(m, dict)}
        if len(hosts) > 1:
            raise TopologyError(f"shm needs every worker on one host, got {sorted(map(str, hosts))}",
                                phase="build_topology")

    def init_process_group(self, **kwargs: Any) -> None:
        self._join(**kwargs)
        if self.config.role == "trainer":
            self._init_sender()
        else:
            self._init_receiver()

    def _init_sender(self) -> None:
        sweep_stale()
        size, n = self.config.bucket_size, self.config.num_slots
        self._segments = [Segment(Segment.make_name(self._token, self._rank, i), size,
                                  create=True) for i in range(n)]
        hello = HelloMsg(stream=self._rank, rank=0, bucket_size=size, num_slots=n,
                         segments=tuple(s.name for s in self._segments))
        try:
            self._tx_inbox.push_many(self._receiver_boxes(), hello)
            attached = set()
            deadline = time.monotonic() + self.config.timeout
            while len(attached) < self._num_receivers:
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = sorted(set(range(self._num_receivers)) - attached)
                    raise SyncTimeout(f"rollout ranks {missing} did not map the buffers",
                                      peer=f"rollout rank {missing[0]}", phase="init")
                msg = self._tx_inbox.pop(timeout=left, peer="rollout ranks", phase="init")
                if isinstance(msg, HelloMsg):
                    attached.add(msg.rank)
        finally:
            for seg in self._segments:
                seg.unlink()

    def _init_receiver(self) -> None:
        for s in range(self._world):
            msg = self._rx_pop[s].pop(peer=f"trainer rank {s}", phase="init")
            if not isinstance(msg, HelloMsg) or msg.stream != s:
                raise TopologyError(f"expected the buffer layout, got {msg.kind!r}",
                                    peer=f"trainer rank {s}", phase="init")
            if msg.bucket_size != self.config.bucket_size or msg.num_slots != len(msg.segments):
                raise TopologyError(
                    f"trainer uses bucket_size={msg.bucket_size}, this rollout engine "
                    f"{self.config.bucket_size}; configure both sides alike",
                    peer=f"trainer rank {s}", phase="init")
            self._rx_segments[s] = [Segment(name, msg.bucket_size, create=False)
                                    for name in msg.segments]
            self._rx_push[s].push("t", HelloMsg(stream=s, rank=self._rank,
                                                bucket_size=msg.bucket_size,
                                                num_slots=msg.num_slots))

    # -- data path ------------------------------------------------------------------------
    def _tx_buffer(self, slot: int) -> torch.Tensor:
        return self._segments[slot].tensor

    def _tx_publish(self, slot: int, msg: BucketMsg) -> None:
        self._tx_inbox.push_many(self._receiver_boxes(), msg)

    def _tx_wait_free(self, slot: int, state: Any) -> None:
        prev = self._slot_bucket.get(slot)
        if prev is not None:
            self._await_acks(state, final=False, index=prev)

    def _rx_fetch(self, stream: int, msg: BucketMsg) -> torch.Tensor:
        segs = self._rx_segments[stream]
        if msg.slot >= len(segs):
            raise TopologyError(f"slot {msg.slot} does not exist", peer=f"trainer rank {stream}",
                                phase="receive", version=msg.version)
        return segs[msg.slot].tensor

    def _rx_release(self, stream: int, msg: BucketMsg) -> None:
        pass  # the acknowledgement the protocol sends frees the slot

    # -- teardown -------------------------------------------------------------------------
    def _release(self) -> None:
        for seg in self._segments:
            seg.close()
        for segs in self._rx_segments.values():
            for seg in segs:
                seg.close()
        self._segments, self._rx_segments = [], {}
        self._leave()

    def finalize(self) -> None:
        self._release()
        self.close_server()
