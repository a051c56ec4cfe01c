"""Issue 14, items 1-4: receiver memory, pump threads, executors, the caller's event loop.

Both engines of a pair live in this process (the trainer's and the rollout's, each with
its own event loop in its own thread, or both on one loop), so a test sees the threads,
the staging buffers and the loops themselves.
"""

import asyncio
import concurrent.futures
import threading
import time

import pytest
import torch

from weightsync import CheckpointEngineRegistry
from weightsync.core.errors import WeightSyncError
from weightsync.transport.base import worker_kwargs

BUCKET = 64 * 1024
TIMEOUT = 6.0
NEVER = 1 << 40      # a direct size no tensor reaches: bucketed only


def _direct(backend, min_bytes):
    """Engine keywords: tensors of ``min_bytes`` or more go direct (shm: whatever the
    receiver count, unless ``min_bytes`` is ``NEVER``)."""
    shm = backend.endswith("shm") and min_bytes < NEVER
    return {"direct_min_bytes": min_bytes, **({"direct": True} if shm else {})}


def _pair(backend, **kw):
    kw = {"bucket_size": BUCKET, "timeout": TIMEOUT, **kw}
    tr = CheckpointEngineRegistry.new(backend, role="trainer", **kw)
    rx = CheckpointEngineRegistry.new(backend, role="rollout", **kw)
    metas = [tr.prepare(), rx.prepare()]
    tk, rk = type(tr).build_topology(1, 1, metas)
    errs = []

    def init(eng, kwargs):
        try:
            eng.init_process_group(**kwargs)
        except BaseException as exc:  # raised below
            errs.append(exc)
    ts = [threading.Thread(target=init, args=(tr, worker_kwargs(tk, 0))),
          threading.Thread(target=init, args=(rx, worker_kwargs(rk, 0)))]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    assert not errs, errs
    return tr, rx


def _close(*engines):
    for e in engines:
        try:
            e.finalize()
        except Exception:
            pass


def _model(version, n=8, numel=64 * 1024):
    """``n`` tensors of ``numel`` float32 (256 KiB each: direct, 4 buckets' worth)."""
    return [(f"w{i}", torch.full((numel,), float(version * 100 + i))) for i in range(n)]


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


def _send(tr, version, tensors=None):
    return asyncio.run(tr.send_weights(tensors or _model(version), version=version))


async def _collect(rx, version, *, sleep=0.0, stop_after=None, fail_after=None):
    got = {}
    async for name, t in rx.receive_weights(version):
        got[name] = t.clone()
        if stop_after is not None and len(got) >= stop_after:
            break
        if fail_after is not None and len(got) >= fail_after:
            raise RuntimeError("consumer failed")
        if sleep:
            await asyncio.sleep(sleep)
    return got


def _exact(got, version, n=8):
    want = dict(_model(version, n))
    return set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)


# -- item 1: the pump waits for the consumer (direct tensors are not staged ahead) ------
@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", ["shm", "collective"])
def test_slow_consumer_stages_at_most_one_direct_tensor(backend):
    tr, rx = _pair(backend, **_direct(backend, 1024))
    try:
        reads = []
        orig = rx._rx_direct
        rx._rx_direct = lambda *a: (reads.append(time.monotonic()), orig(*a))[1]
        seen = []

        async def consume():
            async for name, t in rx.receive_weights(1):
                seen.append(len(reads))       # reads done when the consumer got tensor k
                await asyncio.sleep(0.3)
        t, out = _in_thread(lambda: _send(tr, 1))
        asyncio.run(consume())
        t.join(30)
        assert "exc" not in out, out
        # tensor k is handed over when at most k + 1 reads are done: nothing staged ahead
        ahead = max(r - k for k, r in enumerate(seen, 1))
        assert ahead <= 1, f"{backend}: reads done ahead of the consumer: {seen}"
    finally:
        _close(tr, rx)


# -- item 2: after a failed or abandoned receive, the next sync is exact or fails at once -
@pytest.mark.timeout(180)
@pytest.mark.parametrize("backend", ["shm", "collective"])
@pytest.mark.parametrize("how", ["break", "raise", "cancel"])
def test_next_sync_after_abandoned_receive_is_exact_or_fails_fast(backend, how):
    # slot 0 of 2 is never released by a consumer that left: the pump blocks on it
    tr, rx = _pair(backend, num_slots=2, **_direct(backend, NEVER))     # bucketed only
    try:
        small = [(f"s{i}", torch.full((4096,), float(i))) for i in range(40)]  # many buckets
        t, out = _in_thread(lambda: _send(tr, 1, small))

        async def first():
            if how == "cancel":
                task = asyncio.ensure_future(_collect(rx, 1, sleep=0.5))
                await asyncio.sleep(0.7)
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
                return
            with pytest.raises(RuntimeError) if how == "raise" else _nothing():
                await _collect(rx, 1, stop_after=None if how == "raise" else 2,
                               fail_after=2 if how == "raise" else None, sleep=0.5)
        start = time.monotonic()
        asyncio.run(first())
        left = time.monotonic() - start
        # soon (well before any timeout): no pump of the abandoned sync is still reading
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            pumps = [th for th in threading.enumerate() if th.name.startswith("weightsync-rx")]
            if not pumps:
                break
            time.sleep(0.02)
        t.join(TIMEOUT * 3)
        assert "exc" in out, "the sender of the abandoned sync did not fail"
        assert not pumps, f"pump threads outlived their sync: {pumps}"
        assert left < 2.5, f"leaving the receive took {left:.1f}s"
    finally:
        _close(tr, rx)


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


@pytest.mark.timeout(180)
@pytest.mark.parametrize("backend", ["shm", "collective"])
def test_next_sync_on_same_engines_after_break(backend):
    tr, rx = _pair(backend, **_direct(backend, 1024))
    try:
        t, out = _in_thread(lambda: _send(tr, 1))
        asyncio.run(_collect(rx, 1, stop_after=2))
        t.join(TIMEOUT * 3)
        t, out = _in_thread(lambda: _send(tr, 2))
        start = time.monotonic()
        try:
            got = asyncio.run(_collect(rx, 2))
        except WeightSyncError:
            assert time.monotonic() - start < TIMEOUT, "the next sync failed, but not at once"
        else:
            assert _exact(got, 2), "stale or foreign data in the next sync"
        t.join(TIMEOUT * 3)
    finally:
        _close(tr, rx)


@pytest.mark.timeout(120)
def test_receive_refuses_to_share_a_link_with_a_live_pump():
    """A pump of the previous receive still reading (its wait did not end): the next
    receive fails at once with a WeightSyncError, and starts no second reader."""
    tr, rx = _pair("shm", **_direct("shm", NEVER))
    hold = threading.Event()
    stuck = threading.Thread(target=hold.wait, name="weightsync-rx0-s0", daemon=True)
    stuck.start()
    try:
        rx._rx_pumps = [stuck]
        t, out = _in_thread(lambda: _send(tr, 1))
        start = time.monotonic()
        with pytest.raises(WeightSyncError, match="still reading"):
            asyncio.run(_collect(rx, 1))
        assert time.monotonic() - start < TIMEOUT / 2
        readers = [th for th in threading.enumerate() if th.name.startswith("weightsync-rx")]
        assert readers == [stuck], readers
        t.join(TIMEOUT * 3)
        assert "exc" in out, "the sender was not told"
    finally:
        hold.set()
        _close(tr, rx)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", ["shm", "collective"])
def test_a_complete_receive_leaves_no_pump_behind(backend):
    """A pump that delivered its Done may still be returning when the consumer sees the
    last tensor; the receive ends only once it has (CI caught a pump alive at finalize)."""
    tr, rx = _pair(backend, **_direct(backend, NEVER))
    orig = rx._pump

    def slow_exit(stream, state):
        orig(stream, state)
        time.sleep(0.5)                      # the thread lingers after its last put
    rx._pump = slow_exit
    try:
        t, out = _in_thread(lambda: _send(tr, 1))
        got = asyncio.run(_collect(rx, 1))
        left = [th.name for th in threading.enumerate() if th.name.startswith("weightsync-rx")]
        t.join(TIMEOUT * 3)
        assert "exc" not in out, out
        assert _exact(got, 1)
        assert not left, f"pump threads alive after a complete receive: {left}"
    finally:
        _close(tr, rx)


# -- items 3 and 4: no default-executor threads, nothing blocking on the caller's loop ----
@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", ["shm", "collective", "delta+shm", "delta+collective"])
def test_send_and_receive_on_one_loop_with_one_default_thread(backend):
    tr, rx = _pair(backend, **_direct(backend, NEVER))   # bucketed only
    try:
        async def both(v):
            asyncio.get_running_loop().set_default_executor(
                concurrent.futures.ThreadPoolExecutor(1))
            _, got = await asyncio.gather(tr.send_weights(_model(v), version=v),
                                          _collect(rx, v))
            return got
        start = time.monotonic()
        for v in (1, 2):           # the codec's second sync has deltas (its control steps)
            got = asyncio.run(both(v))
            assert _exact(got, v)
        assert time.monotonic() - start < TIMEOUT, "starved on the default executor"
    finally:
        _close(tr, rx)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", ["shm", "collective"])
def test_direct_send_leaves_the_callers_loop_free(backend):
    tr, rx = _pair(backend, **_direct(backend, 1024))
    try:
        t, out = _in_thread(lambda: asyncio.run(_collect(rx, 1, sleep=1.0)))

        async def send_with_heartbeat():
            gaps, last = [], time.monotonic()
            done = asyncio.ensure_future(tr.send_weights(_model(1, n=4), version=1))
            while not done.done():
                await asyncio.sleep(0.01)
                now = time.monotonic()
                gaps.append(now - last)
                last = now
            await done
            return max(gaps)
        worst = asyncio.run(send_with_heartbeat())
        t.join(30)
        assert "exc" not in out, out
        assert _exact(out["value"], 1, n=4)
        # before: blocked for each consumer sleep (1 s); a loaded box adds scheduling noise
        assert worst < 0.5, f"the caller's loop was blocked for {worst:.2f}s"
    finally:
        _close(tr, rx)


@pytest.mark.timeout(120)
def test_codec_trainer_leaving_lets_a_slow_receiver_finish_its_last_reads():
    """The codec's trainer rank 0 hosts the codec store. Its send returns once it read
    every receiver's ``needs``; a receiver a little behind still reads them. Finalize
    waits for the receiver's ``done`` (bounded) before closing the store."""
    tr, rx = _pair("delta+shm")
    try:
        gather = rx._link.gather

        def behind(seq, what, *args):
            if what == "needs/1":
                time.sleep(0.5)
            return gather(seq, what, *args)
        rx._link.gather = behind
        t, out = _in_thread(lambda: asyncio.run(_collect(rx, 1)))
        _send(tr, 1)
        start = time.monotonic()
        tr.finalize()                 # right after the send, as a trainer that exits
        took = time.monotonic() - start
        t.join(30)
        assert "exc" not in out, out
        assert _exact(out["value"], 1)
        assert took < 5.0, took       # it waited for the receiver, not for its bound
    finally:
        _close(tr, rx)
