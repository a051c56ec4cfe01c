"""Point-to-point control links for the hot path of a sync (bucket headers, acks).

The control store is a hub: every message crosses its server, which runs as Python
threads in the trainer process and competes with the trainer for the GIL. For the
per-bucket (and per-tensor) messages of a sync, each trainer rank instead keeps one
stream socket per receiver (an abstract Unix socket on one host, or TCP on the configured
interface), set up once in ``init_process_group``. The objects here offer the same
``push``/``push_many``/``pop`` interface as :class:`~weightsync.transport.control.store.Inbox`,
so the bucketed protocol runs over them unchanged.

Frames: ``length:u32 aux:u64`` then a JSON message of :mod:`weightsync.core.wire` (``aux`` is
a plain integer side channel, e.g. an address for a cross-memory read). A connection
must open with the job token; nothing is ever unpickled; a closed peer becomes
:class:`~weightsync.core.errors.PeerFailed`, a silent one :class:`~weightsync.core.errors.SyncTimeout`.
"""

from __future__ import annotations

import hmac
import os
import queue
import select
import socket
import struct
import threading
import time
from typing import Any, Optional

from weightsync.core.errors import PeerFailed, SyncTimeout, WireError
from weightsync.core.remote import raise_remote
from weightsync.core.wire import MAX_MESSAGE_BYTES, ErrorMsg, Message, decode, encode

__all__ = ["LinkHub", "Link", "unix_address"]

_DRAIN_READS = 64      # reads of unread bytes a closing trainer drains per link (4 MiB)

_HDR = struct.Struct("!IQ")
_HELLO = struct.Struct("!4s32sI")
_MAGIC = b"WSL1"


def unix_address(token: str, stream: int) -> str:
    """Abstract-namespace Unix socket name of a stream (nothing on disk to clean up)."""
    return f"\0weightsync-{token[:24]}-s{stream}"


def _frame(msg: Message | bytes, aux: int) -> bytes:
    data = msg if isinstance(msg, bytes) else encode(msg)
    return _HDR.pack(len(data), aux) + data


def _recv_exact(sock: socket.socket, n: int, deadline: float) -> bytes:
    """Read ``n`` bytes from a non-blocking socket (select-bounded; never spins)."""
    buf = bytearray()
    while len(buf) < n:
        try:
            chunk = sock.recv(n - len(buf))
        except BlockingIOError:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError from None
            select.select([sock], [], [], left)
            continue
        if not chunk:
            raise ConnectionError("connection closed")
        buf += chunk
    return bytes(buf)


def _send_all(sock: socket.socket, data: bytes, deadline: float) -> None:
    """Write all of ``data`` to a non-blocking socket, bounded by ``deadline``."""
    view = memoryview(data)
    while view:
        try:
            sent = sock.send(view)
        except BlockingIOError:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError from None
            select.select([], [sock], [], left)
            continue
        view = view[sent:]


def _read_frame(sock: socket.socket, deadline: float) -> tuple[bytes, int]:
    length, aux = _HDR.unpack(_recv_exact(sock, _HDR.size, deadline))
    if length > MAX_MESSAGE_BYTES:
        raise WireError(f"control frame of {length} bytes is over the limit")
    return _recv_exact(sock, length, deadline), aux


def _token32(token: str) -> bytes:
    return token.encode()[:32].ljust(32, b"\0")


def _read_message(sock: socket.socket, peer: str, phase: str, version: object,
                  deadline: float) -> tuple[Message, int]:
    """One framed message and its aux value; failures name the peer, phase and version."""
    try:
        data, aux = _read_frame(sock, max(deadline, time.monotonic() + 5.0))
        return decode(data), aux
    except WireError as exc:
        raise WireError(exc.detail, peer=peer, phase=phase, version=version) from None
    except (ConnectionError, OSError, TimeoutError) as exc:
        raise PeerFailed(f"lost the control link to {peer} ({type(exc).__name__})",
                         peer=peer, phase=phase, version=version) from None


class LinkHub:
    """Trainer side: one listening socket, one connection per receiver."""

    def __init__(self, family: int, address: Any, token: str, timeout: float) -> None:
        self._family, self._token, self._timeout = family, _token32(token), timeout
        self._lsock = socket.socket(family, socket.SOCK_STREAM)
        self._lsock.bind(address)
        self._lsock.listen(64)
        self.address = self._lsock.getsockname()
        self._conns: dict[int, socket.socket] = {}
        self._order: list[int] = []
        self._next = 0
        self._closed: set[int] = set()
        self._expect: Optional[set[int]] = None
        self._left: dict[int, list] = {}     # (msg, aux) read off a closed link, not popped
        self.last_aux = 0

    def expect(self, ranks: set[int]) -> None:
        """Ranks whose messages the next ``pop`` still needs: a link that closes after its
        receiver finished (not among them) is dropped quietly, not raised."""
        self._expect = set(ranks)

    def accept(self, num_receivers: int, deadline: float) -> None:
        """Accept (and authenticate) every receiver's connection."""
        while len(self._conns) < num_receivers:
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(set(range(num_receivers)) - set(self._conns))
                raise SyncTimeout(f"rollout ranks {missing} did not connect their control link",
                                  peer=f"rollout rank {missing[0]}", phase="init")
            self._lsock.settimeout(left)
            try:
                conn, _ = self._lsock.accept()
            except socket.timeout:
                continue
            conn.setblocking(False)
            try:
                magic, tok, rank = _HELLO.unpack(_recv_exact(conn, _HELLO.size, deadline))
            except (TimeoutError, ConnectionError, OSError, struct.error):
                conn.close()
                continue
            if magic != _MAGIC or not hmac.compare_digest(tok, self._token) \
                    or not 0 <= rank < num_receivers or rank in self._conns:
                conn.close()  # not one of ours
                continue
            if self._family != socket.AF_UNIX:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._conns[rank] = conn
        self._order = sorted(self._conns)
        self._lsock.close()

    def peer_pid(self, rank: int) -> int:
        """Receiver ``rank``'s process id, from the kernel (Unix sockets only; else 0)."""
        conn = self._conns.get(rank)
        if conn is None or self._family != socket.AF_UNIX:
            return 0
        cred = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        return struct.unpack("3i", cred)[0]

    def push(self, box: str, msg: Message | bytes, aux: int = 0, *,
             gone_ok: bool = False) -> None:
        """Send ``msg`` to receiver ``box`` (``"r<rank>"``). ``gone_ok``: a receiver that
        closed its link (it may have finished the sync and left) is skipped, not raised;
        the caller must then learn from that link's own messages (its report, or the
        end of the stream before it, which ``pop`` raises) whether it finished."""
        self._send(int(box[1:]), _frame(msg, aux), gone_ok)

    def push_many(self, boxes: list[str], msg: Message, aux: int = 0, *,
                  gone_ok: bool = False) -> None:
        """:meth:`push` to each of ``boxes``."""
        frame = _frame(msg, aux)
        for box in boxes:
            self._send(int(box[1:]), frame, gone_ok)

    def _send(self, rank: int, frame: bytes, gone_ok: bool = False) -> None:
        conn = self._conns.get(rank)
        if conn is None:
            raise PeerFailed(f"rollout rank {rank} has no control link", peer=f"rollout rank {rank}",
                             phase="send")
        try:
            _send_all(conn, frame, time.monotonic() + self._timeout)
        except (OSError, TimeoutError) as exc:
            if gone_ok and isinstance(exc, (BrokenPipeError, ConnectionResetError)):
                return      # the peer closed its end: it reads nothing more from this link
            self._raise_last_report(rank, conn)
            raise PeerFailed(f"lost the control link to rollout rank {rank} ({exc})",
                             peer=f"rollout rank {rank}", phase="send") from None

    def _raise_last_report(self, rank: int, conn: socket.socket) -> None:
        """A receiver that failed (``abort_receive``) reports, then closes its link; a push
        that finds the link closed raises that report, which names the failure, rather
        than the closed link (what is left on the link is read, briefly)."""
        deadline = time.monotonic() + 0.5
        while time.monotonic() < deadline:
            try:
                if not select.select([conn], [], [], max(0.0, deadline - time.monotonic()))[0]:
                    return
                data, aux = _read_frame(conn, deadline)
                msg = decode(data)
            except (OSError, TimeoutError, WireError, ValueError):
                return
            if isinstance(msg, ErrorMsg):
                raise_remote(msg, phase="send")
            self._left.setdefault(rank, []).append((msg, aux))   # pop returns it later

    def pop(self, *, timeout: Optional[float] = None, peer: str, phase: str,
            version: object = None) -> Message:
        """Next message from any receiver (fair order); ``last_aux`` holds its aux."""
        t = self._timeout if timeout is None else timeout
        deadline = time.monotonic() + t
        expect, self._expect = self._expect, None
        while True:
            for rank in [r for r in self._order if self._left.get(r)]:
                msg, self.last_aux = self._left[rank].pop(0)   # read by a failed push
                return msg
            order = [r for r in self._order if r not in self._closed]
            left = deadline - time.monotonic()
            if not order:
                raise SyncTimeout(f"no message from {peer} within {t:.1f}s", peer=peer,
                                  phase=phase, version=version)
            socks = [self._conns[r] for r in order]
            ready, _, _ = select.select(socks, [], [], max(left, 0.0))
            if not ready:
                if left <= 0:  # a zero timeout still looks once (non-blocking check)
                    raise SyncTimeout(f"no message from {peer} within {t:.1f}s", peer=peer,
                                      phase=phase, version=version)
                continue
            n = len(socks)
            i = next(j % n for j in range(self._next, self._next + n) if socks[j % n] in ready)
            self._next = i + 1
            rank = order[i]
            try:
                return self._read(socks[i], f"rollout rank {rank}", phase, version, deadline)
            except PeerFailed:
                if expect is not None and rank not in expect:
                    self._closed.add(rank)  # finished and gone: not an error
                    continue
                raise

    def _read(self, sock: socket.socket, peer: str, phase: str, version: object,
              deadline: float) -> Message:
        msg, self.last_aux = _read_message(sock, peer, phase, version, deadline)
        return msg

    def close(self) -> None:
        """Close every link. Each is shut for writing and its unread bytes drained first:
        closing a TCP socket with unread bytes sends a reset, which can discard the last
        report this side sent (why a sync failed) before its receiver reads it."""
        for conn in self._conns.values():
            try:
                conn.shutdown(socket.SHUT_WR)
                for _ in range(_DRAIN_READS):     # bounded: a peer that keeps writing
                    if not conn.recv(1 << 16):    # cannot hold the close (non-blocking)
                        break
            except OSError:          # nothing (more) to read now, or already gone
                pass
        for conn in list(self._conns.values()) + [self._lsock]:
            try:
                conn.close()
            except OSError:
                pass
        self._conns = {}


class Link:
    """Receiver side of one stream: ``push("t", ...)`` to the trainer, ``pop`` from it.

    ``push`` to the receiver's own box (``"r<rank>"``) queues locally and wakes ``pop``
    (used to stop the receiver's own pump). ``push`` is thread-safe; ``pop`` is for one
    thread.
    """

    def __init__(self, family: int, address: Any, token: str, rank: int, timeout: float,
                 *, peer: str) -> None:
        self._timeout, self._peer = timeout, peer
        deadline = time.monotonic() + timeout
        while True:
            sock = socket.socket(family, socket.SOCK_STREAM)
            try:
                sock.settimeout(max(0.1, deadline - time.monotonic()))
                sock.connect(address)
                break
            except OSError as exc:
                sock.close()
                if time.monotonic() >= deadline:
                    raise SyncTimeout(f"cannot open the control link ({exc})", peer=peer,
                                      phase="init") from None
                time.sleep(0.02)
        if family != socket.AF_UNIX:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setblocking(False)
        _send_all(sock, _HELLO.pack(_MAGIC, _token32(token), rank), deadline + 1.0)
        self._sock = sock
        self._lock = threading.Lock()
        self._local: "queue.Queue[Message]" = queue.Queue()
        self._wake_r, self._wake_w = os.pipe()
        self.last_aux = 0

    def peer_pid(self) -> int:
        """The trainer's process id, from the kernel (Unix sockets only; else 0)."""
        if self._sock.family != socket.AF_UNIX:
            return 0
        cred = self._sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                     struct.calcsize("3i"))
        return struct.unpack("3i", cred)[0]

    def push(self, box: str, msg: Message | bytes, aux: int = 0) -> None:
        if box != "t":
            self._local.put(msg if isinstance(msg, Message) else decode(msg))
            os.write(self._wake_w, b"x")
            return
        frame = _frame(msg, aux)
        with self._lock:
            try:
                _send_all(self._sock, frame, time.monotonic() + self._timeout)
            except (OSError, TimeoutError) as exc:
                raise PeerFailed(f"lost the control link to {self._peer} ({exc})",
                                 peer=self._peer, phase="receive") from None

    def pop(self, *, timeout: Optional[float] = None, peer: str, phase: str,
            version: object = None) -> Message:
        t = self._timeout if timeout is None else timeout
        deadline = time.monotonic() + t
        while True:
            try:
                msg = self._local.get_nowait()
                os.read(self._wake_r, 1)
                return msg
            except queue.Empty:
                pass
            left = deadline - time.monotonic()
            ready, _, _ = select.select([self._sock, self._wake_r], [], [], max(left, 0.0))
            if self._sock in ready and self._wake_r not in ready:
                break
            if not ready and left <= 0:  # a zero timeout still looks once (non-blocking)
                raise SyncTimeout(f"no message from {peer} within {t:.1f}s", peer=peer,
                                  phase=phase, version=version)
        msg, self.last_aux = _read_message(self._sock, peer, phase, version, deadline)
        return msg

    def close(self) -> None:
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass
        try:
            self._sock.close()
        except OSError:
            pass
