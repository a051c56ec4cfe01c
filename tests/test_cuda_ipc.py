"""cuda_ipc protocol logic on the CPU: the engine runs in one process over an in-process
stand-in for CUDA IPC (the GPU path itself is tested in test_gpu_cuda_ipc.py)."""

import asyncio
import secrets
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from weightsync import BackendUnavailable, CheckpointEngineRegistry
from weightsync.transport.backends.cuda_ipc.ops import (CudaIpcOps, IpcOps, format_descriptor,
                                             parse_descriptor, storage_bytes)
from weightsync.transport.base import worker_kwargs
from weightsync.transport.backends.cuda_ipc.engine import CudaIpcEngine, CudaIpcOptions
from weightsync.core.errors import PeerFailed, SyncTimeout, VersionMismatch
from weightsync.testing import expected_tensors, make_tensors, same_bytes

BUCKET = 64 * 1024
_EXPORTED: dict[str, torch.Tensor] = {}
_EVENTS: dict[str, "FakeEvent"] = {}


class FakeStream:
    """CPU stand-in for a CUDA stream that runs its work as late as it may: a queued copy
    is applied only when an event recorded behind it is found done, or at ``sync``. A
    missing wait in the engine then reads or overwrites bytes too early, as on a GPU."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.pending: list = []
        self.queued = self.ran = 0

    def enqueue(self, fn) -> None:
        with self.lock:
            self.queued += 1
            self.pending.append(fn)

    def run_until(self, upto: int) -> None:
        with self.lock:
            while self.ran < upto:
                fn = self.pending.pop(0)
                self.ran += 1
                fn()


class FakeEvent:
    """Done once its stream ran what was queued before ``record``, and not before it was
    polled ``FakeOps.late_polls`` times (it completes late)."""

    def __init__(self) -> None:
        self.key = secrets.token_hex(8)
        self.lock = threading.Lock()
        self.stream, self.upto, self.polls = None, 0, 0
        _EVENTS[self.key] = self


class FakeOps(IpcOps):
    """CPU stand-in: 'exporting' registers the storage, 'opening' looks it up; streams
    and events are late (see FakeStream)."""

    exports = 0
    late_polls = 2

    def __init__(self, device: str) -> None:
        if torch.device(device).type != "cpu":
            raise ValueError("fake ops are CPU only")
        self.device = torch.device("cpu")
        self.stream = FakeStream()

    def alloc(self, nbytes):
        return torch.full((nbytes,), 0xAB, dtype=torch.uint8)

    def export(self, tensor, count):
        FakeOps.exports += 1
        keys = [secrets.token_hex(8) for _ in range(count)]
        for k in keys:
            _EXPORTED[k] = storage_bytes(tensor)
        return [f"fake|{k}" for k in keys]

    def open(self, descriptor):
        return _EXPORTED.pop(descriptor.split("|")[1])

    def current_stream(self):
        return self.stream

    def copy(self, dst, src, stream):
        (stream or self.stream).enqueue(lambda: dst.copy_(src))

    def sync(self, stream):
        stream.run_until(stream.queued)

    def idle(self, stream):
        with stream.lock:
            return stream.ran == stream.queued

    def new_stream(self):
        return FakeStream()

    def wait_event(self, stream, event):
        # what the event marks now (as cudaStreamWaitEvent): run that first, when due
        with event.lock:
            other, upto = event.stream, event.upto
        if other is not None and other is not stream:
            stream.enqueue(lambda: other.run_until(upto))

    def keep_for(self, tensor, stream):
        pass

    def new_event(self):
        return FakeEvent()

    def event_handle(self, event):
        return event.key

    def open_event(self, handle):
        return _EVENTS[handle]

    def record(self, event, stream):
        with event.lock:
            event.stream, event.upto, event.polls = stream, stream.queued, self.late_polls

    def done(self, event):
        with event.lock:
            if event.stream is None:
                return True
            if event.polls > 0:
                event.polls -= 1
                return False
            stream, upto = event.stream, event.upto
        stream.run_until(upto)
        return True


@pytest.fixture
def fake_ops(monkeypatch):
    monkeypatch.setattr(CudaIpcEngine, "ops_factory", FakeOps)
    FakeOps.exports = 0
    yield FakeOps
    _EXPORTED.clear()
    _EVENTS.clear()


def test_the_device_comes_from_the_keyword_then_weightsync_device_then_cuda(
        fake_ops, monkeypatch):
    seen = []

    def ops(device):
        seen.append(device)
        return FakeOps("cpu")
    monkeypatch.setattr(CudaIpcEngine, "ops_factory", ops)
    monkeypatch.setenv("WEIGHTSYNC_DEVICE", "cuda:1")
    CudaIpcEngine(role="trainer")
    CudaIpcEngine(role="trainer", device="cuda:2")
    monkeypatch.delenv("WEIGHTSYNC_DEVICE")
    CudaIpcEngine(role="trainer")
    assert seen == ["cuda:1", "cuda:2", "cuda"]


def _group(trainers, receivers, **kw):
    kw = {"bucket_size": BUCKET, "timeout": 30, "device": "cpu", **kw}
    ts = [CudaIpcEngine(role="trainer", **kw) for _ in range(trainers)]
    rs = [CudaIpcEngine(role="rollout", **kw) for _ in range(receivers)]
    tk, rk = CudaIpcEngine.build_topology(trainers, receivers, [e.prepare() for e in ts + rs])
    kws = [worker_kwargs(tk, i) for i in range(trainers)] + \
          [worker_kwargs(rk, j) for j in range(receivers)]
    with ThreadPoolExecutor(len(kws)) as pool:
        for f in [pool.submit(e.init_process_group, **k) for e, k in zip(ts + rs, kws)]:
            f.result(timeout=60)
    return ts, rs


def _sync(ts, rs, items_of, version, expect=None, on_stream=False):
    """One sync; returns (trainer metrics, per receiver {name: (copy, data_ptr)}).
    ``on_stream``: the consumer copies each view on its current stream (as a GPU consumer
    does), else it clones on the host at once."""
    async def recv(r):
        got = {}
        async for name, t in r.receive_weights(version=version if expect is None else expect):
            assert name not in got
            if on_stream:
                dst = torch.empty_like(t)
                r._ops.copy(dst, t, r._ops.current_stream())
            else:
                dst = t.clone()
            got[name] = (dst, t.data_ptr())
        return got

    async def main():
        asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(32))
        jobs = [t.send_weights(items_of(i), version=version) for i, t in enumerate(ts)]
        jobs += [recv(r) for r in rs]
        return await asyncio.wait_for(asyncio.gather(*jobs, return_exceptions=True), 60)

    out = asyncio.run(main())
    return out[:len(ts)], out[len(ts):]


def _finalize(engines):
    for e in engines:
        e.finalize()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("zero_copy", [False, True])
@pytest.mark.parametrize("receivers", [1, 2])
@pytest.mark.parametrize("on_stream", [False, True], ids=["host-reads", "stream-reads"])
def test_fresh_tensors_every_sync(fake_ops, zero_copy, receivers, on_stream):
    """Over late streams and events (FakeStream): the bytes are right only if every
    ordering wait of the engine is there (the trainer's copies before a receiver reads,
    a receiver's reads before the trainer refills the slot, all reads before the end).
    Fresh tensors never outlive their item: they go through the ring, zero-copy or not."""
    ts, rs = _group(1, receivers, zero_copy=zero_copy)
    try:
        for step in range(3):
            sent, got = _sync(ts, rs, lambda i: make_tensors(step, bucket_size=BUCKET), step,
                              on_stream=on_stream)
            assert not any(isinstance(x, BaseException) for x in sent + got), sent + got
            expected = expected_tensors(step, bucket_size=BUCKET)
            for g in got:
                assert set(g) == set(expected)
                bad = [n for n in expected if not same_bytes(g[n][0], expected[n])]
                assert not bad, bad[:5]
            assert sent[0]["ref_tensors"] == 0 and not ts[0]._regions
            for r in rs:
                assert not r._rx_regions.get(0)
    finally:
        _finalize(ts + rs)


@pytest.mark.timeout(120)
def test_zero_copy_reads_the_trainers_memory_and_replays(fake_ops):
    """By default, parameters are read in place from the second sync on (the first finds
    out which tensors outlive their item); tied weights and non-contiguous tensors go
    through the ring; new memory behind a parameter goes through the ring for one sync."""
    g = torch.Generator().manual_seed(0)
    params = {f"layer.{i}.w": torch.randn(64, 40, generator=g) for i in range(6)}
    params["norm"] = torch.randn(7, generator=g)                      # small: read in place too
    params["tied"] = params["layer.0.w"]                              # same storage twice
    params["col"] = torch.randn(40, 64, generator=g).t()              # not contiguous
    ts, rs = _group(1, 2, bucket_size=BUCKET // 4)
    ring = {"tied", "layer.0.w", "col"}
    try:
        for step in range(5):
            for p in params.values():
                p.add_(1.0)  # in place, like an optimizer step
            if step == 3:  # new memory behind the same tensor object: must be noticed
                params["layer.1.w"].data = torch.randn(64, 40, generator=g)
            sent, got = _sync(ts, rs, lambda i: list(params.items()), step)
            assert not any(isinstance(x, BaseException) for x in sent + got), sent + got
            in_place = set() if step == 0 else \
                set(params) - ring - ({"layer.1.w"} if step == 3 else set())
            for received in got:
                for name, p in params.items():
                    assert same_bytes(received[name][0], p.contiguous()), name
                    assert (received[name][1] == p.data_ptr()) == (name in in_place), name
            assert sent[0]["ref_tensors"] == len(in_place)
            assert (sent[0]["ref_batches"] >= 2) == bool(in_place)
            assert FakeOps.exports == 2 + 6 * (step > 0) + (step == 4)  # mappings reused
            assert bool(sent[0]["buckets_with_layout"]) == (step != 2)
    finally:
        _finalize(ts + rs)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("pattern", ["full", "disjoint"])
def test_two_trainers_zero_copy(fake_ops, pattern):
    ts, rs = _group(2, 2, zero_copy=True)
    try:
        for step in range(3):
            items = make_tensors(step, bucket_size=BUCKET, tiny=50)
            pick = (lambda i: items) if pattern == "full" else \
                (lambda i: [x for k, x in enumerate(items) if k % 2 == i])
            sent, got = _sync(ts, rs, pick, step)
            assert not any(isinstance(x, BaseException) for x in sent + got), sent + got
            expected = expected_tensors(step, bucket_size=BUCKET, tiny=50)
            for g in got:
                assert set(g) == set(expected)
                assert all(same_bytes(g[n][0], expected[n]) for n in expected)
    finally:
        _finalize(ts + rs)


@pytest.mark.timeout(120)
def test_version_mismatch_is_an_error(fake_ops):
    ts, rs = _group(1, 1, zero_copy=True, timeout=10)
    try:
        sent, got = _sync(ts, rs, lambda i: make_tensors(0, bucket_size=BUCKET), 0, expect=5)
        assert isinstance(got[0], VersionMismatch), got
        assert isinstance(sent[0], BaseException), sent
    finally:
        _finalize(ts + rs)


@pytest.mark.timeout(120)
def test_equal_versions_of_other_int_types_match(fake_ops):
    """numpy ints and int subclasses are the version they equal, on either side; a version
    that is neither int nor str is refused before anything is sent."""
    import numpy as np

    class V(int):
        pass

    ts, rs = _group(1, 1, zero_copy=True, timeout=10)
    try:
        sent, got = _sync(ts, rs, lambda i: make_tensors(0, bucket_size=BUCKET, tiny=5),
                          np.int64(2), expect=V(2))
        assert not any(isinstance(x, BaseException) for x in sent + got), sent + got
        assert sent[0]["version"] == 2 and type(sent[0]["version"]) is int
        with pytest.raises(ValueError, match="version"):
            asyncio.run(ts[0].send_weights(make_tensors(0, bucket_size=BUCKET), version=1.5))
    finally:
        _finalize(ts + rs)


@pytest.mark.timeout(120)
def test_zero_copy_batches_grow(fake_ops):
    params = {f"w{i}": torch.full((1024,), float(i)) for i in range(40)}  # 4 KiB each
    ts, rs = _group(1, 1, zero_copy=True, bucket_size=8192)
    try:
        for step in range(2):     # the first sync finds out which tensors last
            sent, got = _sync(ts, rs, lambda i: list(params.items()), step)
            assert not any(isinstance(x, BaseException) for x in sent + got), sent + got
        # 2, 4, 8, 16 tensors, then the 10 left: few messages, the first one early
        assert sent[0]["ref_batches"] == 5 and sent[0]["ref_tensors"] == 40
        assert all(same_bytes(got[0][n][0], p) for n, p in params.items())
    finally:
        _finalize(ts + rs)


def test_zero_copy_batches_wait_for_the_trainers_stream_only_while_it_has_work(
        fake_ops, monkeypatch):
    """A zero-copy batch announced while the trainer's stream has nothing left to run is
    read at once (no event of the trainer's is polled: on a GPU its record would wait for
    the trainer's next time slice); one announced behind pending writes to the tensors
    is read only after them."""
    g = torch.Generator().manual_seed(3)
    params = {f"w{i}": torch.randn(256, generator=g) for i in range(12)}
    ts, rs = _group(1, 1, zero_copy=True, bucket_size=2048)
    waited = []
    real_wait = rs[0]._wait_event

    def spy(event, **kw):
        waited.append(event is rs[0]._rx_filled[0][-1])   # the zero-copy batches' event
        return real_wait(event, **kw)
    monkeypatch.setattr(rs[0], "_wait_event", spy)
    try:
        for step in range(3):
            waited.clear()
            expect = {n: p.clone() for n, p in params.items()}
            if step == 2:       # an optimizer step still queued on the trainer's stream
                expect = {n: p + 1 for n, p in params.items()}
                for n, p in params.items():
                    ts[0]._ops.copy(p, expect[n], None)
            sent, got = _sync(ts, rs, lambda i: list(params.items()), step)
            assert not any(isinstance(x, BaseException) for x in sent + got), sent + got
            assert all(same_bytes(got[0][n][0], expect[n]) for n in params)
            if step:
                assert sent[0]["ref_tensors"] == len(params) and sent[0]["ref_batches"] >= 2
                assert any(waited) == (step == 2), (step, waited)
    finally:
        _finalize(ts + rs)


def test_unfinished_peer_event_is_a_timeout(fake_ops, monkeypatch):
    e = CudaIpcEngine(role="trainer", device="cpu", timeout=0.2)
    monkeypatch.setattr(e._ops, "done", lambda ev: False, raising=False)
    start = time.monotonic()
    with pytest.raises(SyncTimeout) as info:
        e._wait_event(object(), peer="rollout rank 1", phase="send", version=4)
    assert 0.15 < time.monotonic() - start < 10  # bounded (loose: CI machines are busy)
    assert info.value.peer == "rollout rank 1" and info.value.version == 4
    monkeypatch.setattr(e._ops, "done", lambda ev: (_ for _ in ()).throw(RuntimeError("x")),
                        raising=False)
    with pytest.raises(PeerFailed):
        e._wait_event(object(), peer="rollout rank 1", phase="send", version=4)


def test_ack_pusher_orders_drops_and_reports():
    from weightsync.transport.backends.cuda_ipc.engine import _AckPusher
    from weightsync.transport.backends.cuda_ipc.refs import REF_INDEX_BASE
    from weightsync.core.wire import AckMsg, ErrorMsg

    class Box:
        def __init__(self):
            self.got, self.fail = [], False

        def push(self, box, msg):
            time.sleep(0.01)
            if self.fail:
                raise ConnectionError("gone")
            self.got.append(msg)

    box = Box()
    acker = _AckPusher(box, "weightsync-test-acker", 5.0)
    try:
        for i in range(3):
            acker.push("t", AckMsg(seq=1, stream=0, rank=0, index=i))
        acker.push("t", AckMsg(seq=1, stream=0, rank=0, index=REF_INDEX_BASE))  # dropped
        acker.push("t", AckMsg(seq=1, stream=0, rank=0, index=0, final=True))  # after the rest
        assert [(m.index, m.final) for m in box.got] == [(0, False), (1, False), (2, False),
                                                         (0, True)]
        box.fail = True
        acker.push("t", AckMsg(seq=2, stream=0, rank=0, index=0))
        with pytest.raises(ConnectionError):
            acker.push("t", ErrorMsg(version=None, seq=2, error="SyncTimeout", message="m",
                                     peer="p", phase="receive"))
    finally:
        acker.close()


def test_descriptor_roundtrip_and_rejects():
    share = (0, b"\x01" + bytes(range(64)), 1 << 30, 4096, b"/torch_12_34", 7, b"\0" * 64, True)
    text = format_descriptor("GPU-1234-abcd", share)
    d = parse_descriptor(text)
    assert d == {"uuid": "GPU-1234-abcd", "size": 1 << 30, "offset": 4096, "ref_offset": 7,
                 "handle": share[1], "ref_handle": b"/torch_12_34"}
    parts = text.split("|")
    for i, bad in [(0, "cudaipc0"), (1, "GPU 1"), (2, "0"), (2, "-5"), (3, "x"),
                   (5, "abc"), (5, "zz"), (6, "")]:
        broken = parts.copy()
        broken[i] = bad
        with pytest.raises(ValueError):
            parse_descriptor("|".join(broken))
    with pytest.raises(ValueError):
        parse_descriptor(text + "|extra")
    with pytest.raises(ValueError):
        format_descriptor("GPU-1", (0, None, 0, 0, None, 0, b"", False))


def test_options_and_construction(monkeypatch):
    for bad in ("yes", 1, None):
        with pytest.raises(ValueError, match="zero_copy"):
            CudaIpcOptions(zero_copy=bad)
    assert CudaIpcOptions().zero_copy is True
    monkeypatch.setenv("WEIGHTSYNC_CUDA_IPC_ZERO_COPY", "0")
    assert CudaIpcOptions().zero_copy is False
    assert CudaIpcOptions(zero_copy=True).zero_copy is True
    # options removed on purpose are unknown keywords now
    for name in ("sync", "links", "stream_waits", "rx_stream_waits", "graph_branches",
                 "fill_graphs", "push", "min_ref_bytes", "ref_first_bytes", "ref_batch_bytes"):
        with pytest.raises(ValueError, match="unknown option"):
            CudaIpcEngine(role="trainer", device="cpu", **{name: 1})
    assert "cuda_ipc" in CheckpointEngineRegistry.names()
    assert CheckpointEngineRegistry.get("cuda_ipc").capabilities == {"cuda", "same_host"}
    with pytest.raises(ValueError, match="not a CUDA device"):
        CudaIpcOps("cpu")
    if not torch.cuda.is_available():
        with pytest.raises(BackendUnavailable):
            CheckpointEngineRegistry.new("cuda_ipc", role="trainer")


def test_spread_balances_copies_over_branches_by_bytes():
    from weightsync.transport.backends.cuda_ipc.ops import GraphedCopies, spread
    assert spread([], 3) == []
    assert spread([5, 5, 5], 1) == [0, 0, 0]
    # each copy goes to the lane with the fewest bytes so far (ties: the lowest lane)
    assert spread([100, 10, 10, 10, 10, 200, 1], 2) == [0, 1, 1, 1, 1, 1, 0]
    lanes = spread([64, 8, 8, 64, 8, 8, 64, 8, 8] * 30, 4)
    loads = [0] * 4
    for n, lane in zip([64, 8, 8, 64, 8, 8, 64, 8, 8] * 30, lanes):
        loads[lane] += n
    assert max(loads) - min(loads) <= 64 and set(lanes) == {0, 1, 2, 3}
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ValueError, match="branches"):
            GraphedCopies(torch.device("cpu"), bad)


def test_receivers_build_copy_programs_in_graph_branches(fake_ops, monkeypatch):
    """Every copy runner a receiver's programs use runs its copies in ``GRAPH_BRANCHES``
    chains."""
    from weightsync.transport.backends.cuda_ipc.engine import GRAPH_BRANCHES
    asked = []
    real = FakeOps.copy_runner
    monkeypatch.setattr(FakeOps, "copy_runner",
                        lambda self, branches=1: (asked.append(branches), real(self))[1])
    ts, rs = _group(1, 1, zero_copy=True)
    try:
        params = make_tensors(0, bucket_size=BUCKET)
        dests = [_destinations(0)]
        for step in range(2):
            sent, got = _sync_into(ts, rs, lambda i: params, step, dests)
            assert not any(isinstance(x, BaseException) for x in sent + got), sent + got
        assert asked and set(asked) == {GRAPH_BRANCHES}
    finally:
        _finalize(ts + rs)


def _fill_case(mix, mutant, receivers=2, steps=4):
    """Kept parameters updated in place on the trainer's (late) stream, read late by the
    receivers; with ``mix`` a fresh temporary follows every few of them. The kept ones go
    through fill programs; ``held`` holds each sync's ``fill_graph_tensors``."""
    base = [(n, t.contiguous().clone()) for n, t in make_tensors(0, bucket_size=BUCKET, tiny=40)]
    params = dict(base)
    ts, rs = _group(1, receivers, zero_copy=False)   # kept tensors through the ring
    trainer = ts[0]
    if mutant:   # the held copies issued after the bucket's "filled" record
        trainer._batch_bytes = 1 << 62   # (all of a bucket's copies held to its publish)

        def late_publish(slot, msg, _t=trainer):
            _t._tx_done(slot, msg.version)
            _t._flush_fill(slot)
            _t._tx_control().push_many(_t._receiver_boxes(), msg)
        trainer._tx_publish = late_publish
    bad, held = [], []
    try:
        for step in range(steps):
            values = dict(make_tensors(step, bucket_size=BUCKET, tiny=40))
            for name, p in params.items():   # the optimizer step, on the trainer's stream
                trainer._ops.copy(p, values[name].contiguous(), trainer._ops.current_stream())

            def items(i):
                cur = trainer._ops.current_stream()
                for k, (name, p) in enumerate(params.items()):
                    yield name, p
                    if mix and k % 7 == 0:
                        yield f"tmp.{k}", torch.full((BUCKET // 8,), float(step * 1000 + k))
                        trainer._ops.sync(cur)   # the caller's stream runs ahead, as a GPU's
            sent, got = _sync(ts, rs, items, step, on_stream=True)
            assert not any(isinstance(x, BaseException) for x in sent + got), sent + got
            held.append(sent[0]["fill_graph_tensors"])
            for g in got:
                for name, (t, _) in g.items():
                    want = values[name].contiguous() if name in values else \
                        torch.full((BUCKET // 8,), float(step * 1000 + int(name[4:])))
                    if not same_bytes(t, want):
                        bad.append((step, name))
    finally:
        _finalize(ts + rs)
    return bad, held


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mix", [False, True], ids=["kept", "kept+temporaries"])
def test_kept_tensors_fill_their_slots_through_replayed_programs(fake_ops, monkeypatch, mix):
    """From the second sync on, kept parameters' copies into a slot are
    held and issued at the bucket's publish by one program per (slot, bucket), which is
    handed the same memory on every call (what lets a GPU replay it as a graph);
    temporaries are still copied at once. A bucket's copies go out in batches, the first
    ones while the bucket is still being packed. Bytes exact at every step, read late."""
    calls, order = {}, []
    real = FakeOps.copy_runner
    from weightsync.transport.backends.cuda_ipc import engine as eng
    real_publish = eng.CudaIpcEngine._tx_publish

    def runner(self, branches=1):
        inner, key = real(self, branches), len(calls)
        calls[key] = []

        def run(pairs):
            got = pairs()
            calls[key].append(tuple((d.data_ptr(), s.data_ptr(), d.numel()) for d, s in got))
            order.append("batch")
            inner(lambda: got)
        return run

    def publish(self, slot, msg):
        order.append("publish")
        return real_publish(self, slot, msg)
    monkeypatch.setattr(FakeOps, "copy_runner", runner)
    monkeypatch.setattr(eng.CudaIpcEngine, "_tx_publish", publish)
    bad, held = _fill_case(mix, mutant=False, steps=5)
    assert bad == []
    assert held[0] == 0 and all(h >= 40 for h in held[1:]), held
    assert calls and all(len(set(memory)) == 1 for memory in calls.values()), calls
    assert max(len(memory) for memory in calls.values()) == 4   # syncs 2-5 replay
    # batches issued between two publishes: a bucket's first ones before its own publish
    runs = [len(b) for b in "".join("b" if o == "batch" else "|" for o in order).split("|")]
    assert max(runs) >= 2, order


@pytest.mark.timeout(120)
def test_fill_program_checks_catch_copies_issued_after_the_fill_event(fake_ops):
    """Held copies issued after the bucket's "filled" record: receivers read the slot
    before they land (what makes the test above able to fail)."""
    bad, _ = _fill_case(False, mutant=True)
    assert bad, "no corruption with the fill program behind the event"


@pytest.mark.timeout(120)
def test_headers_and_acks_go_over_links(fake_ops):
    """Bucket headers and acks use one socket per receiver; the control store carries only
    set-up; the bytes are exact."""
    ts, rs = _group(1, 2)
    try:
        assert ts[0]._hub is not None
        assert all(len(r._links) == 1 for r in rs)
        pushed = []
        store_push = ts[0]._tx_inbox.push_many
        ts[0]._tx_inbox.push_many = lambda *a, **k: (pushed.append(a[1]), store_push(*a, **k))
        for step in range(2):
            sent, got = _sync(ts, rs, lambda i: make_tensors(step, bucket_size=BUCKET), step)
            assert not any(isinstance(x, BaseException) for x in sent + got), sent + got
            expected = expected_tensors(step, bucket_size=BUCKET)
            assert all(same_bytes(g[n][0], expected[n]) for g in got for n in expected)
        assert pushed == []
    finally:
        _finalize(ts + rs)


@pytest.mark.timeout(120)
def test_zero_copy_replays_new_views_of_the_same_storage(fake_ops):
    """An export that yields new tensor objects over the same storage every sync (FSDP2's
    reused buffers, merged-LoRA views) replays the last sync's entries: nothing is worked
    out again per tensor; a tensor whose storage was replaced is noticed."""
    g = torch.Generator().manual_seed(1)
    params = {f"w{i}": torch.randn(32, 16, generator=g) for i in range(8)}
    ts, rs = _group(1, 1, zero_copy=True)
    fresh = []
    real = ts[0]._new_ref

    async def counting(name, tensor):
        fresh.append(name)
        return await real(name, tensor)
    ts[0]._new_ref = counting
    try:
        for step in range(5):
            for p in params.values():
                p.add_(1.0)
            if step == 3:   # new memory under one name: through the ring once, then its
                params["w2"] = torch.randn(32, 16, generator=g)   # entry is worked out again
            fresh.clear()
            sent, got = _sync(ts, rs, lambda i: [(n, p.view(p.shape)) for n, p in params.items()],
                              step)
            assert not any(isinstance(x, BaseException) for x in sent + got), sent + got
            assert all(same_bytes(got[0][n][0], p) for n, p in params.items())
            assert fresh == {1: sorted(params), 4: ["w2"]}.get(step, []), (step, fresh)
    finally:
        _finalize(ts + rs)


def _sync_into(ts, rs, items_of, version, dests):
    """One sync each receiver ``j`` takes with ``receive_into(dests[j])``; returns
    (trainer metrics, per receiver the yielded {name: tensor object})."""
    async def recv(r, into):
        got = {}
        async for name, t in r.receive_into(into, version=version):
            assert name not in got
            got[name] = t
        return got

    async def main():
        asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(32))
        jobs = [t.send_weights(items_of(i), version=version) for i, t in enumerate(ts)]
        jobs += [recv(r, d) for r, d in zip(rs, dests)]
        return await asyncio.wait_for(asyncio.gather(*jobs, return_exceptions=True), 60)

    out = asyncio.run(main())
    return out[:len(ts)], out[len(ts):]


def _destinations(seed):
    return {n: torch.empty(t.shape, dtype=t.dtype)
            for n, t in expected_tensors(seed, bucket_size=BUCKET).items()}


def _whole_buckets_names(engine):
    """Names in the buckets (and zero-copy batches) of trainer 0 that hold only whole,
    non-empty tensors: those a program lands."""
    buckets = list(engine._rx_plans.get(0, [])) + \
        [b for b, _ in engine._rx_ref_plans.get(0, [])]
    return {e.name for b in buckets
            if all(not e.is_chunk and e.total_nbytes for e in b.entries) for e in b.entries}


def _program_runs(engine):
    return sorted(p.runs for p in engine.__dict__.get("_rx_progs", {}).values())


@pytest.mark.timeout(120)
@pytest.mark.parametrize("zero_copy", [False, True])
@pytest.mark.parametrize("receivers", [1, 2])
def test_receive_into_replays_each_buckets_copies(fake_ops, zero_copy, receivers):
    """``receive_into`` lands a bucket whose layout, memory and destinations did not change
    through the program built for it the sync before (no per-tensor work); over late
    streams (FakeStream) the bytes are right only if its copies are queued where the
    per-tensor ones were (before the slot is released, before the final wait)."""
    ts, rs = _group(1, receivers, zero_copy=zero_copy)
    dests = [_destinations(0) for _ in rs]
    params = make_tensors(0, bucket_size=BUCKET)   # a trainer's: the same storage each step
    try:
        for step in range(4):
            for (_, p), (_, new) in zip(params, make_tensors(step, bucket_size=BUCKET)):
                p.copy_(new)
            sent, got = _sync_into(ts, rs, lambda i: params, step, dests)
            assert not any(isinstance(x, BaseException) for x in sent + got), sent + got
            expected = expected_tensors(step, bucket_size=BUCKET)
            for g, d in zip(got, dests):
                assert set(g) == set(expected)
                fitting = [n for n, t in expected.items() if t.numel()]
                assert all(g[n] is d[n] for n in fitting)   # landed in the caller's tensors
                bad = [n for n in expected if not same_bytes(d[n], expected[n])]
                assert not bad, bad[:5]
            for r in rs:
                # buckets of whole tensors have programs (chunks and empties do not), built
                # at the first sync and used again at each one since; with zero-copy, the
                # parameters move from the ring to zero-copy batches at the second sync
                if zero_copy and step == 1:
                    continue
                built = 0 if not zero_copy or step == 0 else 1
                live = [p for p in r._rx_progs.values() if p.runs == step + 1 - built]
                assert len(live) >= 2, _program_runs(r)
                # no program of a bucket the sync no longer sends is kept (with zero-copy
                # the ring sends fewer buckets from the second sync on)
                assert len(live) == len(r._rx_progs), _program_runs(r)
                covered = {n for p in live for n in p.names}
                assert covered == _whole_buckets_names(r) and len(covered) > 100
    finally:
        _finalize(ts + rs)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("zero_copy", [False, True])
def test_a_program_replays_over_new_views_and_writes_new_memory(fake_ops, zero_copy):
    """Destinations are matched by memory, not object: new views of the same tensors (a
    replica's ``detach()`` of its parameters every sync) replay the programs; tensors
    elsewhere (same names, shapes, dtypes) get the bytes through new programs, and the
    old ones are not written. Programs keep no caller tensor alive."""
    import gc
    import weakref

    ts, rs = _group(1, 1, zero_copy=zero_copy)
    old = _destinations(0)
    params = make_tensors(0, bucket_size=BUCKET)

    def step_params(step):
        for (_, p), (_, new) in zip(params, make_tensors(step, bucket_size=BUCKET)):
            p.copy_(new)
        return params

    seen: dict = {}

    def check(step, sent, got):
        """The runs of the programs this sync used (all alike)."""
        assert not any(isinstance(x, BaseException) for x in sent + got), sent + got
        progs = rs[0].__dict__.get("_rx_progs", {})
        used = [p.runs for k, p in progs.items() if seen.get(k) != (id(p), p.runs)]
        seen.clear()
        seen.update({k: (id(p), p.runs) for k, p in progs.items()})
        assert len(used) >= 2 and len(set(used)) == 1, used
        return used[0]
    try:
        if zero_copy:   # the parameters move from the ring to zero-copy at the second sync
            sent, got = _sync_into(ts, rs, lambda i: step_params(9), 9, [old])
            check(9, sent, got)
        for step in range(2):
            sent, got = _sync_into(ts, rs, lambda i: step_params(step), step, [old])
            assert check(step, sent, got) == step + 1
        views = {n: t.detach() for n, t in old.items()}      # new objects, same memory
        sent, got = _sync_into(ts, rs, lambda i: step_params(2), 2, [views])
        assert check(2, sent, got) == 3                      # replayed, not rebuilt
        for n, t in expected_tensors(2, bucket_size=BUCKET).items():
            assert same_bytes(old[n], t), n
        new = _destinations(0)
        sent, got = _sync_into(ts, rs, lambda i: step_params(3), 3, [new])
        assert check(3, sent, got) == 1                      # rebuilt for the new memory
        for n, t in expected_tensors(3, bucket_size=BUCKET).items():
            assert same_bytes(new[n], t), n
        for n, t in expected_tensors(2, bucket_size=BUCKET).items():
            assert same_bytes(old[n], t), n                  # untouched since sync 2
        watch = weakref.ref(old["tiny.0"])
        del old, views
        gc.collect()
        assert watch() is None
    finally:
        _finalize(ts + rs)


@pytest.mark.timeout(120)
def test_replayed_copies_are_done_before_their_slot_is_refilled(fake_ops):
    """Every bucket a program's (whole tensors, eight buckets through two slots): over late
    streams a program whose copies were queued after the slot's release would read the
    next bucket's bytes."""
    g = torch.Generator().manual_seed(3)
    params = [(f"w.{i}", torch.randn(BUCKET // 16 - 8, generator=g)) for i in range(32)]
    ts, rs = _group(1, 1, zero_copy=False)
    dests = [{n: torch.empty_like(t) for n, t in params}]
    try:
        for step in range(3):
            for _, p in params:
                p.add_(1.0)
            sent, got = _sync_into(ts, rs, lambda i: params, step, dests)
            assert not any(isinstance(x, BaseException) for x in sent + got), sent + got
            assert sent[0]["buckets"] >= 8
            bad = [n for n, p in params if not same_bytes(dests[0][n], p)]
            assert not bad, bad[:5]
        assert _program_runs(rs[0]) == [3] * sent[0]["buckets"]
    finally:
        _finalize(ts + rs)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("zero_copy", [False, True])
def test_send_returns_only_once_every_receiver_has_read(fake_ops, monkeypatch, zero_copy):
    """Receivers acknowledge the end before their last reads are done (the trainer waits
    for their "done" events itself): a trainer that overwrites its tensors the moment
    ``send_weights`` returns must not change what the receivers get. Trainer and
    receivers run on threads of their own, and events complete late."""
    monkeypatch.setattr(FakeOps, "late_polls", 40)
    params = [(f"w.{i}", torch.zeros(BUCKET // 16 - 8)) for i in range(12)]
    ts, rs = _group(1, 2, zero_copy=zero_copy)
    dests = [{n: torch.empty_like(t) for n, t in params} for _ in rs]
    steps, bad, errors = 3, [], []

    def trainer():
        async def run():
            for step in range(steps):
                for i, (_, p) in enumerate(params):
                    p.fill_(step * 100 + i)
                await ts[0].send_weights(params, version=step)
                for _, p in params:
                    p.fill_(-1.0)        # the next optimizer step, at once
        try:
            asyncio.run(run())
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    def receiver(r, into):
        async def run():
            for step in range(steps):
                async for _ in r.receive_into(into, version=step):
                    pass
                bad.extend((step, n) for i, (n, _) in enumerate(params)
                           if not bool((into[n] == step * 100 + i).all()))
        try:
            asyncio.run(run())
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)
    threads = [threading.Thread(target=trainer)] + \
        [threading.Thread(target=receiver, args=(r, d)) for r, d in zip(rs, dests)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(90)
        assert not errors, errors
        assert bad == []
    finally:
        _finalize(ts + rs)
