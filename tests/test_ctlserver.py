"""The control store: token check, loopback binding, size limits, bounded waits."""

import socket
import struct
import subprocess
import threading
import time

import pytest

import weightsync
from weightsync.transport.control.server import (C10dStore, ControlClient, ControlServer,
                                           StoreTimeout)
from weightsync.core.errors import AuthenticationError

TOKEN = b"s3cret-token"


@pytest.fixture
def server():
    srv = ControlServer("127.0.0.1", TOKEN)
    yield srv
    srv.close()


def test_right_token_works_wrong_token_is_rejected(server):
    c = ControlClient("127.0.0.1", server.port, TOKEN, 5)
    c.set("k", b"v")
    assert c.get("k") == b"v"
    with pytest.raises(PermissionError):
        ControlClient("127.0.0.1", server.port, b"guess", 5)
    # a raw client that skips authentication gets nothing back
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as s:
        s.sendall(struct.pack("!BdII", 3, 1.0, 1, 0) + b"k")   # GET without AUTH
        assert s.recv(5)[:1] == b"\x02"                        # refused, connection closed
        assert s.recv(5) == b""


def test_binds_to_the_configured_interface_only(server):
    out = subprocess.run(["ss", "-ltn"], capture_output=True, text=True).stdout
    lines = [ln for ln in out.splitlines() if f":{server.port} " in ln]
    assert lines and all("127.0.0.1:" in ln for ln in lines), lines


def test_oversized_frames_close_the_connection():
    srv = ControlServer("127.0.0.1", TOKEN, max_value=1024)
    try:
        c = ControlClient("127.0.0.1", srv.port, TOKEN, 5)
        with pytest.raises(ConnectionError):
            c.set("k", b"x" * 2048)
        c2 = ControlClient("127.0.0.1", srv.port, TOKEN, 5)   # the server is still fine
        c2.set("k", b"x" * 1000)
        assert len(c2.get("k")) == 1000
    finally:
        srv.close()


def test_blocking_ops_are_bounded_and_wake_up(server):
    c = ControlClient("127.0.0.1", server.port, TOKEN, 5)
    start = time.monotonic()
    with pytest.raises(StoreTimeout):
        c.queue_pop("q", 0.3)
    with pytest.raises(StoreTimeout):
        c.wait(["never"], 0.3)
    assert time.monotonic() - start < 3
    other = c.clone()
    threading.Timer(0.2, lambda: other.queue_push("q", b"hello")).start()
    assert c.queue_pop("q", 5) == b"hello"
    assert c.add("n", 2) == 2 and c.add("n", 3) == 5
    assert c.check(["n"]) and not c.check(["n", "m"])
    assert c.delete_key("n") and not c.check(["n"])


def test_gloo_rendezvous_through_the_store(server):
    import datetime
    import torch
    import torch.distributed as dist

    out = {}

    def rank(r):
        store = C10dStore(ControlClient("127.0.0.1", server.port, TOKEN, 10), "pg", 10)
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = datetime.timedelta(seconds=10)
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
        pg = dist.ProcessGroupGloo(store, r, 2, opts)
        t = torch.full((3,), float(r + 1))
        pg.broadcast(t, 0).wait()
        out[r] = t.tolist()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    [t.start() for t in threads]
    [t.join(30) for t in threads]
    assert out == {0: [1.0] * 3, 1: [1.0] * 3}


@pytest.mark.timeout(30)
def test_rendezvous_rejects_a_wrong_token():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    srv = ControlServer("127.0.0.1", b"right", port=port)
    try:
        with pytest.raises(AuthenticationError):
            weightsync.connect("shm", role="rollout", address=f"127.0.0.1:{port}",
                               token="wrong", timeout=5)
    finally:
        srv.close()


def test_a_lost_store_is_a_peer_failure_naming_its_host():
    from weightsync.transport.control.store import Inbox
    from weightsync.core.errors import PeerFailed
    from weightsync.core.wire import AckMsg

    srv = ControlServer("127.0.0.1", TOKEN)
    box = Inbox(ControlClient("127.0.0.1", srv.port, TOKEN, 5), "p", "r0", 5,
                host="trainer rank 1")
    ack = AckMsg(seq=1, stream=1, rank=0, index=0)
    box.push("t", ack)
    srv.close()                                  # the trainer's process went away
    with pytest.raises(PeerFailed) as info:
        for _ in range(50):                      # until the client sees the closed socket
            box.push_many(["t", "r1"], ack)
            time.sleep(0.02)
    assert info.value.peer == "trainer rank 1" and "lost the control store" in str(info.value)
    box.close()
