"""Control channel of the bucketed engines: typed messages through a control store.

Every participant of a stream has an *inbox* (a queue in the stream's store). Bucket
headers, acknowledgements and errors are pushed to the inboxes of the peers; a blocking
pop with a timeout waits for the next one. Nothing busy-waits, and every wait is bounded.
The store is :mod:`weightsync.transport.control.server`: bound to one interface, token-checked.
"""

from __future__ import annotations

import logging
import secrets
from typing import Optional

from weightsync.core.errors import AuthenticationError, PeerFailed, SyncTimeout, WireError
from weightsync.core.wire import Message, decode, encode
from weightsync.transport.control.server import ControlClient, ControlServer, StoreTimeout

__all__ = ["Inbox", "connect_store", "host_store", "new_token", "DRAIN_S"]

logger = logging.getLogger(__name__)


def new_token() -> str:
    return secrets.token_hex(16)


def host_store(host: str, timeout: float, token: str) -> ControlClient:
    """Start a control server on a free port of ``host``; returns a client that owns it."""
    server = ControlServer(host, token.encode())
    return ControlClient(host, server.port, token.encode(), timeout, server=server)


def connect_store(host: str, port: int, token: str, timeout: float, *, peer: str,
                  phase: str) -> ControlClient:
    """Connect to a control server; unreachable or refusing becomes a ``WeightSyncError``."""
    try:
        return ControlClient(host, int(port), token.encode(), timeout)
    except SyncTimeout as exc:
        raise SyncTimeout(exc.detail, peer=peer, phase=phase) from None
    except PermissionError as exc:
        raise AuthenticationError(str(exc), peer=peer, phase=phase) from None


#: How long the process hosting a store waits, leaving, for its peers to finish reading it
#: (the ownership agreement, the codec's exchange).
DRAIN_S = 10.0


def close_store(client: Optional[ControlClient]) -> None:
    if client is None:
        return
    client.close()
    if client.server is not None:
        client.server.close()


class Inbox:
    """One participant's view of a stream's store: its own inbox plus push to others.

    Each ``Inbox`` owns a private connection, since a connection blocked in a pop cannot
    serve other calls. Not thread-safe: one thread per ``Inbox``.
    """

    def __init__(self, store: ControlClient, prefix: str, me: str, timeout: float, *,
                 host: str = "the control store's host") -> None:
        self._store = store.clone()
        self._timeout = timeout
        self.prefix = prefix
        self.me = me
        self.host = host        # the peer whose process serves the store ("trainer rank 0")

    def key(self, box: str) -> str:
        return f"{self.prefix}/inbox/{box}"

    def push(self, box: str, msg: Message | bytes) -> None:
        self._push([box], msg if isinstance(msg, bytes) else encode(msg))

    def push_many(self, boxes: list[str], msg: Message) -> None:
        self._push(boxes, encode(msg))

    def _push(self, boxes: list[str], data: bytes) -> None:
        try:
            for box in boxes:
                self._store.queue_push(self.key(box), data)
        except ConnectionError as exc:  # the store went away with the process serving it
            raise PeerFailed(f"lost the control store ({exc})", peer=self.host,
                             phase="control") from None

    def pop(self, *, timeout: Optional[float] = None, peer: str, phase: str,
            version: object = None) -> Message:
        """Next message of my inbox; ``SyncTimeout`` if none comes in time, ``PeerFailed``
        (naming the store's host) if the store goes away."""
        t = self._timeout if timeout is None else timeout
        try:
            raw = self._store.queue_pop(self.key(self.me), t)
        except StoreTimeout:
            raise SyncTimeout(f"no message from {peer} within {t:.1f}s",
                              peer=peer, phase=phase, version=version) from None
        except ConnectionError as exc:  # the store went away with the process serving it
            raise PeerFailed(f"lost the control store while waiting for {peer} ({exc})",
                             peer=self.host, phase=phase, version=version) from None
        try:
            return decode(raw)
        except WireError as exc:
            raise WireError(exc.detail, peer=peer, phase=phase, version=version) from None

    def close(self) -> None:
        if self._store is not None:
            self._store.close()
        self._store = None  # type: ignore[assignment]
