"""weightsync's own control store: a small authenticated TCP key/value + queue server.

Why not ``torch.distributed.TCPStore``: it listens on every interface and lets any client
list and read every key. This server binds to one interface (loopback unless configured),
rejects any connection that does not prove it holds the job token (an HMAC
challenge-response both ways: the token never crosses the wire), bounds every frame
(keys 4 KiB, values ``max_value`` bytes) and every blocking operation (a timeout each).

Frames (big-endian): request ``op:u8 timeout:f64 klen:u32 vlen:u32 key value``; reply
``status:u8 vlen:u32 value``. Values are raw bytes; nothing is unpickled.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import socket
import socketserver
import struct
import threading
import time
from collections import deque
from typing import Optional

from weightsync.core.errors import SyncTimeout, WireError

__all__ = ["ControlServer", "ControlClient", "StoreTimeout", "MAX_VALUE"]

logger = logging.getLogger(__name__)

MAX_KEY = 4096
MAX_VALUE = 64 * 1024 * 1024
_REQ = struct.Struct("!BdII")
_REP = struct.Struct("!BI")
(AUTH, SET, GET, ADD, CHECK, WAIT, DELETE, PUSH, POP, QLEN, CAS, NKEYS) = range(1, 13)
OK, TIMEOUT, ERROR = 0, 1, 2


class StoreTimeout(RuntimeError):
    """A blocking store operation did not complete in time."""


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(min(n - len(buf), 1 << 20))
        if not chunk:
            raise ConnectionError("connection closed")
        buf += chunk
    return bytes(buf)


_NONCE = 32


def _proof(token: bytes, side: bytes, first: bytes, second: bytes) -> bytes:
    """What ``side`` sends to show it holds ``token``: an HMAC of both nonces (each side
    its own label and order, so no answer can be replayed or reflected)."""
    return hmac.new(token, b"weightsync-auth1|" + side + b"|" + first + second,
                    hashlib.sha256).digest()


class _Closed(Exception):
    """The server closed while a request waited (its connection is dropped, not answered)."""


class _State:
    def __init__(self) -> None:
        self.cv = threading.Condition()
        self.kv: dict[str, bytes] = {}
        self.queues: dict[str, deque] = {}
        self.closed = False

    def close(self) -> None:
        """Wake every waiter; each then drops its connection (``_Closed``)."""
        with self.cv:
            self.closed = True
            self.cv.notify_all()

    def _wait(self, ready, timeout: float) -> bool:
        done = self.cv.wait_for(lambda: self.closed or ready(), timeout)
        if self.closed:
            raise _Closed()
        return bool(done)

    def run(self, op: int, key: str, value: bytes, timeout: float) -> tuple[int, bytes]:
        with self.cv:
            if self.closed:
                raise _Closed()
            if op == SET:
                self.kv[key] = value
            elif op == GET:
                if not self._wait(lambda: key in self.kv, timeout):
                    return TIMEOUT, b""
                return OK, self.kv[key]
            elif op == ADD:
                new = int(self.kv.get(key, b"0")) + int(value)
                self.kv[key] = str(new).encode()
                self.cv.notify_all()
                return OK, self.kv[key]
            elif op in (CHECK, WAIT):
                keys = json.loads(value)
                ready = lambda: all(k in self.kv for k in keys)  # noqa: E731
                if op == CHECK:
                    return OK, b"1" if ready() else b"0"
                return (OK, b"") if self._wait(ready, timeout) else (TIMEOUT, b"")
            elif op == DELETE:
                found = self.kv.pop(key, None) is not None or self.queues.pop(key, None) is not None
                return OK, b"1" if found else b"0"
            elif op == PUSH:
                self.queues.setdefault(key, deque()).append(value)
            elif op == POP:
                if not self._wait(lambda: self.queues.get(key), timeout):
                    return TIMEOUT, b""
                return OK, self.queues[key].popleft()
            elif op == QLEN:
                return OK, str(len(self.queues.get(key, ()))).encode()
            elif op == CAS:
                expected, desired = json.loads(value)
                cur = self.kv.get(key)
                if (cur is None and expected == "") or (cur is not None and cur.decode("latin1") == expected):
                    self.kv[key] = desired.encode("latin1")
                    self.cv.notify_all()
                return OK, self.kv.get(key, expected.encode("latin1"))
            elif op == NKEYS:
                return OK, str(len(self.kv)).encode()
            else:
                return ERROR, b"unknown op"
            self.cv.notify_all()
            return OK, b""


class _Handler(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        server: ControlServer = self.server.owner  # type: ignore[attr-defined]
        sock = self.request
        if not server._track(sock):
            return  # the server is closing: this connection is dropped at once
        try:
            self._serve(server, sock)
        finally:
            server._untrack(sock)

    def _serve(self, server: "ControlServer", sock: socket.socket) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            sock.settimeout(server.auth_timeout)
            if not self._authenticate(sock, server):
                sock.sendall(_REP.pack(ERROR, 0))
                logger.warning("control server on %s:%d rejected a client with a wrong token",
                               server.host, server.port)
                return
            sock.sendall(_REP.pack(OK, 0))
            sock.settimeout(None)
            while not server.closed:
                op, timeout, key, value = self._read(sock, server)
                status, out = server.state.run(op, key, value, min(max(timeout, 0.0), 86400.0))
                sock.sendall(_REP.pack(status, len(out)) + out)
        except (ConnectionError, OSError, WireError, ValueError, struct.error, _Closed):
            return

    def _authenticate(self, sock: socket.socket, server: "ControlServer") -> bool:
        """Challenge-response (see :func:`_proof`): prove we hold the token, check the
        client's proof. The token itself never crosses the wire."""
        op, _, _, client_nonce = self._read(sock, server, limit=_NONCE)  # tiny before auth
        if op != AUTH or len(client_nonce) != _NONCE:
            return False
        nonce = os.urandom(_NONCE)
        mine = _proof(server.token, b"server", client_nonce, nonce)
        sock.sendall(_REP.pack(OK, len(nonce) + len(mine)) + nonce + mine)
        op, _, _, theirs = self._read(sock, server, limit=_NONCE)
        return op == AUTH and hmac.compare_digest(
            theirs, _proof(server.token, b"client", nonce, client_nonce))

    @staticmethod
    def _read(sock: socket.socket, server: "ControlServer",
              limit: Optional[int] = None) -> tuple[int, float, str, bytes]:
        op, timeout, klen, vlen = _REQ.unpack(_recv_exact(sock, _REQ.size))
        if klen > (MAX_KEY if limit is None else limit) or \
                vlen > (server.max_value if limit is None else limit):
            raise WireError(f"frame too large (key {klen}, value {vlen} bytes)")
        key = _recv_exact(sock, klen).decode("utf-8")
        return op, timeout, key, _recv_exact(sock, vlen)


class _TCPServer(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True


class ControlServer:
    """Serve one job's control store on ``host`` (a free port unless ``port`` is given)."""

    def __init__(self, host: str, token: bytes, *, port: int = 0,
                 max_value: int = MAX_VALUE, auth_timeout: float = 10.0) -> None:
        if not token:
            raise ValueError("the control server needs a non-empty token")
        self.token, self.max_value, self.auth_timeout = token, max_value, auth_timeout
        self.state, self.closed = _State(), False
        self._conns: set[socket.socket] = set()
        self._conns_lock = threading.Lock()
        self._srv = _TCPServer((host, port), _Handler)
        self._srv.owner = self  # type: ignore[attr-defined]
        self.host, self.port = host, self._srv.server_address[1]
        self._thread = threading.Thread(target=self._srv.serve_forever, kwargs={"poll_interval": 0.05},
                                        name=f"weightsync-ctl-{self.port}", daemon=True)
        self._thread.start()

    def _track(self, sock: socket.socket) -> bool:
        with self._conns_lock:
            if self.closed:
                return False
            self._conns.add(sock)
            return True

    def _untrack(self, sock: socket.socket) -> None:
        with self._conns_lock:
            self._conns.discard(sock)

    def close(self) -> None:
        """Stop serving: no new connection, every client connection closed (a client's
        pending or next call fails at once with ``ConnectionError``), every waiter woken."""
        with self._conns_lock:
            if self.closed:
                return
            self.closed = True
            conns, self._conns = list(self._conns), set()
        for sock in conns:  # first: a woken waiter must find its connection gone
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self.state.close()
        self._srv.shutdown()
        self._srv.server_close()
        self._thread.join(timeout=5)


class ControlClient:
    """One connection to a :class:`ControlServer`; ``clone()`` opens another."""

    def __init__(self, host: str, port: int, token: bytes, timeout: float, *,
                 server: Optional[ControlServer] = None) -> None:
        self.host, self.port, self._token, self._timeout = host, int(port), token, float(timeout)
        self.server = server
        self._lock = threading.Lock()
        deadline = time.monotonic() + self._timeout
        while True:
            try:
                self._sock = socket.create_connection((host, self.port), timeout=min(5.0, self._timeout))
                break
            except OSError as exc:
                if time.monotonic() > deadline:
                    raise SyncTimeout(f"cannot reach the control server at {host}:{port}: {exc}",
                                      phase="connect") from None
                time.sleep(0.05)
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            ok = self._authenticate(token)
        except BaseException:
            self.close()
            raise
        if not ok:
            self.close()
            raise PermissionError(f"control server at {host}:{port} rejected the token, or "
                                  "could not prove it holds it (not this job's server)")

    def _authenticate(self, token: bytes) -> bool:
        """Mutual challenge-response: the server proves it holds the token before this
        client proves it does; neither sends the token (a squatter on the port learns
        nothing it could use)."""
        nonce = os.urandom(_NONCE)
        status, out = self._call(AUTH, "", nonce, self._timeout)
        if status != OK or len(out) != 2 * _NONCE:
            return False
        theirs, proof = out[:_NONCE], out[_NONCE:]
        if not hmac.compare_digest(proof, _proof(token, b"server", nonce, theirs)):
            return False
        status, _ = self._call(AUTH, "", _proof(token, b"client", theirs, nonce), self._timeout)
        return status == OK

    def clone(self) -> "ControlClient":
        return ControlClient(self.host, self.port, self._token, self._timeout)

    def set_timeout(self, seconds: float) -> None:
        self._timeout = float(seconds)

    def _call(self, op: int, key: str, value: bytes, timeout: float) -> tuple[int, bytes]:
        kb = key.encode("utf-8")
        with self._lock:
            self._sock.settimeout(timeout + 10.0)
            try:
                self._sock.sendall(_REQ.pack(op, timeout, len(kb), len(value)) + kb + value)
                status, n = _REP.unpack(_recv_exact(self._sock, _REP.size))
                return status, _recv_exact(self._sock, n)
            except (OSError, ConnectionError, struct.error) as exc:
                raise ConnectionError(f"control connection to {self.host}:{self.port} lost: {exc}") from None

    def _blocking(self, op: int, key: str, value: bytes, timeout: Optional[float]) -> bytes:
        t = self._timeout if timeout is None else timeout
        status, out = self._call(op, key, value, t)
        if status == TIMEOUT:
            raise StoreTimeout(f"timeout after {t:.1f}s waiting for {key or value[:80]!r}")
        if status != OK:
            raise RuntimeError(f"control server error: {out[:200]!r}")
        return out

    def set(self, key: str, value: bytes | str) -> None:
        self._blocking(SET, key, value.encode() if isinstance(value, str) else value, 0)

    def get(self, key: str, timeout: Optional[float] = None) -> bytes:
        return self._blocking(GET, key, b"", timeout)

    def add(self, key: str, amount: int) -> int:
        return int(self._blocking(ADD, key, str(int(amount)).encode(), 0))

    def check(self, keys: list[str]) -> bool:
        return self._blocking(CHECK, "", json.dumps(list(keys)).encode(), 0) == b"1"

    def wait(self, keys: list[str], timeout: Optional[float] = None) -> None:
        self._blocking(WAIT, "", json.dumps(list(keys)).encode(), timeout)

    def delete_key(self, key: str) -> bool:
        return self._blocking(DELETE, key, b"", 0) == b"1"

    def queue_push(self, key: str, value: bytes) -> None:
        self._blocking(PUSH, key, value, 0)

    def queue_pop(self, key: str, timeout: Optional[float] = None) -> bytes:
        return self._blocking(POP, key, b"", timeout)

    def queue_len(self, key: str) -> int:
        return int(self._blocking(QLEN, key, b"", 0))

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        return self._blocking(CAS, key, json.dumps([expected, desired]).encode(), 0)

    def num_keys(self) -> int:
        return int(self._blocking(NKEYS, "", b"", 0))

    def close(self) -> None:
        try:
            self._sock.close()
        except OSError:
            pass

    def abort(self) -> None:
        """Wake a call blocked on this connection in another thread (it fails with
        ``ConnectionError``), then close it: for an owner that gives up on the connection."""
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.close()


class C10dStore:
    """Factory for a ``torch.distributed.Store`` over a :class:`ControlClient` (for gloo/NCCL
    rendezvous), all keys under ``prefix``."""

    def __new__(cls, client: ControlClient, prefix: str, timeout: float):  # type: ignore[misc]
        import datetime

        import torch.distributed as dist

        class _Store(dist.Store):
            def __init__(self) -> None:
                super().__init__()
                self._c, self._p, self._t = client, prefix.rstrip("/") + "/", timeout

            def _k(self, key: str) -> str:
                return self._p + key

            def set(self, key, value):
                self._c.set(self._k(key), value if isinstance(value, (bytes, str)) else bytes(value))

            def get(self, key):
                try:
                    return self._c.get(self._k(key), self._t)
                except StoreTimeout as exc:
                    raise RuntimeError(f"wait timeout: {exc}") from None

            def add(self, key, amount):
                return self._c.add(self._k(key), amount)

            def check(self, keys):
                return self._c.check([self._k(k) for k in keys])

            def wait(self, keys, timeout=None):
                t = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else self._t
                try:
                    self._c.wait([self._k(k) for k in keys], t)
                except StoreTimeout as exc:
                    raise RuntimeError(f"wait timeout: {exc}") from None

            def delete_key(self, key):
                return self._c.delete_key(self._k(key))

            def num_keys(self):
                return self._c.num_keys()

            def compare_set(self, key, expected, desired):
                as_str = lambda v: v.decode("latin1") if isinstance(v, bytes) else v  # noqa: E731
                return self._c.compare_set(self._k(key), as_str(expected), as_str(desired))

        return _Store()
