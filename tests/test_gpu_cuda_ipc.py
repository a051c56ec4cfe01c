"""cuda_ipc on a real GPU: the conformance scenarios (every whitelisted dtype, fp8 and bf16
included) with trainer tensors on CUDA, both data paths (ring buckets, and zero-copy for
parameters sent again), and races that corrupt data if a stream wait is missing. Skipped
without CUDA."""

import multiprocessing as mp
import traceback

import pytest
import torch

from weightsync import CheckpointEngineRegistry
from weightsync.transport.base import worker_kwargs
from weightsync.testing import GroupSpec, run_group
from syncchecks import assert_clean

pytestmark = pytest.mark.gpu
BUCKET = 64 * 1024


def _spec(**kw):
    engine_kwargs = {"bucket_size": BUCKET, "timeout": 60, "device": "cuda",
                     **kw.pop("engine_kwargs", {})}
    return GroupSpec(backend="cuda_ipc", device="cuda", engine_kwargs=engine_kwargs, **kw)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("zero_copy", [False, True])
@pytest.mark.parametrize("receivers", [1, 3])
def test_one_trainer_many_receivers(receivers, zero_copy):
    spec = _spec(receivers=receivers, steps=3, tiny=1500,
                 engine_kwargs={"zero_copy": zero_copy})
    results = run_group(spec)
    assert_clean(results, spec)
    trainer = results[0]["steps"]
    assert trainer[0]["buckets_with_layout"] == trainer[0]["buckets"] >= 1
    assert trainer[1]["buckets_with_layout"] == trainer[2]["buckets_with_layout"] == 0
    assert all(s["ref_tensors"] == 0 for s in trainer)   # fresh tensors: the ring


@pytest.mark.timeout(300)
@pytest.mark.parametrize("zero_copy", [False, True])
@pytest.mark.parametrize("pattern", ["full", "disjoint"])
def test_two_trainers(pattern, zero_copy):
    spec = _spec(trainers=2, receivers=2, steps=3, pattern=pattern,
                 engine_kwargs={"zero_copy": zero_copy})
    assert_clean(run_group(spec), spec)


@pytest.mark.timeout(300)
def test_dtype_cast_to_bf16():
    spec = _spec(receivers=2, steps=2, engine_kwargs={"dtype": torch.bfloat16,
                                                      "zero_copy": True})
    assert_clean(run_group(spec), spec)


@pytest.mark.timeout(300)
def test_version_mismatch_is_an_error_not_wrong_weights():
    spec = _spec(receivers=2, steps=1, expect_version_offset=1000,
                 engine_kwargs={"timeout": 20})
    results = run_group(spec)
    assert any(e.startswith("VersionMismatch") for r in results for e in r.get("errors", []))
    for r in results:
        assert r.get("errors"), r


# -- races: a slow producer or a slow consumer ------------------------------------------
# Both sides work on non-default streams behind long kernels; if a stream wait were
# missing, a receiver would read a bucket before the trainer's copy landed, or the trainer
# would refill a slot the consumer has not read yet. The mutant runs drop every wait of
# the engine and must show that corruption (the race checks can fail).
SCENARIOS = {"slow_producer": (16_000_000, 4_000_000), "slow_consumer": (0, 16_000_000)}
RACE_TENSORS = 8


def _sleep(cycles):
    if cycles:
        torch.cuda._sleep(cycles)


async def _race_trainer(engine, zero_copy, cycles, kept=False, steps=3):
    n = BUCKET // 4  # each tensor fills a whole bucket with its own value
    params = {f"t{i}": torch.zeros(n, dtype=torch.int32, device="cuda")
              for i in range(RACE_TENSORS)}

    def fresh(step):
        for i in range(RACE_TENSORS):
            _sleep(cycles)
            yield f"t{i}", torch.full((n,), 1000 * step + i, dtype=torch.int32, device="cuda")

    held = []
    with torch.cuda.stream(torch.cuda.Stream()):
        for step in range(steps):
            if zero_copy or kept:  # an in-place update behind a slow kernel, then send the
                # parameters themselves (by reference, or, kept, through fill programs)
                for i, p in enumerate(params.values()):
                    _sleep(cycles)
                    p.fill_(1000 * step + i)
                out = await engine.send_weights(list(params.items()), version=step)
            else:
                out = await engine.send_weights(fresh(step), version=step)
            held.append(out.get("fill_graph_tensors", 0))
    graphs = [getattr(run, "graph", None) is not None
              for _, run in engine.__dict__.get("_fill_progs", {}).values()]
    return {"held": held, "graphs": graphs}


async def _race_rollout(engine, cycles, into=False, steps=3):
    """Returns the corrupt (step, name) pairs; with ``into`` (``receive_into``, whose
    copies the engine replays: a CUDA graph from the second sync on) also each replayed
    program's (runs, graph captured)."""
    bad = []
    n = BUCKET // 4
    dests = {f"t{i}": torch.zeros(n, dtype=torch.int32, device="cuda")
             for i in range(RACE_TENSORS)}
    with torch.cuda.stream(torch.cuda.Stream()):
        for step in range(steps):
            kept = {}
            stream = engine.receive_into(dests, version=step) if into else \
                engine.receive_weights(version=step)
            async for name, t in stream:
                _sleep(cycles)   # the next bucket's copies queue behind this kernel
                kept[name] = t.clone()
            torch.cuda.current_stream().synchronize()
            for name, t in list(kept.items()) + (list(dests.items()) if into else []):
                if not bool((t == 1000 * step + int(name[1:])).all()):
                    bad.append((step, name))
    if not into:
        return bad
    progs = engine.__dict__.get("_rx_progs", {}).values()
    return bad, sorted((p.runs, getattr(p.runner, "graph", None) is not None) for p in progs)


def _race_worker(role, zero_copy, mutant, scenario, conn, kept=False, into=False, steps=3):
    import asyncio
    try:
        engine = CheckpointEngineRegistry.new(
            "cuda_ipc", role=role, bucket_size=BUCKET, timeout=60, device="cuda",
            num_slots=2, zero_copy=zero_copy)
        if mutant:  # drop every wait of the engine (streams and events)
            engine._sync = lambda *a, **k: None
            engine._wait_event = lambda *a, **k: None
        conn.send(engine.prepare())
        engine.init_process_group(**conn.recv())
        prod, cons = SCENARIOS[scenario]
        job = _race_trainer(engine, zero_copy, prod, kept, steps) \
            if role == "trainer" else _race_rollout(engine, cons, into, steps)
        conn.send({"bad": asyncio.run(job)})
        engine.finalize()
    except BaseException:
        conn.send({"fatal": traceback.format_exc()})


def _run_race(zero_copy, scenario, mutant=False, kept=False, into=False, steps=3):
    ctx = mp.get_context("spawn")
    pipes, procs = [], []
    for role in ("trainer", "rollout"):
        parent, child = ctx.Pipe()
        p = ctx.Process(target=_race_worker,
                        args=(role, zero_copy, mutant, scenario, child, kept, into, steps),
                        daemon=True)
        p.start()
        pipes.append(parent)
        procs.append(p)
    try:
        metas = []
        for c in pipes:
            assert c.poll(120), "no prepare() result"
            metas.append(c.recv())
        tk, rk = CheckpointEngineRegistry.get("cuda_ipc").build_topology(1, 1, metas)
        pipes[0].send(worker_kwargs(tk, 0))
        pipes[1].send(worker_kwargs(rk, 0))
        out = []
        for c in pipes:
            assert c.poll(180), "worker sent no result"
            out.append(c.recv())
        return out
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
@pytest.mark.parametrize("zero_copy", [False, True])
def test_slow_streams_never_corrupt(zero_copy, scenario):
    trainer, rollout = _run_race(zero_copy, scenario)
    assert "fatal" not in trainer and "fatal" not in rollout, (trainer, rollout)
    assert rollout["bad"] == []


@pytest.mark.timeout(300)
@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
@pytest.mark.parametrize("zero_copy,kept", [(False, False), (False, True), (True, False)])
def test_slow_streams_never_corrupt_replayed_copies_into_the_callers_tensors(scenario,
                                                                            zero_copy, kept):
    """``receive_into``: each bucket's copies are a program, queued one by one at the first
    sync, captured as a CUDA graph at the second and replayed at the third; the bytes stay
    right behind slow kernels on either side."""
    steps = 4 if zero_copy else 3
    trainer, rollout = _run_race(zero_copy, scenario, kept=kept, into=True, steps=steps)
    assert "fatal" not in trainer and "fatal" not in rollout, (trainer, rollout)
    bad, progs = rollout["bad"]
    assert bad == []
    # one program per bucket (ring) or batch (zero-copy, from the second sync: batches
    # grow), each used at every sync since
    if zero_copy:
        progs = [p for p in progs if p[0] > 1]      # the first sync's ring programs
    assert progs == [(3, True)] * (4 if zero_copy else RACE_TENSORS), progs


@pytest.mark.timeout(300)
@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
@pytest.mark.parametrize("into", [False, True])
def test_slow_streams_never_corrupt_fill_programs(scenario, into):
    """Parameters updated in place behind slow kernels and sent again fill their slots
    through programs (graphs in ``GRAPH_BRANCHES`` chains from their second use); the
    bytes stay right whatever side is slow."""
    trainer, rollout = _run_race(False, scenario, kept=True, into=into, steps=4)
    assert "fatal" not in trainer and "fatal" not in rollout, (trainer, rollout)
    bad = rollout["bad"][0] if into else rollout["bad"]
    assert bad == []
    held, graphs = trainer["bad"]["held"], trainer["bad"]["graphs"]
    assert held[0] == 0 and all(h == RACE_TENSORS for h in held[1:]), held
    assert graphs and all(graphs), graphs     # captured at the third sync, replayed at the 4th


@pytest.mark.timeout(300)
@pytest.mark.parametrize("zero_copy,scenario", [
    (False, "slow_producer"), (False, "slow_consumer"), (True, "slow_producer"),
    (False, "slow_consumer-kept"), (False, "slow_producer-kept"),
    (False, "slow_consumer-into"), (True, "slow_producer-into")])
def test_race_checks_catch_a_missing_wait(zero_copy, scenario):
    scenario, kept, into = scenario.split("-")[0], scenario.endswith("-kept"), \
        scenario.endswith("-into")
    trainer, rollout = _run_race(zero_copy, scenario, mutant=True, kept=kept, into=into,
                                 steps=4 if kept else 3)
    assert "fatal" not in rollout, rollout
    bad = rollout["bad"][0] if into else rollout["bad"]
    assert bad, f"no corruption without stream waits ({scenario})"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("branches", [1, 3])
def test_graphed_copies_queue_then_capture_then_replay_the_current_bytes(branches):
    from weightsync.transport.backends.cuda_ipc.ops import GraphedCopies

    src = [torch.arange(n, dtype=torch.float32, device="cuda")
           for n in (5, 4096, 1 << 20, 1 << 26, 3, 1 << 24)]
    dst = [torch.zeros_like(s) for s in src]
    run = GraphedCopies(torch.device("cuda", 0), branches)
    asked = []

    def pairs():
        asked.append(1)
        return list(zip(dst, src))
    with torch.cuda.stream(torch.cuda.Stream()):
        for k in range(4):
            for s in src:
                s.add_(1)         # the copies must take the bytes as they are at each call
            run(pairs)
            # read on the same stream with no host wait: after every branch of the graph
            sums = torch.stack([d.double().sum() for d in dst])
            torch.cuda.current_stream().synchronize()
            assert torch.equal(sums, torch.stack([s.double().sum() for s in src])), k
            assert all(torch.equal(d, s) for d, s in zip(dst, src)), k
            assert (run.graph is not None) == (k >= 1)
    assert len(asked) == 2        # the pairs are looked at to queue once and to capture once
