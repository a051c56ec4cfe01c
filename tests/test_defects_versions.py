"""Versions are normalised once, at the API boundary, on both sides of a sync: a sender's
``numpy.int64(3)`` and a receiver's ``V(3)`` (an int subclass) are the same version."""

import asyncio

import numpy as np
import pytest

from weightsync import CheckpointEngineRegistry
from weightsync.core import remote
from weightsync.core.remote import wire_version
from weightsync.testing import GroupSpec, run_group

BUCKET = 64 * 1024


class V(int):
    """An int subclass, as some trainers use for their step counter."""


class S(str):
    pass


def odd_versions(engine, role, rank):
    """Hook: the trainer sends ``numpy.int64(step)``, receivers expect ``V(step)``."""
    if role == "trainer":
        send = engine.send_weights

        async def send_np(named, version=None):
            return await send(named, np.int64(version))
        engine.send_weights = send_np
    else:
        receive = engine.receive_weights

        def receive_v(version=None, **kw):
            return receive(V(version), **kw)
        engine.receive_weights = receive_v


@pytest.mark.parametrize("given,want", [
    (3, 3), (np.int64(3), 3), (np.uint8(7), 7), (np.int32(-2), -2), (V(5), 5),
    ("v1", "v1"), (S("v2"), "v2"), (None, None), (0, 0),
])
def test_normalize_version_accepts_ints_and_strs(given, want):
    got = remote.normalize_version(given)
    assert got == want and type(got) is type(want)


@pytest.mark.parametrize("bad", [True, False, np.bool_(True), 1.5, np.float64(2.0), (1,),
                                 b"3", [3], object()])
def test_normalize_version_refuses_everything_else(bad):
    with pytest.raises(ValueError, match="version"):
        remote.normalize_version(bad)


def test_wire_version_sends_equal_versions_equally():
    assert wire_version(np.int64(3)) == 3 and type(wire_version(np.int64(3))) is int
    assert type(wire_version(V(3))) is int
    assert wire_version(1.5) == "1.5"  # error reports never fail on an odd version


@pytest.fixture(scope="module")
def shm_odd_versions():
    spec = GroupSpec(backend="shm", receivers=2, steps=2, tiny=20,
                     hook="test_defects_versions:odd_versions",
                     engine_kwargs={"bucket_size": BUCKET, "timeout": 30})
    return run_group(spec)


@pytest.mark.timeout(240)
def test_numpy_and_int_subclass_versions_are_equal(shm_odd_versions):
    for r in shm_odd_versions:
        assert "fatal" not in r, r.get("fatal")
        assert not r["errors"], (r["role"], r["errors"])
        assert len(r["steps"]) == 2
    assert [s["version"] for s in shm_odd_versions[0]["steps"]] == [0, 1]


def test_bucketed_sender_reports_the_normalized_version(shm_odd_versions):
    assert all(type(s["version"]) is int for s in shm_odd_versions[0]["steps"])


def _inproc_pair(timeout=5):
    cls = CheckpointEngineRegistry.get("inproc")
    t, r = cls(role="trainer", timeout=timeout), cls(role="rollout", timeout=timeout)
    tk, rk = cls.build_topology(1, 1, [t.prepare(), r.prepare()])
    from weightsync.transport.base import worker_kwargs
    t.init_process_group(**worker_kwargs(tk, 0))
    r.init_process_group(**worker_kwargs(rk, 0))
    return t, r


def test_inproc_versions():
    import torch
    t, r = _inproc_pair()
    items = [("w", torch.ones(3))]

    async def main(sent, expected):
        async def recv():
            return [n async for n, _ in r.receive_weights(expected)]
        return await asyncio.gather(t.send_weights(items, sent), recv())

    try:
        report, names = asyncio.run(main(np.int64(3), V(3)))
        assert names == ["w"] and report["version"] == 3 and type(report["version"]) is int
        with pytest.raises(ValueError, match="version"):
            asyncio.run(t.send_weights(items, 1.5))
        with pytest.raises(ValueError, match="version"):
            asyncio.run(r.receive_weights(True).__anext__())
    finally:
        t.finalize()
        r.finalize()


def test_bucketed_receiver_refuses_a_bad_version_at_once():
    eng = CheckpointEngineRegistry.new("shm", role="rollout", bucket_size=BUCKET)
    with pytest.raises(ValueError, match="version"):
        asyncio.run(eng.receive_weights(version=True).__anext__())
    with pytest.raises(ValueError, match="version"):
        asyncio.run(eng.receive_into({}, version=2.0).__anext__())
