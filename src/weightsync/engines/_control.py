"""Control channel of the bucketed engines: typed messages through a TCPStore.

Every participant of a stream has an *inbox* (a queue in the stream's store). Bucket
headers, acknowledgements and errors are pushed to the inboxes of the peers; a blocking
pop with a timeout waits for the next one. Nothing busy-waits, and every wait is bounded.
Keys live under a per-job random prefix.
"""

from __future__ import annotations

import datetime
import logging
import os
from typing import Optional

import torch.distributed as dist

from ..errors import SyncTimeout, WireError
from ..wire import Message, decode, encode

__all__ = ["Inbox", "connect_store", "host_store"]

logger = logging.getLogger(__name__)
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")


def _td(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=max(seconds, 0.001))


def host_store(host: str, timeout: float) -> dist.TCPStore:
    """Start a store server on a free port of ``host``."""
    return dist.TCPStore(host, 0, is_master=True, wait_for_workers=False,
                         timeout=_td(timeout), use_libuv=True)


def connect_store(host: str, port: int, timeout: float, *, peer: str, phase: str) -> dist.TCPStore:
    """Connect to a store; an unreachable server becomes ``SyncTimeout`` naming the peer."""
    try:
        return dist.TCPStore(host, int(port), is_master=False, timeout=_td(timeout),
                             use_libuv=True)
    except (RuntimeError, dist.DistError) as exc:
        raise SyncTimeout(f"cannot reach the store at {host}:{port}: {exc}",
                          peer=peer, phase=phase) from None


class Inbox:
    """One participant's view of a stream's store: its own inbox plus push to others.

    Each ``Inbox`` owns a private store client, since a client blocked in a pop cannot
    serve other calls. Not thread-safe: one thread per ``Inbox``.
    """

    def __init__(self, store: dist.TCPStore, prefix: str, me: str, timeout: float) -> None:
        self._store = store.clone()
        self._timeout = timeout
        self._store.set_timeout(_td(timeout))
        self.prefix = prefix
        self.me = me

    def key(self, box: str) -> str:
        return f"{self.prefix}/inbox/{box}"

    def push(self, box: str, msg: Message | bytes) -> None:
        data = msg if isinstance(msg, bytes) else encode(msg)
        self._store.queue_push(self.key(box), data)

    def push_many(self, boxes: list[str], msg: Message) -> None:
        data = encode(msg)
        for box in boxes:
            self._store.queue_push(self.key(box), data)

    def pop(self, *, timeout: Optional[float] = None, peer: str, phase: str,
            version: object = None) -> Message:
        """Next message of my inbox; ``SyncTimeout`` if none comes in time."""
        t = self._timeout if timeout is None else timeout
        if t != self._timeout:
            self._store.set_timeout(_td(t))
        try:
            raw = self._store.queue_pop(self.key(self.me), True)
        except (RuntimeError, dist.DistError) as exc:
            text = str(exc)
            if "timeout" in text.lower():
                raise SyncTimeout(f"no message from {peer} within {t:.1f}s",
                                  peer=peer, phase=phase, version=version) from None
            raise SyncTimeout(f"lost the control connection ({text})", peer=peer,
                              phase=phase, version=version) from None
        finally:
            if t != self._timeout:
                self._store.set_timeout(_td(self._timeout))
        try:
            return decode(raw)
        except WireError as exc:
            raise WireError(exc.detail, peer=peer, phase=phase, version=version) from None

    def clear(self) -> None:
        """Drop stale messages left in my inbox (e.g. after a failed sync)."""
        try:
            self._store.delete_key(self.key(self.me))
        except (RuntimeError, dist.DistError):
            pass

    def close(self) -> None:
        self._store = None  # type: ignore[assignment]
