"""A GPU trainer over ``shm`` into CPU receivers: the ring registered as pinned host memory
(asynchronous device-to-host copies), and the wait that keeps a bucket from going out
before those copies land. The GPU tests are skipped without CUDA; the copy-thread ones run
everywhere."""

import asyncio
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from weightsync import CheckpointEngineRegistry
from weightsync.transport.base import worker_kwargs

BUCKET = 4 << 20


def _group(receivers=1, **kw):
    kw = {"bucket_size": BUCKET, "timeout": 30, "device": "cpu", **kw}
    ts = [CheckpointEngineRegistry.new("shm", role="trainer", **kw)]
    rs = [CheckpointEngineRegistry.new("shm", role="rollout", **kw) for _ in range(receivers)]
    tk, rk = type(ts[0]).build_topology(1, receivers, [e.prepare() for e in ts + rs])
    kws = [worker_kwargs(tk, 0)] + [worker_kwargs(rk, j) for j in range(receivers)]
    with ThreadPoolExecutor(len(kws)) as pool:
        for f in [pool.submit(e.init_process_group, **k) for e, k in zip(ts + rs, kws)]:
            f.result(timeout=60)
    return ts, rs


def _run(mutant: bool, steps: int = 3, shared: bool = False, monkeypatch=None) -> list:
    """``shared``: the receiver's tensors live in shared memory, so the trainer copies
    device-to-host straight into them (pushes) instead of into the ring."""
    torch.cuda.init()
    ts, rs = _group()
    trainer, rollout = ts[0], rs[0]
    assert len(trainer._pinned) == trainer.config.num_slots
    if mutant:   # publish without waiting for the device-to-host copies
        trainer._tx_ready = lambda *a, **k: None
        if shared:
            import weightsync.transport.backends.shm.engine as shm_engine
            monkeypatch.setattr(shm_engine, "wait_stream", lambda *a, **k: None)
    n = BUCKET // 4
    params = {f"t{i}": torch.zeros(n, dtype=torch.int32, device="cuda") for i in range(6)}
    dest = {name: torch.full((n,), -1, dtype=torch.int32) for name in params}
    if shared:
        for t in dest.values():
            t.share_memory_()
    bad, pushed = [], []
    try:
        for step in range(steps):
            side = torch.cuda.Stream()
            with torch.cuda.stream(side):   # the update runs behind a long kernel
                for i, p in enumerate(params.values()):
                    torch.cuda._sleep(20_000_000)
                    p.fill_(1000 * step + i)

                async def main():
                    async def recv():
                        async for _ in rollout.receive_into(dest, version=step):
                            pass
                    return await asyncio.gather(
                        trainer.send_weights(list(params.items()), version=step), recv())
                pushed.append(asyncio.run(main())[0]["pushed"])
            if shared:
                assert pushed[-1] == len(params) and trainer._tx_pinned, pushed
            for i, name in enumerate(params):
                if not bool((dest[name] == 1000 * step + i).all()):
                    bad.append((step, name))
    finally:
        for e in ts + rs:
            e.finalize()
    return bad


@pytest.mark.gpu
@pytest.mark.timeout(180)
def test_gpu_trainer_over_pinned_shm_lands_every_byte():
    assert _run(mutant=False) == []


@pytest.mark.gpu
@pytest.mark.timeout(180)
def test_pinned_shm_checks_catch_a_missing_wait():
    assert _run(mutant=True), "no stale bytes without the wait for the device-to-host copies"


@pytest.mark.gpu
@pytest.mark.timeout(180)
def test_gpu_trainer_pushes_into_a_receivers_shared_tensors():
    assert _run(mutant=False, shared=True) == []


@pytest.mark.gpu
@pytest.mark.timeout(180)
def test_push_checks_catch_a_missing_wait(monkeypatch):
    assert _run(mutant=True, shared=True, monkeypatch=monkeypatch), \
        "no stale bytes without the wait for the copies into the receiver's memory"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("cores", [8, 2])
def test_big_bucket_copies_split_over_the_copy_threads_land_exactly(monkeypatch, cores):
    """With 3+ copy threads, and the cores for them, a receiver splits big copies out of
    a bucket (receive_into); every byte lands where it belongs, odd sizes included. Without
    the cores it copies on one thread."""
    import os
    monkeypatch.setattr(os, "cpu_count", lambda: cores)
    monkeypatch.setenv("WEIGHTSYNC_COPY_THREADS", "3")
    monkeypatch.setenv("WEIGHTSYNC_SHM_DIRECT", "0")     # every tensor through the ring
    ts, rs = _group(bucket_size=32 << 20)
    g = torch.Generator().manual_seed(3)
    params = {f"w{i}": torch.randint(-2**31, 2**31 - 1, ((9 << 20) // 4 + 7 * i,),
                                     dtype=torch.int32, generator=g) for i in range(4)}
    params["small"] = torch.arange(100, dtype=torch.int32)
    params["chunked"] = torch.randint(-2**31, 2**31 - 1, ((80 << 20) // 4 + 3,),
                                      dtype=torch.int32, generator=g)   # over 3 buckets
    dest = {n: torch.zeros_like(p) for n, p in params.items()}
    pool = rs[0]._copy_pool
    assert pool is not None
    submitted = []
    real_submit = pool.submit
    monkeypatch.setattr(pool, "submit", lambda *a, **k: (submitted.append(a), real_submit(*a, **k))[1])
    try:
        async def main():
            async def recv():
                async for _ in rs[0].receive_into(dest, version=1):
                    pass
            await asyncio.gather(ts[0].send_weights(list(params.items()), version=1), recv())
        asyncio.run(main())
        assert all(torch.equal(dest[n], p) for n, p in params.items())
        # each big tensor and each big chunk: 3 parts, 2 of them on the pool
        assert len(submitted) >= 2 * (4 + 2) if cores == 8 else submitted == []
    finally:
        for e in ts + rs:
            e.finalize()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("cores, receivers, want", [(16, 1, 16), (16, 2, 8), (64, 1, 16),
                                                    (2, 1, 2), (16, 3, 5)])
def test_receivers_size_their_copy_threads_from_the_hosts_cores(monkeypatch, cores, receivers,
                                                                 want):
    """Unless WEIGHTSYNC_COPY_THREADS is set, a receiver copies on the host's cores shared by
    the receivers (at most 16): the landing copy set the pace of a GPU trainer over shm at
    4 threads on a 16-core host. Set, the variable wins."""
    import os
    monkeypatch.setattr(os, "cpu_count", lambda: cores)
    monkeypatch.delenv("WEIGHTSYNC_COPY_THREADS", raising=False)
    ts, rs = _group(receivers=receivers)
    try:
        assert [r._copy_threads for r in rs] == [want] * receivers
        assert all(r._split == (want >= 3) for r in rs)
    finally:
        for e in ts + rs:
            e.finalize()
    monkeypatch.setenv("WEIGHTSYNC_COPY_THREADS", "3")
    ts, rs = _group(receivers=1)
    try:
        assert rs[0]._copy_threads == 3
    finally:
        for e in ts + rs:
            e.finalize()


@pytest.mark.timeout(60)
def test_a_tensor_bigger_than_a_bucket_is_assembled_in_the_same_buffer_every_sync(monkeypatch):
    """receive_weights without into: a chunked tensor lands in the buffer of the sync before
    (no fresh memory each sync: a CPU receiver paid page faults for every big embedding),
    with the new version's bytes; a changed shape gets a new buffer; finalize drops them."""
    monkeypatch.setenv("WEIGHTSYNC_SHM_DIRECT", "0")
    ts, rs = _group(bucket_size=1 << 20)
    got = []
    try:
        for version, n in ((1, 700_001), (2, 700_001), (3, 600_000)):
            big = torch.arange(n, dtype=torch.int32) * version      # 2.7 MiB: 3 buckets

            async def main():
                seen = {}

                async def recv():
                    async for name, t in rs[0].receive_weights(version=version):
                        seen[name] = (t, t.clone())
                await asyncio.gather(ts[0].send_weights([("big", big)], version=version),
                                     recv())
                return seen
            seen = asyncio.run(main())
            assert torch.equal(seen["big"][1], big)
            got.append(seen["big"][0])
        assert got[1] is got[0] and got[2] is not got[1]
    finally:
        for e in ts + rs:
            e.finalize()
    assert "_rx_staging" not in rs[0].__dict__
