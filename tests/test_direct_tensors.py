"""Direct tensors (shm: receivers read the trainer's tensors by cross-memory attach;
collective: a big tensor is broadcast as it is) and ``receive_into`` (the engine writes
straight into the receiver's own tensors)."""

import asyncio
import multiprocessing as mp
import traceback

import pytest
import torch

from weightsync import CheckpointEngineRegistry
from weightsync.transport.backends.collective import RX_AHEAD
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


def direct_kwargs(backend, min_bytes=1024):
    """Engine keywords that send every tensor of ``min_bytes`` or more direct (shm: also
    with more receivers than cores)."""
    return {"direct_min_bytes": min_bytes, **({"direct": True} if backend == "shm" else {})}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("backend", ["shm", "collective"])
@pytest.mark.parametrize("trainers,receivers", [(1, 3), (2, 2)])
def test_direct_tensors_arrive_bit_exact(backend, trainers, receivers):
    # every tensor of 1 KiB or more skips the buckets (shm: where the kernel allows)
    spec = GroupSpec(backend=backend, trainers=trainers, receivers=receivers, steps=3,
                     engine_kwargs={"bucket_size": BUCKET, "timeout": 60,
                                    **direct_kwargs(backend)})
    _clean(run_group(spec))


def _into_worker(backend, role, conn, steps, direct_min):
    try:
        eng = CheckpointEngineRegistry.new(backend, role=role, bucket_size=BUCKET, timeout=60,
                                           direct_min_bytes=direct_min)
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
@pytest.mark.parametrize("direct_min", [1024, 1 << 40])
def test_receive_into_writes_the_callers_tensors(backend, direct_min):
    ctx = mp.get_context("spawn")
    pipes, procs = [], []
    for role in ("trainer", "rollout"):
        a, b = ctx.Pipe()
        p = ctx.Process(target=_into_worker, args=(backend, role, b, 2, direct_min),
                        daemon=True)
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


def kept_params_hook(engine, role, rank):
    """Trainer: yield the same tensors every sync, refilled in place (as parameters are).
    Receiver: every direct read takes 30 ms longer, so a trainer that moves on early is
    seen doing so."""
    if role == "trainer":
        orig, held = engine.send_weights, {}

        async def wrapped(named_tensors, version=None):
            items = []
            for name, t in named_tensors:
                if t.is_contiguous():
                    if name in held:
                        held[name].copy_(t)
                    else:
                        held[name] = t
                items.append((name, held.get(name, t)))
            return await orig(iter(items), version)
        engine.send_weights = wrapped
    else:
        import time
        orig_rx = engine._rx_direct

        def slow(stream, msg, aux, dest):
            time.sleep(0.03)
            orig_rx(stream, msg, aux, dest)
        engine._rx_direct = slow


def refilled_buffer_hook(engine, role, rank):
    """Trainer: every direct-sized tensor is yielded from one byte buffer kept from sync
    to sync, refilled per name (a cast or gather buffer). Receiver: slow direct reads."""
    if role == "trainer":
        orig, buf = engine.send_weights, torch.empty(1 << 20, dtype=torch.uint8)

        async def wrapped(named_tensors, version=None):
            def gen():
                for name, t in named_tensors:
                    nbytes = t.numel() * t.element_size()
                    if t.is_contiguous() and nbytes >= 1024:
                        view = buf[:nbytes].view(t.dtype).view(t.shape)
                        view.copy_(t)
                        yield name, view
                    else:
                        yield name, t
            return await orig(gen(), version)
        engine.send_weights = wrapped
    else:
        kept_params_hook(engine, role, rank)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("backend", ["shm", "collective"])
@pytest.mark.parametrize("hook,moves_on", [("kept_params_hook", True),
                                           ("refilled_buffer_hook", False)])
def test_the_trainer_moves_on_from_lasting_direct_tensors_only(backend, hook, moves_on):
    """Parameters (the same storage every sync) are read (shm) or broadcast (collective)
    while the trainer asks for the next item, from the second sync; a buffer refilled per name is waited for each time.
    Both land bit-exact with slow receivers (with the wait gone for the refilled buffer,
    every twin would carry the last twin's bytes)."""
    spec = GroupSpec(backend=backend, receivers=2, steps=3, tiny=5,
                     hook=f"test_direct_tensors:{hook}",
                     engine_kwargs={"bucket_size": BUCKET, "timeout": 60,
                                    **direct_kwargs(backend)})
    results = run_group(spec)
    _clean(results)
    unwaited = [s["direct_unwaited"] for s in results[0]["steps"]]
    if moves_on:
        assert unwaited[0] == 0 and unwaited[1] > 0 and unwaited[2] == unwaited[1], unwaited
    else:
        assert unwaited == [0, 0, 0], unwaited


def ahead_hook(engine, role, rank):
    """Receiver: count the broadcasts in flight at once per trainer stream (pausing after
    each post until two were), delay some completions (a slow one must not let a later
    item overtake it), and note the order items reach the consumer; written to
    ``$WS_AHEAD_OUT.<rank>`` at finalize."""
    if role != "rollout":
        return
    import json
    import os
    import random
    import threading
    import time
    rng, lock = random.Random(rank), threading.Lock()
    stats = {"now": {}, "max": 0, "order": []}
    post_d, post_b, complete = engine._rx_direct_post, engine._rx_fetch_post, engine._rx_complete
    handle_orig, finalize = engine._handle, engine.finalize

    def posted(stream, handle):
        with lock:
            now = stats["now"][str(stream)] = stats["now"].get(str(stream), 0) + 1
            stats["max"] = max(stats["max"], now)
        if stats["max"] < 2:     # give the next header time to come (a loaded box)
            time.sleep(0.02)
        return handle

    def direct(stream, *args):
        return posted(stream, post_d(stream, *args))

    def bucket(stream, *args):
        out = post_b(stream, *args)
        return out if out is None else (out[0], posted(stream, out[1]))

    def done(stream, msg, handle):
        time.sleep(rng.choice([0.0, 0.0, 0.02]))
        complete(stream, msg, handle)
        with lock:
            stats["now"][str(stream)] -= 1

    async def handle(state, item):
        kind, stream, msg, _ = item
        if kind in ("bucket", "direct"):
            stats["order"].append([kind, stream, msg.seq, msg.index])
        async for pair in handle_orig(state, item):
            yield pair

    def fin():
        with open(f"{os.environ['WS_AHEAD_OUT']}.{rank}", "w") as f:
            json.dump(stats, f)
        finalize()

    engine._rx_direct_post, engine._rx_fetch_post, engine._rx_complete = direct, bucket, done
    engine._handle, engine.finalize = handle, fin


@pytest.mark.timeout(240)
@pytest.mark.parametrize("trainers,receivers", [(1, 1), (2, 2)])
def test_collective_receivers_post_the_next_broadcast_ahead(monkeypatch, tmp_path, trainers,
                                                           receivers):
    """CPU ``collective`` receivers keep two broadcasts in flight (the next one waits in
    gloo when the last one's bytes end); with slow completions mixed in, every item still
    reaches the consumer in the order sent and lands bit-exact."""
    monkeypatch.setenv("WS_AHEAD_OUT", str(tmp_path / "ahead"))
    spec = GroupSpec(backend="collective", trainers=trainers, receivers=receivers, steps=3,
                     tiny=30, consume="into", hook="test_direct_tensors:ahead_hook",
                     engine_kwargs={"bucket_size": BUCKET, "timeout": 60,
                                    "direct_min_bytes": 1024})
    _clean(run_group(spec))
    import json
    for r in range(receivers):
        stats = json.loads((tmp_path / f"ahead.{r}").read_text())
        assert set(stats["now"].values()) == {0}, stats["now"]
        assert stats["max"] == RX_AHEAD, stats["max"]
        last: dict = {}
        kinds = set()
        for kind, stream, seq, index in stats["order"]:
            key = (kind, stream, seq)
            assert index > last.get(key, -1), (key, index, last.get(key))
            last[key] = index
            kinds.add(kind)
        assert kinds == {"bucket", "direct"}


def slow_probe_hook(engine, role, rank):
    """Kept parameters (see kept_params_hook); rollout rank 1 answers the trainer's memory
    probe 1 s late, so rank 0 has begun its first receive (and sent its offer) by then."""
    kept_params_hook(engine, role, rank)
    if role == "rollout" and rank == 1:
        import time
        import weightsync.transport.backends.shm.engine as shm_engine
        probe = shm_engine.cma_available

        def slow(*args):
            time.sleep(1.0)
            return probe(*args)
        shm_engine.cma_available = slow


@pytest.mark.timeout(180)
@pytest.mark.parametrize("consume", ["views", "into-shared"])
def test_shm_probe_waits_for_every_receivers_answer(consume):
    """A receiver's first offer that comes before another receiver's probe answer is kept
    for its sync, not taken for an answer: direct reads stay on (before the fix the probe
    counted the offer, freed its bytes and the late receiver read garbage: no direct
    reads for the whole group, silently). Receivers' tensors shared: every tensor is
    pushed from the first sync on, the early offer kept for it."""
    spec = GroupSpec(backend="shm", receivers=2, steps=3, tiny=5, consume=consume,
                     hook="test_direct_tensors:slow_probe_hook",
                     engine_kwargs={"bucket_size": BUCKET, "timeout": 60,
                                    **direct_kwargs("shm")})
    results = run_group(spec)
    _clean(results)
    steps = results[0]["steps"]
    if consume == "views":
        unwaited = [s["direct_unwaited"] for s in steps]
        assert unwaited[0] == 0 and unwaited[1] > 0 and unwaited[2] == unwaited[1], unwaited
    else:
        pushed = [s["pushed"] for s in steps]   # (non-contiguous tensors are not offered)
        assert pushed[0] > 0 and len(set(pushed)) == 1, pushed
