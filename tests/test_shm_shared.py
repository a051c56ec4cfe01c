"""shm: receivers copy a trainer's tensors that live in torch's shared memory straight out
of a mapping (``model.share_memory()``), falling back to cross-memory reads otherwise."""

import asyncio
import contextlib
import multiprocessing as mp
import os
import traceback

import pytest
import torch

from weightsync import CheckpointEngineRegistry
from weightsync.core.wire import BucketMsg, decode, encode
from weightsync.transport.base import worker_kwargs
from weightsync.transport.peermem import PeerMaps, shared_ref

pytestmark = pytest.mark.timeout(120)

BUCKET = 1 << 20


def _tensors(step: int, names: tuple) -> dict:
    g = torch.Generator().manual_seed(1000 + step)
    out = {}
    for i, name in enumerate(names):
        n = (3 << 18) + 4096 * i               # 3 MiB-ish fp32: direct at a 1 MiB threshold
        out[name] = torch.randn(n, generator=g)
    out["small"] = torch.randn(100, generator=g)  # through the ring
    return out


def _worker(role, conn, rank, mode, steps):
    """mode: "shared" (trainer tensors in shared memory, updated in place), "private",
    "renew" (new shared tensors under new names every sync). Tensors of 1 MiB or more go
    direct."""
    try:
        eng = CheckpointEngineRegistry.new("shm", role=role, bucket_size=BUCKET, timeout=60,
                                           direct=True, direct_min_bytes=1 << 20)
        conn.send(eng.prepare())
        eng.init_process_group(**conn.recv())
        loop = asyncio.new_event_loop()
        out = []
        held = None
        for step in range(steps):
            names = tuple(f"w{step if mode == 'renew' else 0}.{i}" for i in range(3))
            want = _tensors(step, names)
            if role == "trainer":
                if mode == "renew" or held is None:
                    held = {n: t.clone() for n, t in want.items()}
                    if mode != "private":
                        for t in held.values():
                            t.share_memory_()
                for n, t in want.items():
                    held[n].copy_(t)           # in place, as an optimizer step does
                loop.run_until_complete(eng.send_weights(held.items(), version=step))
                continue
            params = {n: torch.zeros_like(t) for n, t in want.items()}

            async def rx():
                async for _ in eng.receive_into(params, version=step):
                    pass
            loop.run_until_complete(rx())
            bad = [n for n in want if not torch.equal(params[n], want[n])]
            out.append({"bad": bad, "maps": len(eng._peer_maps)})
        eng.finalize()
        conn.send(out)
    except BaseException:
        conn.send(traceback.format_exc())


@contextlib.contextmanager
def _group(target, receivers, *args):
    """A trainer and ``receivers`` rollout processes running ``target(role, conn, rank,
    *args)``, joined into one shm group; yields their pipes (trainer first)."""
    ctx = mp.get_context("spawn")
    pipes, procs = [], []
    try:
        for i in range(receivers + 1):
            a, b = ctx.Pipe()
            p = ctx.Process(target=target, daemon=True,
                            args=("trainer" if i == 0 else "rollout", b, i - 1, *args))
            p.start()
            pipes.append(a)
            procs.append(p)
        metas = [c.recv() for c in pipes]
        tk, rk = CheckpointEngineRegistry.get("shm").build_topology(1, receivers, metas)
        pipes[0].send(worker_kwargs(tk, 0))
        for j in range(receivers):
            pipes[j + 1].send(worker_kwargs(rk, j))
        yield pipes
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()


def _results(target, receivers, *args):
    """Every process's reply (a list of per-step results each; a traceback fails)."""
    with _group(target, receivers, *args) as pipes:
        results = [c.recv() if c.poll(100) else "no answer" for c in pipes]
    for r in results:
        assert isinstance(r, list), r
    return results


def _run(mode, steps=3):
    tx, rx = _results(_worker, 1, mode, steps)
    assert tx == [], tx
    return rx


def _cma_ok():
    from weightsync.transport.fastcopy import cma_available
    t = torch.arange(16, dtype=torch.uint8)
    return cma_available(os.getpid(), t.data_ptr(), t.numpy().tobytes())


@pytest.fixture
def direct():
    if not _cma_ok():
        pytest.skip("this kernel does not let processes read each other (no direct tensors)")


def test_shared_trainer_tensors_are_copied_out_of_a_mapping(direct):
    steps = _run("shared")
    assert [s["bad"] for s in steps] == [[], [], []]
    assert [s["maps"] for s in steps] == [3] * 3    # mapped once, kept between syncs


def test_private_trainer_tensors_are_read_as_before(direct):
    steps = _run("private")
    assert [s["bad"] for s in steps] == [[], [], []]
    assert [s["maps"] for s in steps] == [0, 0, 0]


def test_a_receiver_keeps_no_more_than_one_syncs_mappings(direct):
    # the trainer frees its shared tensors and shares new ones every sync: the receiver
    # must not keep the old files alive through its mappings
    steps = _run("renew", steps=4)
    assert [s["bad"] for s in steps] == [[]] * 4
    assert [s["maps"] for s in steps] == [3] * 4


def test_shared_ref_names_only_storages_shared_by_descriptor():
    t = torch.arange(4096, dtype=torch.float32)
    assert shared_ref(t) is None                       # private memory
    t.share_memory_()
    fd, inode, size, off = shared_ref(t[1024:2048])
    assert (size, off) == (4096 * 4, 1024 * 4) and inode == os.fstat(fd).st_ino
    assert shared_ref(t.view(64, 64).t()) is None      # not contiguous
    maps = PeerMaps()
    view = maps.view(os.getpid(), (fd, inode, size, off))
    assert view is not None and torch.equal(view[off:off + 4096].view(torch.float32),
                                            t[1024:2048])
    t[1024] = -1.0                                     # the same memory, not a copy
    assert view[off:off + 4].view(torch.float32).item() == -1.0
    assert maps.view(os.getpid(), (fd, inode + 1, size, off)) is None   # fd reused: refused
    assert maps.view(os.getpid(), (10 ** 6, inode, size, off)) is None  # no such fd
    assert len(maps) == 1 and maps.end_sync() == 0 and maps.end_sync() == 1 and len(maps) == 0


def test_shared_ref_does_not_move_a_storage_shared_another_way():
    before = torch.multiprocessing.get_sharing_strategy()
    t = torch.arange(1024, dtype=torch.float32)
    torch.multiprocessing.set_sharing_strategy("file_system")
    try:
        t.share_memory_()
    finally:
        torch.multiprocessing.set_sharing_strategy(before)
    ptr = t.data_ptr()
    assert shared_ref(t) is None and t.data_ptr() == ptr


def test_the_shared_field_round_trips_and_is_checked():
    from weightsync.core.errors import WireError
    msg = BucketMsg(version=1, seq=1, stream=0, index=5, slot=0, nbytes=8, layout="direct",
                    shared=(5, 77, 4096, 128))
    assert decode(encode(msg)) == msg
    assert decode(encode(BucketMsg(version=1, seq=1, stream=0, index=5, slot=0, nbytes=8,
                                   layout="x"))).shared is None
    bad = encode(msg).replace(b"[5,77,4096,128]", b"[5,77,-1,128]")
    with pytest.raises(WireError):
        decode(bad)


# -- pushes: the trainer writes straight into receivers' shared tensors ----------------------

def _push_worker(role, conn, rank, opts, steps):
    try:
        eng = CheckpointEngineRegistry.new("shm", role=role, bucket_size=BUCKET, timeout=60)
        conn.send(eng.prepare())
        eng.init_process_group(**conn.recv())
        loop = asyncio.new_event_loop()
        out = []
        names = ("w.0", "w.1", "w.2")
        params = None
        for step in range(steps):
            want = _tensors(step, names)
            if role == "trainer":
                report = loop.run_until_complete(eng.send_weights(want.items(), version=step))
                out.append(report["pushed"])
                continue
            if params is None:
                params = {n: torch.zeros_like(t) for n, t in want.items()}
                share = opts["share"][rank]
                for i, (n, t) in enumerate(params.items()):
                    if share == "all" or (share == "half" and i % 2 == 0):
                        t.share_memory_()
            if step and opts.get("late"):
                import time
                time.sleep(opts["late"])        # the trainer sent this step meanwhile
            before = [n for n in want if step and not torch.equal(params[n], _tensors(step - 1, names)[n])]

            async def rx():
                async for _ in eng.receive_into(params, version=step):
                    pass
            loop.run_until_complete(rx())
            bad = [n for n in want if not torch.equal(params[n], want[n])]
            out.append({"bad": bad, "changed_early": before})
        eng.finalize()
        conn.send(out)
    except BaseException:
        conn.send(traceback.format_exc())


def _run_push(opts, receivers=1, steps=3):
    results = _results(_push_worker, receivers, opts, steps)
    return results[0], results[1:]


def _exact(rx):
    for steps in rx:
        assert [s["bad"] for s in steps] == [[]] * len(steps)


def test_the_trainer_writes_into_a_receivers_shared_tensors():
    if not _cma_ok():
        pytest.skip("this kernel does not let processes open each other's descriptors")
    tx, rx = _run_push({"share": ["all"]})
    assert tx == [4] * 3          # every tensor, the small one too: no bucket at all
    _exact(rx)


def test_pushes_wait_for_the_receiver_to_begin_its_receive(monkeypatch):
    # the receiver comes late to every sync after the first: the trainer must not write
    # into its tensors (which a rollout engine may be generating with) before it asks
    if not _cma_ok():
        pytest.skip("this kernel does not let processes open each other's descriptors")
    tx, rx = _run_push({"share": ["all"], "late": 1.0})
    assert tx == [4, 4, 4]
    _exact(rx)
    assert [s["changed_early"] for s in rx[0]] == [[], [], []]


def test_only_what_every_receiver_offers_is_pushed(monkeypatch):
    if not _cma_ok():
        pytest.skip("this kernel does not let processes open each other's descriptors")
    tx, rx = _run_push({"share": ["half", "all"]}, receivers=2)
    assert tx == [2, 2, 2]             # w.0 and w.2: receiver 0 shares every other tensor
    _exact(rx)
    tx, rx = _run_push({"share": ["none", "all"]}, receivers=2, steps=2)
    assert tx == [0, 0]
    _exact(rx)


def test_a_land_message_is_checked():
    from weightsync.core.errors import WireError
    from weightsync.core.wire import LandMsg
    msg = LandMsg(seq=3, rank=1, digest="d", landings=(("w", (4, 4), "float32", 5, 9, 64, 0),))
    assert decode(encode(msg)) == msg
    with pytest.raises(WireError):      # 64 bytes at offset 8 run past a 64-byte storage
        decode(encode(LandMsg(seq=3, rank=1, digest="d",
                              landings=(("w", (4, 4), "float32", 5, 9, 64, 8),))))


def _fault_worker(role, conn, rank, fault):
    try:
        eng = CheckpointEngineRegistry.new("shm", role=role, bucket_size=BUCKET, timeout=4)
        conn.send(eng.prepare())
        eng.init_process_group(**conn.recv())
        loop = asyncio.new_event_loop()
        want = _tensors(0, ("w.0", "w.1", "w.2"))
        if role == "trainer":
            import time
            start = time.monotonic()
            try:
                loop.run_until_complete(eng.send_weights(want.items(), version=0))
                conn.send({"error": None})
            except Exception as exc:
                conn.send({"error": type(exc).__name__, "text": str(exc),
                           "peer": getattr(exc, "peer", None), "s": time.monotonic() - start})
            eng.finalize()
            return
        params = {n: torch.zeros_like(t).share_memory_() for n, t in want.items()}
        if fault == "never":
            conn.send({})                   # never begins receiving; stays alive
            conn.recv()
            return

        async def rx():
            async for _ in eng.receive_into(params, version=0):
                os._exit(3)                 # dies with the sync under way
        conn.send({})
        loop.run_until_complete(rx())
    except BaseException:
        conn.send({"error": traceback.format_exc()})


@pytest.mark.parametrize("fault,error", [("never", "SyncTimeout"), ("dies", None)])
def test_a_receiver_that_never_begins_or_dies_fails_the_push_sync_naming_it(fault, error):
    if not _cma_ok():
        pytest.skip("this kernel does not let processes open each other's descriptors")
    with _group(_fault_worker, 1, fault) as pipes:
        assert pipes[1].poll(60)
        pipes[1].recv()
        assert pipes[0].poll(60), "the trainer hung"
        got = pipes[0].recv()
        if fault == "never":
            pipes[1].send("quit")
    assert got["error"] is not None and got["peer"] == "rollout rank 0", got
    if error:
        assert got["error"] == error and "did not start receiving" in got["text"], got
    assert got["s"] < 30, got


@pytest.mark.timeout(240)
@pytest.mark.parametrize("trainers,receivers,pattern", [(2, 2, "full"), (2, 2, "disjoint"),
                                                         (1, 3, "full")])
@pytest.mark.parametrize("consume", ["into-shared", "into"])
def test_every_dtype_and_shape_lands_with_receivers_sharing_their_tensors(
        trainers, receivers, pattern, consume):
    """The conformance tensors (every dtype, chunked and strided ones, tiny ones) through
    several trainer ranks into receivers that share their tensors: pushed where they
    can be, the ring for the rest, bit-exact every sync."""
    from weightsync.testing import GroupSpec, run_group
    spec = GroupSpec(backend="shm", trainers=trainers, receivers=receivers, steps=3,
                     pattern=pattern, consume=consume, tiny=20,
                     engine_kwargs={"bucket_size": 64 * 1024, "timeout": 60})
    results = run_group(spec)
    pushed = []                         # per trainer rank: tensors pushed at each step
    for r in results:
        assert "fatal" not in r, r.get("fatal")
        assert not r["errors"], (r["role"], r["rank"], r["errors"])
        if r["role"] == "rollout":
            for step in r["steps"]:
                assert not step["missing"] and not step["dupes"] and not step["bad"], step
        else:
            pushed.append([s["pushed"] for s in r["steps"]])
    if consume == "into-shared" and _cma_ok():
        # once ownership split the tensors (after the first sync of "full"), each rank
        # pushes its own, the same every sync
        assert sum(map(sum, pushed)) > 0 and all(len(set(p[1:])) == 1 for p in pushed), pushed
    else:
        assert sum(map(sum, pushed)) == 0
