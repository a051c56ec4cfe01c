"""Direct tensors (shm: receivers read the trainer's tensors by cross-memory attach;
collective: a big tensor is broadcast as it is) and ``receive_into`` (the engine writes
straight into the receiver's own tensors)."""

import asyncio
import multiprocessing as mp
import traceback

import pytest
import torch

from weightsync import CheckpointEngineRegistry
from weightsync.transport.base import worker_kwargs
from weightsync.testing import GroupSpec, expected_tensors, make_tensors, run_group, same_bytes

BUCKET = 64 * 1024


def _clean(results):
    for r in results:
        assert "fatal" not in r, r.get("fatal")
        assert not r["errors"], (r["role"], r["rank"], r["errors"])
        if r["role"] == "rollout":
            for step in r["steps"]:
                assert not step["missing"] and not step["dupes"] and not step["bad"], step


ENV = {"shm": "WEIGHTSYNC_SHM_DIRECT_MIN", "collective": "WEIGHTSYNC_COLLECTIVE_DIRECT_MIN"}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("backend", ["shm", "collective"])
@pytest.mark.parametrize("trainers,receivers", [(1, 3), (2, 2)])
def test_direct_tensors_arrive_bit_exact(monkeypatch, backend, trainers, receivers):
    # every tensor of 1 KiB or more skips the buckets (shm: where the kernel allows)
    monkeypatch.setenv(ENV[backend], "1024")
    monkeypatch.setenv("WEIGHTSYNC_SHM_DIRECT", "1")  # also with more receivers than cores
    spec = GroupSpec(backend=backend, trainers=trainers, receivers=receivers, steps=3,
                     engine_kwargs={"bucket_size": BUCKET, "timeout": 60})
    _clean(run_group(spec))


def _into_worker(backend, role, conn, steps):
    try:
        eng = CheckpointEngineRegistry.new(backend, role=role, bucket_size=BUCKET, timeout=60)
        conn.send(eng.prepare())
        eng.init_process_group(**conn.recv())
        loop = asyncio.new_event_loop()
        out = []
        for step in range(steps):
            if role == "trainer":
                loop.run_until_complete(eng.send_weights(
                    make_tensors(step, bucket_size=BUCKET, tiny=20), version=step))
                continue
            out.append(loop.run_until_complete(_receive_into(eng, step)))
        eng.finalize()
        conn.send(out)
    except BaseException:
        conn.send(traceback.format_exc())


async def _receive_into(eng, step):
    want = expected_tensors(step, bucket_size=BUCKET, tiny=20)
    params = {n: torch.zeros_like(t) for n, t in want.items() if t.is_contiguous()}
    params["tiny.0"] = torch.zeros(7)              # wrong shape: yielded as a view instead
    params.pop("big.f32")                          # no destination: staged
    bad, placed = [], 0
    async for name, t in eng.receive_into(params, version=step):
        if not same_bytes(t.clone(), want[name]):
            bad.append(name)
        if name in params and t is params[name]:
            placed += 1
    bad += [n for n, p in params.items() if n != "tiny.0" and not same_bytes(p, want[n])]
    return {"bad": bad, "placed": placed, "fits": len(params) - 1}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", ["shm", "collective"])
@pytest.mark.parametrize("direct_min", ["1024", str(1 << 40)])
def test_receive_into_writes_the_callers_tensors(monkeypatch, backend, direct_min):
    monkeypatch.setenv(ENV[backend], direct_min)
    ctx = mp.get_context("spawn")
    pipes, procs = [], []
    for role in ("trainer", "rollout"):
        a, b = ctx.Pipe()
        p = ctx.Process(target=_into_worker, args=(backend, role, b, 2), daemon=True)
        p.start()
        pipes.append(a)
        procs.append(p)
    try:
        metas = [c.recv() for c in pipes]
        cls = CheckpointEngineRegistry.get(backend)
        tk, rk = cls.build_topology(1, 1, metas)
        pipes[0].send(worker_kwargs(tk, 0))
        pipes[1].send(worker_kwargs(rk, 0))
        results = [c.recv() if c.poll(100) else "no answer" for c in pipes]
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    assert results[0] == [], results[0]
    steps = results[1]
    assert isinstance(steps, list), steps
    for s in steps:
        assert not s["bad"], s["bad"][:5]
        assert s["placed"] == s["fits"]


def test_cma_read_split_over_threads_is_exact():
    import os
    from concurrent.futures import ThreadPoolExecutor

    from weightsync.transport.fastcopy import SPLIT_MIN, cma_available, cma_read
    src = torch.randint(0, 255, (SPLIT_MIN + 12345,), dtype=torch.uint8)
    if not cma_available(os.getpid(), src.data_ptr(), src[:16].numpy().tobytes()):
        pytest.skip("process_vm_readv not permitted here")
    for parts in (1, 2, 3):
        dst = torch.zeros_like(src)
        with ThreadPoolExecutor(max(1, parts - 1)) as pool:
            cma_read(os.getpid(), src.data_ptr(), dst, pool, parts)
        assert torch.equal(dst, src)
