"""``connect()``: secure by default (no fixed token: every worker must be given the job's
token, and a wrong one joins nothing), and configured like every other entry point
(``WEIGHTSYNC_TIMEOUT``)."""

import asyncio
import multiprocessing as mp
import secrets
import socket
import threading
import time

import pytest
import torch

import weightsync
from weightsync.core.errors import AuthenticationError, SyncTimeout
from weightsync.transport.control.server import ControlClient, StoreTimeout


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1.0)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _in_thread(fn):
    out = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as exc:  # inspected by the test
            out["exc"] = exc
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


@pytest.mark.timeout(60)
def test_no_token_no_store(monkeypatch):
    """Without ``token=`` or ``WEIGHTSYNC_TOKEN`` nothing is served: a fixed default token
    would let any local user read every worker's secrets and join."""
    monkeypatch.delenv("WEIGHTSYNC_TOKEN", raising=False)
    port = _free_port()
    address = f"127.0.0.1:{port}"
    t, out = _in_thread(lambda: weightsync.connect("shm", role="trainer", address=address,
                                                   timeout=20))
    time.sleep(1.0)
    leaked = None
    try:  # what anybody on this host could do with a token that ships in the source
        c = ControlClient("127.0.0.1", port, b"weightsync-local", 2)
        leaked = c.get("weightsync/shm/meta/trainer/0", 2)
        c.close()
    except (SyncTimeout, PermissionError, ConnectionError, StoreTimeout):
        pass  # nothing listens, or it refuses that token
    assert leaked is None, f"read a worker's secrets without the job's token: {leaked!r}"
    t.join(30)
    assert isinstance(out.get("exc"), ValueError), out
    assert "WEIGHTSYNC_TOKEN" in str(out["exc"])
    assert not _listening(port)
    with pytest.raises(ValueError, match="WEIGHTSYNC_TOKEN"):
        weightsync.connect("shm", role="rollout", address=address, timeout=5)
    with pytest.warns(RuntimeWarning, match="16"), pytest.raises(SyncTimeout):
        weightsync.connect("shm", role="rollout", address=address, timeout=1, token="short")


def _rollout(address, token, q):
    try:
        eng = weightsync.connect("shm", role="rollout", address=address, token=token,
                                 bucket_size=1 << 16)

        async def go():
            return {n: t.clone() async for n, t in eng.receive_weights(version=3)}

        got = asyncio.run(go())
        timeout = eng.config.timeout
        eng.finalize()
        q.put({"got": {k: v.tolist() for k, v in got.items()}, "timeout": timeout})
    except Exception as exc:  # reported to the test
        q.put(repr(exc))


@pytest.mark.timeout(120)
def test_a_wrong_token_is_refused_and_joins_nothing(monkeypatch):
    monkeypatch.setenv("WEIGHTSYNC_TIMEOUT", "40")   # the spawned rollout reads it too
    token = secrets.token_hex(16)
    port = _free_port()
    address = f"127.0.0.1:{port}"
    t, out = _in_thread(lambda: weightsync.connect("shm", role="trainer", address=address,
                                                   token=token, bucket_size=1 << 16))
    deadline = time.monotonic() + 30
    while not _listening(port) and time.monotonic() < deadline:
        time.sleep(0.05)
    for wrong in ("weightsync-local", secrets.token_hex(16)):
        with pytest.raises(AuthenticationError):
            weightsync.connect("shm", role="rollout", address=address, token=wrong,
                               timeout=5)
        with pytest.raises(PermissionError):
            ControlClient("127.0.0.1", port, wrong.encode(), 5)
    # nothing joined: the trainer still waits for its rollout rank
    assert t.is_alive() and not out, out
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_rollout, args=(address, token, q))
    p.start()
    t.join(60)
    eng = out["value"]
    try:
        assert eng.config.timeout == 40.0
        weights = {"a": torch.arange(4.0)}
        asyncio.run(eng.send_weights(weights.items(), version=3))
        res = q.get(timeout=60)
        assert isinstance(res, dict), res
        assert res == {"got": {"a": [0.0, 1.0, 2.0, 3.0]}, "timeout": 40.0}
    finally:
        p.join(30)
        eng.finalize()


@pytest.mark.timeout(60)
def test_connect_reads_weightsync_timeout(monkeypatch):
    monkeypatch.setenv("WEIGHTSYNC_TIMEOUT", "1.5")
    monkeypatch.setenv("WEIGHTSYNC_TOKEN", secrets.token_hex(16))
    address = f"127.0.0.1:{_free_port()}"
    with pytest.raises(SyncTimeout, match=r"within 1\.5s"):
        weightsync.connect("shm", role="trainer", address=address)
    # a keyword still wins over the environment
    with pytest.raises(SyncTimeout, match=r"within 1\.0s"):
        weightsync.connect("shm", role="trainer", address=address, timeout=1)
    monkeypatch.setenv("WEIGHTSYNC_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="WEIGHTSYNC_TIMEOUT"):
        weightsync.connect("shm", role="trainer", address=address)


def test_failed_connect_leaves_no_server(monkeypatch):
    monkeypatch.setenv("WEIGHTSYNC_TOKEN", secrets.token_hex(16))
    port = _free_port()
    with pytest.raises(SyncTimeout):
        weightsync.connect("shm", role="trainer", address=f"127.0.0.1:{port}", timeout=1)
    assert not _listening(port)


@pytest.mark.timeout(60)
def test_the_token_never_crosses_the_wire():
    """Whoever listens on the well-known rendezvous port first (a squatter, before the
    trainer is up) must not learn the token from the workers that connect to it; and
    a server that cannot prove it knows the token is refused."""
    token = secrets.token_hex(16)
    with socket.socket() as lsn:
        lsn.bind(("127.0.0.1", 0))
        lsn.listen(1)
        port = lsn.getsockname()[1]
        seen = {}

        def squat():
            conn, _ = lsn.accept()
            conn.settimeout(5)
            data = b""
            try:
                while len(data) < 4096:
                    chunk = conn.recv(4096)
                    if not chunk:
                        break
                    data += chunk
                    seen["data"] = data
                    if len(data) >= 17:   # a whole first frame: answer "OK" to it
                        conn.sendall(b"\0" + (64).to_bytes(4, "big") + b"x" * 64)
            except OSError:
                pass
            conn.close()
        t = threading.Thread(target=squat, daemon=True)
        t.start()
        with pytest.raises(AuthenticationError):
            weightsync.connect("shm", role="rollout", address=f"127.0.0.1:{port}",
                               token=token, timeout=5)
        t.join(10)
    assert seen.get("data"), "the client sent nothing"
    assert token.encode() not in seen["data"], "the token went to whoever listened"
