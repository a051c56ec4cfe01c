import asyncio
import multiprocessing as mp
import secrets
import socket
import time

import pytest
import torch

import weightsync
from weightsync.core.errors import SyncTimeout


@pytest.fixture(autouse=True)
def job_token(monkeypatch):
    """connect() needs the job's token in every process (spawned ones inherit it)."""
    monkeypatch.setenv("WEIGHTSYNC_TOKEN", secrets.token_hex(16))


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rollout(backend, address, q):
    try:
        eng = weightsync.connect(backend, role="rollout", address=address, timeout=30,
                                 bucket_size=1 << 16)

        async def go():
            return {n: t.clone() async for n, t in eng.receive_weights(version=7)}

        got = asyncio.run(go())
        eng.finalize()
        q.put({k: v.tolist() for k, v in got.items()})
    except Exception as exc:  # reported to the test
        q.put(repr(exc))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", ["shm", "collective"])
def test_connect_two_processes(backend):
    address = f"127.0.0.1:{_free_port()}"
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_rollout, args=(backend, address, q))
    p.start()
    eng = weightsync.connect(backend, role="trainer", address=address, timeout=30,
                             bucket_size=1 << 16)
    weights = {"a": torch.arange(6.0).reshape(2, 3), "b": torch.tensor([1, 2], dtype=torch.int8)}
    metrics = asyncio.run(eng.send_weights(weights.items(), version=7))
    assert metrics["tensors"] == 2
    assert q.get(timeout=60) == {k: v.tolist() for k, v in weights.items()}
    p.join(30)
    eng.finalize()


def _delta_rollout(address, q):
    try:
        eng = weightsync.connect("shm", role="rollout", address=address, timeout=30,
                                 bucket_size=1 << 16, delta=True)
        params = {"w": torch.zeros(1 << 16)}

        async def go(v):
            async for _ in eng.receive_into(params, version=v):
                pass
        for v in (1, 2):
            asyncio.run(go(v))
        eng.finalize()
        q.put((eng.backend_name, params["w"].tolist()))
    except Exception as exc:  # reported to the test
        q.put(repr(exc))


@pytest.mark.timeout(120)
def test_connect_with_delta_builds_the_codec_over_the_backend():
    address = f"127.0.0.1:{_free_port()}"
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_delta_rollout, args=(address, q))
    p.start()
    eng = weightsync.connect("shm", role="trainer", address=address, timeout=30,
                             bucket_size=1 << 16, delta=True)
    assert eng.backend_name == "delta+shm"
    w = torch.randn(1 << 16)
    first = asyncio.run(eng.send_weights([("w", w)], version=1))
    w[::1000] += 1.0
    second = asyncio.run(eng.send_weights([("w", w)], version=2))
    got = q.get(timeout=60)
    p.join(30)
    eng.finalize()
    assert got == ("delta+shm", w.tolist())
    assert first["codec"]["mode"] == "dense" and second["codec"]["mode"] == "delta"
    assert second["bytes"] < 0.1 * first["bytes"]


@pytest.mark.timeout(60)
def test_peer_that_never_arrives_times_out():
    address = f"127.0.0.1:{_free_port()}"
    start = time.monotonic()
    with pytest.raises(SyncTimeout, match="rollout/0"):
        weightsync.connect("shm", role="trainer", address=address, timeout=2)
    assert time.monotonic() - start < 20


def test_bad_arguments():
    with pytest.raises(ValueError):
        weightsync.connect("shm", role="boss")
    with pytest.raises(ValueError):
        weightsync.connect("shm", role="rollout", rank=3, rollout_world_size=2)
    with pytest.raises(ValueError):
        weightsync.connect("shm", role="trainer", address="nope")
