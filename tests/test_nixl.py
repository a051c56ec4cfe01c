"""The nixl backend beyond the conformance suite: its wire messages, faults inside a pull,
consistent reads, bad layouts, FSDP2 shards served as they are, wrong tokens."""

import json
import multiprocessing as mp
import os

import pytest
import torch

from weightsync import CheckpointEngineRegistry
from weightsync.core.errors import AuthenticationError, WeightSyncError, WireError
from weightsync.core.wire import (PulledMsg, PullMsg, SourceMsg, StagedMsg, WantsMsg, decode,
                                  encode)
from weightsync.testing import GroupSpec, run_group
from syncchecks import assert_clean

pytest.importorskip("nixl")

BUCKET = 64 * 1024


def _spec(hook=None, **kw):
    engine_kwargs = {"bucket_size": BUCKET, "timeout": 20, **kw.pop("engine_kwargs", {})}
    kw.setdefault("timeout", 90)
    kw.setdefault("steps", 3)
    kw.setdefault("receivers", 2)
    return GroupSpec(backend="nixl", hook=hook, tiny=100, engine_kwargs=engine_kwargs, **kw)


# -- wire -------------------------------------------------------------------------------------

def test_messages_round_trip_and_reject_bad_fields():
    src = SourceMsg(seq=1, stream=0, agent="a", metadata="bWV0YQ==", mem="DRAM", digest="d",
                    regions=(("b0", 4096, 1024, 0),),
                    held=(("w", (4, 2), "bfloat16", 0, 8, "b0", 0),
                          ("o", (4, 6), "bfloat16", 0, 12, "b0", 16, ((0, 4), (3, 6)))))
    assert decode(encode(src)) == src
    for msg in (PullMsg(version=3, seq=2, stream=1, digest="d"),
                PullMsg(version=3, seq=2, stream=1, digest="d", staged=False),
                StagedMsg(seq=2, stream=1, blocks=("b0", "own")),
                PulledMsg(seq=2, stream=1, rank=0, nbytes=10, plan="p"),
                WantsMsg(rank=1, wants=(("o", (((0, 4), (3, 6)),)),
                                        ("d", (((0, 2), (0, 3)), ((2, 4), (0, 3)))), ("e", ()))),
                WantsMsg(rank=0)):
        assert decode(encode(msg)) == msg
    wants = json.loads(encode(WantsMsg(rank=1, wants=(("o", (((0, 4), (3, 6)),)),))))
    for bad in ([["o", [[[0, 4], [6, 3]]]]], [["o", [[[0, 4]], [[0, 1], [0, 1]]]]],
                [["", [[[0, 1]]]]], [["o", [[[0, -1]]]]], [["o"]], "o"):
        with pytest.raises(WireError):
            decode(json.dumps({**wants, "wants": bad}))
    staged = json.loads(encode(StagedMsg(seq=2, stream=1, blocks=("b0",))))
    for bad in ([1], "b0", [""], ["x" * 300]):
        with pytest.raises(WireError):
            decode(json.dumps({**staged, "blocks": bad}))
    pull = json.loads(encode(PullMsg(version=3, seq=2, stream=1, digest="d")))
    with pytest.raises(WireError):
        decode(json.dumps({**pull, "staged": 1}))
    body = json.loads(encode(src))
    for field, bad in (("held", [["w", [4, 2], "bfloat16", 0, 9, "b0", 0]]),   # past the shape
                       ("held", [["w", [4, 2], "nope", 0, 8, "b0", 0]]),
                       ("held", [["o", [4, 6], "bfloat16", 0, 12, "b0", 0, [[0, 4], [3, 7]]]]),
                       ("held", [["o", [4, 6], "bfloat16", 0, 11, "b0", 0, [[0, 4], [3, 6]]]]),
                       ("held", [["o", [4, 6], "bfloat16", 0, 12, "b0", 0, [[0, 4]]]]),
                       ("regions", [["b0", -1, 1024, 0]]),
                       ("mem", "HBM")):
        with pytest.raises(WireError):
            decode(json.dumps({**body, field: bad}))


# -- faults inside a pull -------------------------------------------------------------------

@pytest.mark.timeout(150)
def test_rollout_killed_mid_pull_is_named_by_the_trainer():
    trainer, r0, r1 = run_group(_spec("faults:nixl_kill_rollout_1_mid_pull"))
    assert r1 == {"died": 17}
    assert len(trainer["steps"]) == 1 and trainer["errors"], trainer
    assert trainer["errors"][0].startswith("PeerFailed") and "rollout rank 1" in trainer["errors"][0]
    # rollout rank 0's one-sided reads do not wait for rank 1: it read all of that version
    # before the trainer went away (then its next sync fails), or it was still reading
    # (then that pull fails); either way a PeerFailed, not a hang
    assert len(r0["steps"]) in (1, 2) and r0["errors"], r0
    assert r0["errors"][0].startswith("PeerFailed"), r0["errors"]
    # the trainer hears of the death on its link, well before its timeout (20 s)
    assert trainer["failed_after_s"] < 10, trainer


@pytest.mark.timeout(150)
def test_trainer_killed_mid_pull_is_named_by_every_receiver():
    trainer, r0, r1 = run_group(_spec("faults:nixl_kill_trainer_0_mid_pull"))
    assert trainer == {"died": 17}
    for r in (r0, r1):
        assert len(r["steps"]) == 1 and r["errors"], r
        assert "trainer rank 0" in r["errors"][0], r["errors"]
        assert r["errors"][0].startswith(("PeerFailed", "SyncTimeout")), r["errors"]


@pytest.mark.timeout(150)
def test_trainer_that_scribbles_right_after_send_never_corrupts_a_pull():
    """send_weights returns only when every pull of the version is done: served from the
    trainer's own memory and overwritten the moment it returns, every receiver still has
    exactly each version's bytes."""
    spec = _spec("faults:nixl_mutate_after_send", steps=4, receivers=3)
    results = run_group(spec)
    assert_clean(results, spec)


@pytest.mark.timeout(150)
def test_receivers_that_finished_and_left_do_not_fail_a_trainer_still_naming_blocks(
        tmp_path, monkeypatch):
    """Two trainers serve the same bytes; each receiver reads part from each, reports and
    leaves once its own blocks are read, while trainer rank 0 still names blocks (the
    flake of ``test_two_trainers[full-nixl]``: "lost the control link to rollout rank 1
    ([Errno 32] Broken pipe)"). Every sync of every rank is clean."""
    monkeypatch.setenv("WS_FAULT_DIR", str(tmp_path))
    spec = _spec("faults:nixl_receivers_leave_before_trainer_0_ends_its_last_sync",
                 trainers=2, steps=3)
    results = run_group(spec)
    assert_clean(results, spec)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rollout0", "rollout1"]


@pytest.mark.timeout(150)
def test_ranks_that_disagree_on_a_shape_are_a_plan_mismatch_before_any_read():
    spec = _spec("faults:nixl_shape_disagrees_on_rank_1", trainers=2, steps=1)
    results = run_group(spec)
    for r in results[2:]:
        assert r["errors"] and r["errors"][0].startswith("PlanMismatch"), r
        assert "rank 1 holds it as" in r["errors"][0], r["errors"]   # names what differs
    for t in results[:2]:
        assert t["errors"], t


# -- FSDP2 shards, served without a gather ----------------------------------------------------

def _fsdp_trainer(rank, port, conn):
    _sharded_trainer(rank, port, conn, None)


def _sharded_trainer(rank, port, conn, placements):
    """Two trainer ranks on a 1-D mesh syncing DTensors for two steps: ``Shard(0)`` (FSDP2)
    when ``placements`` is None, else per name ``Shard(dim)`` or, for None, ``Replicate``;
    sends each step's result (and, with ``placements``, what was logged as gathered)."""
    import asyncio
    import datetime
    import logging

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    gathered = []
    handler = logging.Handler()
    handler.emit = lambda record: gathered.append(record.getMessage())
    logging.getLogger("weightsync.transport.backends.nixl.layout").addHandler(handler)
    mesh = init_device_mesh("cpu", (2,))
    engine = CheckpointEngineRegistry.new("nixl", role="trainer", bucket_size=BUCKET, timeout=20)
    conn.send(engine.prepare())
    engine.init_process_group(**conn.recv())
    out = []
    for step in range(2):
        full = _fsdp_tensors(step)
        dims = placements or {n: 0 for n in full}
        shards = [(n, distribute_tensor(t, mesh, [Replicate() if dims[n] is None
                                                  else Shard(dims[n])]))
                  for n, t in full.items()]
        out.append(asyncio.run(engine.send_weights(iter(shards), step)))
    conn.send(out if placements is None else {"steps": out, "gathered": gathered})
    engine.finalize()
    dist.destroy_process_group()


def _fsdp_tensors(step):
    g = torch.Generator().manual_seed(step)
    shapes = {"embed": (1001, 64), "q": (64, 64), "odd": (7, 3), "bias": (64,), "big": (512, 256)}
    return {n: torch.randn(s, generator=g).to(torch.bfloat16) for n, s in shapes.items()}


def _receiver(rank, conn):
    import asyncio

    engine = CheckpointEngineRegistry.new("nixl", role="rollout", bucket_size=BUCKET, timeout=20)
    conn.send(engine.prepare())
    engine.init_process_group(**conn.recv())
    bad = []
    for step in range(2):
        want = _fsdp_tensors(step)

        async def go():
            return {n: t.clone() async for n, t in engine.receive_weights(step)}
        got = asyncio.run(go())
        bad += [n for n in want if n not in got or not torch.equal(got[n], want[n])]
    conn.send({"bad": bad, "plan": engine.last_plan.bytes_per_source()})
    engine.finalize()


def _fsdp_group(receiver, trainer=None):
    """Two FSDP2 trainer ranks (``trainer``, default ``_fsdp_trainer``) and two
    ``receiver`` processes in one nixl group; every process's result, trainers first."""
    from weightsync.transport.base import worker_kwargs

    ctx = mp.get_context("spawn")
    port = _free_port()
    pipes, procs = [], []
    for target, args in [(trainer or _fsdp_trainer, (i, port)) for i in range(2)] + \
            [(receiver, (j,)) for j in range(2)]:
        a, b = ctx.Pipe()
        procs.append(ctx.Process(target=target, args=(*args, b)))
        pipes.append(a)
    for p in procs:
        p.start()
    try:
        metas = [c.recv() for c in pipes]
        cls = CheckpointEngineRegistry.get("nixl")
        tk, rk = cls.build_topology(2, 2, metas)
        for i, c in enumerate(pipes):
            c.send(worker_kwargs(tk, i) if i < 2 else worker_kwargs(rk, i - 2))
        return [c.recv() for c in pipes]
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()


@pytest.mark.timeout(200)
def test_fsdp2_shards_are_served_as_they_are():
    results = _fsdp_group(_receiver)
    total = sum(t.numel() * 2 for t in _fsdp_tensors(0).values())
    trainers, receivers = results[:2], results[2:]
    for r in receivers:
        assert r["bad"] == [], r
        per_rank = r["plan"]
        assert sum(per_rank.values()) == total          # each receiver keeps everything
    for steps in trainers:
        # each rank holds only its Shard(0) rows: about half the model, nothing gathered
        assert steps[0]["held_bytes"] < 0.6 * total + 4 * BUCKET, steps[0]
        assert steps[1]["layout_sent"] is False
    served = [sum(s[1]["served"].values()) for s in trainers]
    assert abs(served[0] - served[1]) <= 0.1 * max(served), served


def _fsdp_model_trainer(rank, port, conn):
    """A real FSDP2 model (``fully_shard``), exported as the trainer mixin does for a
    backend that serves shards (``export_weights(shards=True)``), trained between syncs."""
    import asyncio
    import datetime

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from weightsync.core.digests import tensor_digest
    from weightsync.trainer.export import export_weights

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(1001, 64), torch.nn.Linear(64, 256),
                                torch.nn.Linear(256, 64, bias=False))
    fully_shard(model, mesh=init_device_mesh("cpu", (2,)))
    engine = CheckpointEngineRegistry.new("nixl", role="trainer", bucket_size=BUCKET, timeout=20)
    conn.send(engine.prepare())
    engine.init_process_group(**conn.recv())
    out, digests = [], []
    for step in range(3):
        with torch.no_grad():                 # a "training step": every parameter moves
            for p in model.parameters():
                p.mul_(1.0 + 0.1 * step).add_(0.01)
        digests.append({n: tensor_digest(p.full_tensor()) for n, p in model.named_parameters()})
        out.append(asyncio.run(engine.send_weights(export_weights(model, shards=True), step)))
    conn.send({"steps": out, "digests": digests})
    engine.finalize()
    dist.destroy_process_group()


def _digest_receiver(rank, conn):
    import asyncio

    from weightsync.core.digests import tensor_digest
    engine = CheckpointEngineRegistry.new("nixl", role="rollout", bucket_size=BUCKET, timeout=20)
    conn.send(engine.prepare())
    engine.init_process_group(**conn.recv())
    got = []
    for step in range(3):
        async def go():
            return {n: tensor_digest(t) async for n, t in engine.receive_weights(step)}
        got.append(asyncio.run(go()))
    conn.send(got)
    engine.finalize()


@pytest.mark.timeout(200)
def test_an_fsdp2_model_is_served_from_its_own_shards_from_the_first_sync():
    """The default ``auto`` serving with a real ``fully_shard`` model: each rank serves its
    parameters' local shards from their own storage from the first sync (the export marks
    them as parameters), so the trainer holds no staging memory at all (goal: <= 2
    buckets), nothing is gathered, the layout goes out once, every rank serves about as
    much as the other, and every receiver gets each step's full weights exactly."""
    results = _fsdp_group(_digest_receiver, trainer=_fsdp_model_trainer)
    trainers, receivers = results[:2], results[2:]
    for t in trainers:
        assert [s["held_bytes"] for s in t["steps"]] == [0, 0, 0], t["steps"]
        assert [s["layout_sent"] for s in t["steps"]] == [True, False, False]
    for got in receivers:
        assert got == trainers[0]["digests"]
    for step in range(3):
        served = [sum(t["steps"][step]["served"].values()) for t in trainers]
        assert abs(served[0] - served[1]) <= 0.1 * max(served), served


def _slice_keep(rank):
    """Rank 0 keeps row halves and a strided column box; rank 1 the other halves, nothing of
    'odd', and 'bias' whole (not listed)."""
    from weightsync.core.xferplan import Keep

    rows = lambda n: ((0, n // 2),) if rank == 0 else ((n // 2, n),)  # noqa: E731
    return Keep(boxes={"embed": ((rows(1001)[0], (0, 64)),),
                       "q": (((0, 64), (0, 32) if rank == 0 else (32, 64)),),
                       "odd": (((2, 5), (1, 3)),) if rank == 0 else (),
                       "big": ((rows(512)[0], (0, 256)), ((0, 8), (100, 140)))},
                notes=(f"rank {rank}",))


def _slice_receiver(rank, conn):
    import asyncio

    from weightsync.transport.tensors import partial_boxes

    engine = CheckpointEngineRegistry.new("nixl", role="rollout", bucket_size=BUCKET, timeout=20)
    conn.send(engine.prepare())
    engine.init_process_group(**conn.recv())
    seen = []
    engine.keep_slices(lambda tensors: seen.append(tensors) or _slice_keep(rank))
    keep, bad = _slice_keep(rank), []
    into = {"q": torch.zeros(64, 64, dtype=torch.bfloat16)}
    for step in range(2):
        want = _fsdp_tensors(step)

        async def go():
            return {n: t async for n, t in (engine.receive_into(into, step) if step
                                             else engine.receive_weights(step))}
        got = asyncio.run(go())
        for n, w in want.items():
            boxes = keep.of(n, w.shape)
            if n == "q" and step:
                if got[n] is not into["q"] or partial_boxes(got[n]) is not None:
                    bad.append(("not placed into the caller's", n))
            elif boxes != ((tuple((0, d) for d in w.shape)),) and partial_boxes(got[n]) != \
                    tuple(b for b in boxes if all(y > x for x, y in b)):
                bad.append(("boxes", n, partial_boxes(got[n])))
            for box in boxes:
                idx = tuple(slice(a, b) for a, b in box)
                if not torch.equal(got[n][idx], w[idx]):
                    bad.append((step, n, box))
    conn.send({"bad": bad, "plan": engine.last_plan.bytes_per_source(), "calls": len(seen),
               "names": sorted(n for n, _, _ in seen[0]), "notes": list(engine.last_plan.notes)})
    engine.finalize()


@pytest.mark.timeout(200)
def test_receivers_pull_only_the_boxes_they_keep_from_fsdp2_shards():
    """keep_slices: each receiver reads only its boxes (rows, a strided column block, none
    of a tensor, a tensor whole) from two FSDP2 ranks' Shard(0) rows; the boxes hold exactly
    the version's bytes, fresh tensors are marked with their boxes, receive_into places them
    into the caller's tensor, and the callable runs once per trainer layout."""
    import math

    results = _fsdp_group(_slice_receiver)
    shapes = {n: t.shape for n, t in _fsdp_tensors(0).items()}
    for rank, r in enumerate(results[2:]):
        assert r["bad"] == [], r
        assert r["calls"] == 1 and r["names"] == sorted(shapes), r
        keep = _slice_keep(rank)
        kept = sum(2 * math.prod(b - a for a, b in box) for n, s in shapes.items()
                   for box in keep.of(n, s))
        assert sum(r["plan"].values()) == kept, (r["plan"], kept)   # nothing more is read
        assert any(n.endswith(f"rank {rank}") for n in r["notes"]), r["notes"]


_TP_PLACEMENTS = {"embed": 0, "q": 0, "odd": 1, "bias": None, "big": 1}


def _tp_trainer(rank, port, conn):
    """Two tensor-parallel trainer ranks: column-parallel shards (dim 0), row-parallel ones
    (dim 1, one uneven), a replicated bias; served as they are, nothing gathered."""
    _sharded_trainer(rank, port, conn, _TP_PLACEMENTS)


@pytest.mark.timeout(200)
def test_tensor_parallel_shards_are_served_as_they_are():
    """A TP trainer's row-parallel shards (a column block: one run per row) and column-
    parallel ones are served from what each rank holds: nothing gathered, each rank holds
    about half the model, and receivers keeping other boxes read exactly those bytes."""
    import math

    results = _fsdp_group(_slice_receiver, trainer=_tp_trainer)
    model = _fsdp_tensors(0)
    total = sum(t.numel() * 2 for t in model.values())
    for t in results[:2]:
        assert t["gathered"] == [], t["gathered"]
        held = t["steps"][0]["tensor_bytes"]
        assert 0.45 * total < held < 0.55 * total + 2 * model["bias"].numel(), (held, total)
        # the receivers keep column halves of "q" (held here as dim-0 rows): told so in the
        # first sync, each rank stages its rows of "q" column half by column half from
        # the second, a new layout once
        assert t["steps"][1]["layout_sent"] is True
    for rank, r in enumerate(results[2:]):
        assert r["bad"] == [], r
        keep = _slice_keep(rank)
        kept = sum(2 * math.prod(b - a for a, b in box) for n, t in model.items()
                   for box in keep.of(n, t.shape))
        assert sum(r["plan"].values()) == kept, (r["plan"], kept)
        assert all(v > 0 for v in r["plan"].values()), r["plan"]


class _FakeMesh:
    def __init__(self, sizes, coord):
        self._sizes, self._coord = sizes, coord

    def size(self, i):
        return self._sizes[i]

    def get_coordinate(self):
        return list(self._coord)


class _FakeDTensor:
    """Shape, mesh, placements and a local shard cut by successive ``torch.chunk`` (what
    DTensor's Shard does per mesh dim): the ground truth ``local_box`` must match."""

    def __init__(self, full, sizes, coord, placements):
        self.shape, self.placements = full.shape, placements
        self.device_mesh = _FakeMesh(sizes, coord)
        local = full
        for i, p in enumerate(placements):
            if p.is_shard():
                parts = torch.chunk(local, sizes[i], dim=p.dim)
                local = parts[coord[i]] if coord[i] < len(parts) else local.narrow(p.dim, 0, 0)
        self._local = local

    def to_local(self):
        return self._local


@pytest.mark.parametrize("sizes,placements", [
    ((2,), ("S1",)), ((4,), ("S0",)), ((3,), ("S1",)), ((2, 2), ("S0", "S1")),
    ((2, 3), ("S0", "S0")), ((2, 2), ("R", "S2")), ((3, 2), ("S1", "S1"))])
def test_local_box_is_the_block_each_rank_holds(sizes, placements):
    import itertools

    from torch.distributed.tensor import Replicate, Shard

    from weightsync.transport.backends.nixl.layout import local_box

    full = torch.arange(5 * 7 * 6, dtype=torch.float32).reshape(5, 7, 6)
    pl = tuple(Replicate() if p == "R" else Shard(int(p[1])) for p in placements)
    for coord in itertools.product(*(range(n) for n in sizes)):
        t = _FakeDTensor(full, sizes, coord, pl)
        box = local_box(t)
        assert box is not None
        assert torch.equal(full[tuple(slice(a, b) for a, b in box)], t.to_local()), (coord, box)


def test_local_box_refuses_placements_that_are_not_a_block():
    from torch.distributed.tensor import Partial, Shard

    from weightsync.transport.backends.nixl.layout import local_box

    full = torch.zeros(4, 4)
    assert local_box(_FakeDTensor(full, (2,), (0,), (Partial(),))) is None

    class Strided(Shard):                 # FSDP2-over-TP's _StridedShard is a Shard subclass
        pass
    assert local_box(_FakeDTensor(full, (2,), (0,), (Strided(0),))) is None


def _fsdp_tp_boxes(rank, port, conn):
    """FSDP2 over TP on a (dp 2, tp 2) mesh: every parameter's local_box, checked against
    its full tensor (the ground truth), and its placements."""
    import datetime

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)

    from weightsync.transport.backends.nixl.layout import local_box

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=4,
                            timeout=datetime.timedelta(seconds=60))
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 36), torch.nn.ReLU(),
                                torch.nn.Linear(36, 10, bias=False))
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    out = []
    for name, p in model.named_parameters():
        box = local_box(p)
        full = p.full_tensor()
        ok = box is not None and torch.equal(full[tuple(slice(a, b) for a, b in box)],
                                             p.to_local())
        out.append((name, str(p.placements), box, ok))
    conn.send(out)
    dist.destroy_process_group()


@pytest.mark.timeout(200)
def test_fsdp2_over_tp_shards_are_blocks_of_the_full_tensor():
    ctx = mp.get_context("spawn")
    port = _free_port()
    pipes, procs = [], []
    for rank in range(4):
        a, b = ctx.Pipe()
        procs.append(ctx.Process(target=_fsdp_tp_boxes, args=(rank, port, b)))
        pipes.append(a)
    for p in procs:
        p.start()
    try:
        results = [c.recv() for c in pipes]
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    placements = {pl for r in results for _, pl, _, _ in r}
    assert any("_S(" in pl or "StridedShard" in pl for pl in placements), placements
    for r in results:
        assert all(ok for *_, ok in r), r


def _free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- tokens -------------------------------------------------------------------------------------

def test_wrong_store_token_is_refused_before_anything_is_registered():
    import threading

    from weightsync.transport.base import worker_kwargs

    cls = CheckpointEngineRegistry.get("nixl")
    trainer = cls(role="trainer", bucket_size=BUCKET, timeout=3)
    rollout = cls(role="rollout", bucket_size=BUCKET, timeout=3)
    try:
        tk, rk = cls.build_topology(1, 1, [trainer.prepare(), rollout.prepare()])
        entry = worker_kwargs(rk, 0)
        host, port, auth = entry["streams"][0]
        entry["streams"] = [[host, port, "0" * len(auth)]]
        failed = []

        def trainer_init():   # the trainer waits for a receiver that never joins
            try:
                trainer.init_process_group(**worker_kwargs(tk, 0))
            except Exception as exc:
                failed.append(exc)
        t = threading.Thread(target=trainer_init, daemon=True)
        t.start()
        with pytest.raises(AuthenticationError):
            rollout.init_process_group(**entry)
        assert rollout._agent is None                  # no NIXL agent, nothing registered
        t.join(10)
        assert failed and isinstance(failed[0], WeightSyncError), failed
    finally:
        rollout.finalize()
        trainer.finalize()


# -- serving from the trainer's own storage, landing in the receiver's own tensors -------------

def stable_params_hook(engine, role, rank):
    """Trainer: yield the same tensors every sync, refilled in place (as parameters are)."""
    if role == "trainer":
        engine._serve_mode = "auto"
        orig, held = engine.send_weights, {}

        async def wrapped(named_tensors, version=None):
            items = []
            for name, t in named_tensors:
                if name in held and held[name].shape == t.shape and t.is_contiguous():
                    held[name].copy_(t)
                elif t.is_contiguous():
                    held[name] = t
                items.append((name, held.get(name, t)))
            return await orig(iter(items), version)
        engine.send_weights = wrapped


@pytest.mark.timeout(150)
def test_auto_serving_settles_on_the_trainers_own_storage():
    spec = _spec("test_nixl:stable_params_hook", steps=4, receivers=1)
    results = run_group(spec)
    assert_clean(results, spec)
    sent = [s["layout_sent"] for s in results[0]["steps"]]
    # staged first, then served from its own storage (one new layout), then replayed
    assert sent == [True, True, False, False], sent
    assert results[0]["steps"][3]["held_bytes"] < results[0]["steps"][0]["held_bytes"]


def test_auto_serving_tells_a_temporary_at_a_reused_address_from_a_stable_tensor():
    """``auto`` serves a tensor from its own storage only if that storage lived on since
    the last sync: a fresh tensor over the same address (here: two tensors made over one
    buffer, as an allocator reusing a freed block gives) is staged, a kept one is served."""
    from weightsync.transport.backends.nixl.agent import NixlAgent
    from weightsync.transport.backends.nixl.layout import Arena

    agent = NixlAgent("ws-test-arena")
    arena = Arena(agent, 1 << 16, mode="auto")
    raw = bytearray(256 << 10)            # both over the size auto serves as they are
    kept = torch.ones(64 << 10)
    try:
        for step in range(3):
            temp = torch.frombuffer(raw, dtype=torch.float32)    # a new storage each sync
            arena.begin()
            arena.put("temp", temp, torch.float32)
            arena.put("kept", kept, torch.float32)
            arena.finish()
            regions = {e[0]: e[5] for e in arena.held()}
            assert regions["temp"].startswith("b"), (step, regions)      # staged
            assert regions["kept"].startswith("p" if step else "b"), (step, regions)
            del temp
    finally:
        arena.close()
        agent.close()


def _refilled(version, buf, names):
    """An export that refills one buffer for every name (a cast or gather buffer)."""
    for i, name in enumerate(names):
        buf.copy_(torch.full_like(buf, float(version * 100 + i)))
        yield name, buf


@pytest.mark.timeout(120)
def test_a_buffer_the_export_refills_for_every_name_is_staged_not_served():
    """Under ``auto`` the same storage alive from sync to sync is served as it is, unless
    several names come from it: then each name's bytes are staged when yielded. (Served
    as they are, every name read the last name's bytes: 105.0 six times in sync 1.)"""
    trainer, recv = _pair_here()
    buf, names = torch.empty(1 << 15), [f"w{i}" for i in range(6)]   # 128 KiB: may be served
    try:
        for v in range(3):
            got = _sync_here(trainer, recv, v, tensors=_refilled(v, buf, names))
            assert {n: float(t[0]) for n, t in got.items()} == \
                {n: float(v * 100 + i) for i, n in enumerate(names)}, v
            assert not trainer._arena.serves_live
    finally:
        trainer.finalize()
        recv.finalize()


@pytest.mark.timeout(120)
def test_an_export_that_starts_refilling_a_served_tensor_fails_the_sync_not_the_bytes():
    """A tensor served as it is (its storage lived on, one name) and then, within one
    sync, rewritten for the next name: the sync fails with IntegrityError naming both,
    on the trainer and the receiver; the next sync, staged anew, lands exact bytes."""
    import asyncio
    from concurrent.futures import ThreadPoolExecutor

    from weightsync.core.errors import IntegrityError, WeightSyncError

    trainer, recv = _pair_here()
    kept = {f"w{i}": torch.full((1 << 15,), float(i)) for i in range(3)}
    try:
        for v in range(2):                       # w0..w2 each from its own storage
            got = _sync_here(trainer, recv, v, tensors=list(kept.items()))
            assert {n: float(t[0]) for n, t in got.items()} == {"w0": 0.0, "w1": 1.0, "w2": 2.0}
        assert trainer._arena.serves_live
        names = list(kept)

        async def take():
            return {n: t.clone() async for n, t in recv.receive_weights(2)}
        with ThreadPoolExecutor(1) as pool:      # now w0's buffer is refilled for w1, w2
            got = pool.submit(asyncio.run, take())
            with pytest.raises(IntegrityError, match="'w1' was yielded over the bytes of 'w0'"):
                asyncio.run(trainer.send_weights(_refilled(2, kept["w0"], names), 2))
            with pytest.raises(WeightSyncError):
                got.result(60)
        fresh = {n: torch.full((1 << 15,), float(300 + i)) for i, n in enumerate(names)}
        got = _sync_here(trainer, recv, 3, tensors=list(fresh.items()))
        assert {n: float(t[0]) for n, t in got.items()} == {"w0": 300.0, "w1": 301.0, "w2": 302.0}
    finally:
        trainer.finalize()
        recv.finalize()


def _one_receiver_group(target, *args):
    """A trainer engine here and one receiver process (``target(*args, conn)``) in a
    nixl group: ``(trainer, conn, process)``; the caller joins and finalizes."""
    from weightsync.transport.base import worker_kwargs

    a, b = mp.get_context("spawn").Pipe()
    proc = mp.get_context("spawn").Process(target=target, args=(*args, b))
    proc.start()
    cls = CheckpointEngineRegistry.get("nixl")
    trainer = cls(role="trainer", bucket_size=BUCKET, timeout=20)
    if not a.poll(60):
        proc.kill()
        raise AssertionError(f"the receiver process sent no prepare() meta (exit {proc.exitcode})")
    tk, rk = cls.build_topology(1, 1, [trainer.prepare(), a.recv()])
    a.send(worker_kwargs(rk, 0))
    trainer.init_process_group(**worker_kwargs(tk, 0))
    return trainer, a, proc


def _receive_into_worker(conn):
    import asyncio

    from weightsync.testing import make_tensors
    engine = CheckpointEngineRegistry.new("nixl", role="rollout", bucket_size=BUCKET, timeout=20)
    conn.send(engine.prepare())
    engine.init_process_group(**conn.recv())
    want = dict(make_tensors(0, bucket_size=BUCKET, tiny=50))
    params = {n: torch.zeros_like(t) for n, t in want.items()}
    own = {n: p.data_ptr() for n, p in params.items()}

    async def go():
        return {n: t async for n, t in engine.receive_into(params, 0)}
    got = asyncio.run(go())
    same = [n for n, t in got.items() if t is params[n]]
    from weightsync.testing import same_bytes
    bad = [n for n in want if not same_bytes(params[n], want[n])]
    conn.send({"bad": bad, "same": len(same), "n": len(want), "direct": engine._pull_plan.direct,
               "moved": [n for n in own if params[n].data_ptr() != own[n]]})
    engine.finalize()


@pytest.mark.timeout(120)
def test_receive_into_pulls_straight_into_the_callers_tensors():
    import asyncio

    from weightsync.testing import make_tensors

    trainer, a, proc = _one_receiver_group(_receive_into_worker)
    try:
        asyncio.run(trainer.send_weights(make_tensors(0, bucket_size=BUCKET, tiny=50), 0))
        out = a.recv()
    finally:
        proc.join(30)
        trainer.finalize()
    assert out["bad"] == [] and out["moved"] == [], out
    assert out["same"] == out["n"]          # every tensor yielded is the caller's own
    assert out["direct"] > 0.5 * out["n"], out   # most landed there with no copy


# -- pipelined syncs --------------------------------------------------------------------------

def _layout(step):
    """Tensors over several 64 KiB staging blocks; at step 2 a middle one changes shape (the
    layout diverges half way through a pipelined sync), kept from then on."""
    g = torch.Generator().manual_seed(100 + step)
    shapes = [("a", (96, 128)), ("b", (200, 64)), ("c", (64, 64) if step < 2 else (80, 80)),
              ("d", (300, 50)), ("e", (7,))]
    return [(n, torch.randn(sh, generator=g)) for n, sh in shapes]


def _made(step):
    from weightsync.testing import make_tensors
    return list(make_tensors(step, bucket_size=BUCKET, tiny=20))


def _checking_receiver(expected, steps, conn):
    """Receive ``steps`` versions; report the tensors that differ from ``expected(step)``
    and how many pipelined pulls began again on a new layout."""
    import asyncio

    from weightsync.testing import same_bytes
    engine = CheckpointEngineRegistry.new("nixl", role="rollout", bucket_size=BUCKET, timeout=20)
    conn.send(engine.prepare())
    engine.init_process_group(**conn.recv())
    bad = []
    for step in range(steps):
        async def go():
            return {n: t.clone() async for n, t in engine.receive_weights(step)}
        got = asyncio.run(go())
        bad += [(step, n) for n, t in expected(step) if n not in got or not same_bytes(got[n], t)]
    conn.send({"bad": bad, "restarts": engine.restarts})
    engine.finalize()


@pytest.mark.timeout(120)
def test_pipelined_syncs_read_each_block_once_written_and_survive_a_layout_change(monkeypatch):
    """Warm syncs tell receivers to pull before staging and name each block once written;
    a layout that changes half way (blocks already being read) makes the receivers read
    the version again on the new layout; every version lands exactly."""
    import asyncio

    # every tensor staged (with ``auto`` a fresh tensor that lands where last sync's was
    # looks stable and is served from its storage: another layout change)
    monkeypatch.setenv("WEIGHTSYNC_NIXL_SERVE", "staging")
    trainer, a, proc = _one_receiver_group(_checking_receiver, _layout, 5)
    try:
        outs = [asyncio.run(trainer.send_weights(_layout(step), step)) for step in range(5)]
        got = a.recv()
    finally:
        proc.join(30)
        trainer.finalize()
    assert got["bad"] == [], got
    # published anew at step 0 (cold) and 2 (changed half way: the one restart)
    assert [o["layout_sent"] for o in outs] == [True, False, True, False, False]
    assert [o["pipelined"] for o in outs] == [False, True, True, True, True]
    assert got["restarts"] == 1


# -- elastic joiners ------------------------------------------------------------------------

def _joiner(conn):
    import asyncio

    from weightsync.testing import make_tensors, same_bytes
    engine = CheckpointEngineRegistry.new("nixl", role="rollout", bucket_size=BUCKET, timeout=20)
    engine.prepare()
    version, kwargs = conn.recv()
    engine.init_process_group(**kwargs)

    async def go():
        return {n: t.clone() async for n, t in engine.receive_weights(version)}
    got = asyncio.run(go())
    bad = [n for n, t in make_tensors(version, bucket_size=BUCKET, tiny=20)
           if not same_bytes(got[n], t)]
    again = None
    try:
        asyncio.run(go())
    except WeightSyncError as exc:
        again = str(exc)
    conn.send({"bad": bad, "n": len(got), "again": again})
    engine.finalize()


@pytest.mark.timeout(150)
def test_a_replica_joins_between_syncs_from_the_trainers_arena():
    """join_offer/join_topology: a new receiver pulls the version the trainer served last
    from its staging arena, without the group (the group's receiver is not involved); the
    trainer's next send waits for the joiner's lease to end; the joined engine receives
    once; a trainer serving live parameters refuses to offer."""
    import asyncio
    import threading
    import time

    from weightsync.testing import make_tensors

    ctx = mp.get_context("spawn")
    j_a, j_b = ctx.Pipe()
    joiner = ctx.Process(target=_joiner, args=(j_b,))
    joiner.start()
    cls = CheckpointEngineRegistry.get("nixl")
    trainer, a, member = _one_receiver_group(_checking_receiver, _made, 2)
    try:
        with pytest.raises(WeightSyncError, match="no complete version"):
            trainer.join_offer("replica-9")
        asyncio.run(trainer.send_weights(make_tensors(0, bucket_size=BUCKET, tiny=20), 0))
        offer = trainer.join_offer("replica-9", lease_s=30)
        kwargs = cls.join_topology([offer], 1)
        assert kwargs[0]["rank"] == 0 and kwargs[0]["join"][0]["version"] == 0
        j_a.send((0, kwargs[0]))
        # the next sync waits for the lease: released when the joiner reports
        sent = {}

        def send_next():
            sent["t0"] = time.monotonic()
            sent["out"] = asyncio.run(trainer.send_weights(
                make_tensors(1, bucket_size=BUCKET, tiny=20), 1))
            sent["t1"] = time.monotonic()

        result = j_a.recv()
        t = threading.Thread(target=send_next)
        t.start()
        time.sleep(0.5)
        assert "t1" not in sent                 # waiting for the lease
        released = time.monotonic()
        assert trainer.join_done(offer["lease"]) is True
        t.join(30)
        assert sent["t1"] >= released and sent["out"]["version"] == 1
        assert a.recv()["bad"] == []                 # the group's receiver got both versions
        assert result["bad"] == [] and result["n"] > 0, result
        assert "receives once" in result["again"]
        assert trainer.join_done(offer["lease"]) is False
    finally:
        for p in (member, joiner):
            p.join(30)
            if p.is_alive():
                p.kill()
        trainer.finalize()


@pytest.mark.timeout(120)
def test_a_trainer_serving_live_parameters_offers_no_join(monkeypatch):
    """WEIGHTSYNC_NIXL_SERVE=params serves the trainer's own storage, which training moves
    on from: no joiner may read a version from it (it gets the next sync)."""
    import asyncio

    from weightsync.testing import make_tensors

    monkeypatch.setenv("WEIGHTSYNC_NIXL_SERVE", "params")
    trainer, a, member = _one_receiver_group(_checking_receiver, _made, 1)
    try:
        asyncio.run(trainer.send_weights(make_tensors(0, bucket_size=BUCKET, tiny=20), 0))
        assert a.recv()["bad"] == []
        with pytest.raises(WeightSyncError, match="live parameters"):
            trainer.join_offer("replica-9")
    finally:
        member.join(30)
        trainer.finalize()


def _pair_here(device="cpu"):
    """A trainer and a receiver engine of one nixl group, both in this process."""
    from concurrent.futures import ThreadPoolExecutor

    from weightsync.transport.base import worker_kwargs
    cls = CheckpointEngineRegistry.get("nixl")
    trainer = cls(role="trainer", bucket_size=BUCKET, timeout=20, device=device)
    recv = cls(role="rollout", bucket_size=BUCKET, timeout=20, device=device)
    tk, rk = cls.build_topology(1, 1, [trainer.prepare(), recv.prepare()])
    with ThreadPoolExecutor(2) as pool:
        a = pool.submit(trainer.init_process_group, **worker_kwargs(tk, 0))
        b = pool.submit(recv.init_process_group, **worker_kwargs(rk, 0))
        a.result(60), b.result(60)
    return trainer, recv


def _sync_here(trainer, recv, version, into=None, tensors=None, clone=True):
    """One sync between the two engines of :func:`_pair_here` (``tensors``: what the
    trainer yields, default ``make_tensors(version)``); the receiver's tensors (cloned:
    views of its landing buffer are valid only until the next sync)."""
    import asyncio
    from concurrent.futures import ThreadPoolExecutor

    from weightsync.testing import make_tensors

    async def take():
        stream = recv.receive_weights(version) if into is None else recv.receive_into(into, version)
        return {n: t.clone() if clone else t async for n, t in stream}
    sent = tensors if tensors is not None else make_tensors(version, bucket_size=BUCKET, tiny=20)
    with ThreadPoolExecutor(2) as pool:
        got = pool.submit(asyncio.run, take())
        asyncio.run(trainer.send_weights(sent, version))
        return got.result(60)


@pytest.mark.timeout(150)
def test_a_receiver_serves_a_joiner_what_it_landed_and_its_next_pull_waits_for_the_lease():
    """A healthy receiver offers the version its last pull landed (landing buffer and the
    caller's own tensors alike); a joiner in another process reads exactly that version
    from it; the receiver's next pull does not overwrite it until the lease ends; an offer
    under a lease already ended is refused."""
    import threading
    import time

    from weightsync.testing import make_tensors
    cls = CheckpointEngineRegistry.get("nixl")
    trainer, recv = _pair_here()
    ctx = mp.get_context("spawn")
    j_a, j_b = ctx.Pipe()
    joiner = ctx.Process(target=_joiner, args=(j_b,))
    joiner.start()
    try:
        with pytest.raises(WeightSyncError, match="no complete version"):
            recv.join_offer("replica-9")
        half = {n: torch.zeros_like(t) for i, (n, t) in
                enumerate(make_tensors(0, bucket_size=BUCKET, tiny=20)) if i % 2}
        _sync_here(trainer, recv, 0, into=half)      # some land in `half`, some in landing
        assert 0 < recv._pull_plan.direct < len(recv._pull_plan.views)
        assert recv.join_done("ended-early") is False
        with pytest.raises(WeightSyncError, match="already ended"):
            recv.join_offer("replica-9", lease="ended-early")
        offer = recv.join_offer("replica-9", lease_s=30, lease="L1")
        assert offer["peer"] == "rollout rank 0" and offer["rank"] == 0
        assert [w[0] for w in cls.join_weights([offer])] == \
            [n for n, _ in make_tensors(0, bucket_size=BUCKET, tiny=20)]
        j_a.send((0, cls.join_topology([offer], 1)[0]))
        result = j_a.recv()
        assert result["bad"] == [] and result["n"] > 0, result
        # the next sync's pull waits for the lease before it writes anything
        done = {}

        def next_sync():
            done["got"] = _sync_here(trainer, recv, 1, into=half)
            done["t"] = time.monotonic()

        t = threading.Thread(target=next_sync)
        t.start()
        time.sleep(0.5)
        assert "t" not in done
        v0 = dict(make_tensors(0, bucket_size=BUCKET, tiny=20))
        assert all(torch.equal(half[n], v0[n]) for n in half)      # still version 0
        released = time.monotonic()
        assert recv.join_done("L1") is True
        t.join(60)
        assert done["t"] >= released
        want = dict(make_tensors(1, bucket_size=BUCKET, tiny=20))
        assert all(torch.equal(done["got"][n], want[n]) for n in want)
    finally:
        joiner.join(30)
        if joiner.is_alive():
            joiner.kill()
        recv.finalize()
        trainer.finalize()


@pytest.mark.timeout(150)
def test_a_receiver_keeping_slices_offers_no_join():
    """A receiver that keeps some tensor only in part holds no whole copy to serve."""
    from weightsync.core.xferplan import Keep
    trainer, recv = _pair_here()
    try:
        def keep(layout):
            name, shape, _ = next(e for e in layout if len(e[1]) == 2 and e[1][0] >= 2)
            return Keep(boxes={name: (((0, shape[0] // 2), (0, shape[1])),)})
        recv.keep_slices(keep)
        _sync_here(trainer, recv, 0)
        with pytest.raises(WeightSyncError, match="only in part"):
            recv.join_offer("replica-9")
    finally:
        recv.finalize()
        trainer.finalize()


def _group_here(receivers, device="cpu"):
    """A trainer and ``receivers`` receiver engines of one nixl group, in this process."""
    from concurrent.futures import ThreadPoolExecutor

    from weightsync.transport.base import worker_kwargs
    cls = CheckpointEngineRegistry.get("nixl")
    trainer = cls(role="trainer", bucket_size=BUCKET, timeout=20, device=device)
    recvs = [cls(role="rollout", bucket_size=BUCKET, timeout=20, device=device)
             for _ in range(receivers)]
    tk, rk = cls.build_topology(1, receivers, [e.prepare() for e in [trainer, *recvs]])
    with ThreadPoolExecutor(1 + receivers) as pool:
        jobs = [pool.submit(trainer.init_process_group, **worker_kwargs(tk, 0))]
        jobs += [pool.submit(r.init_process_group, **worker_kwargs(rk, j))
                 for j, r in enumerate(recvs)]
        for j in jobs:
            j.result(60)
    return trainer, recvs


def _sync_group(trainer, recvs, version, sent, into):
    import asyncio
    from concurrent.futures import ThreadPoolExecutor

    async def take(recv, dest):
        return {n: t.clone() async for n, t in recv.receive_into(dest, version)}
    with ThreadPoolExecutor(len(recvs)) as pool:
        got = [pool.submit(asyncio.run, take(r, d)) for r, d in zip(recvs, into)]
        stats = asyncio.run(trainer.send_weights(list(sent.items()), version))
        return stats, [g.result(60) for g in got]


def _tp_cut_case(ranks=2):
    """Column-split "w" (a row-parallel weight: one run per row of each box), row-split "c"
    (one run already), "n" whole, as two TP workers keep them."""
    from weightsync.core.xferplan import Keep

    def keep(rank):
        return Keep(boxes={"w": (((0, 64), (48 * rank, 48 * rank + 48)),),
                           "c": (((40 * rank, 40 * rank + 40), (0, 24)),)})

    def tensors(step):
        g = torch.Generator().manual_seed(step)
        return {"w": torch.randn(64, 96, generator=g).to(torch.bfloat16),
                "c": torch.randn(80, 24, generator=g), "n": torch.randn(7, generator=g)}
    return keep, tensors


@pytest.mark.timeout(150)
def test_boxes_every_receiver_keeps_are_staged_box_by_box_one_read_each():
    """Two TP receivers keep column halves of a weight (64 runs of a row each to read):
    they tell the trainer, which from the next sync stages that weight half by half (a new
    layout, once), so each receiver reads its half in one piece; bytes exact throughout,
    the receivers' own shards replayed, the keep callable run once."""
    keep, tensors = _tp_cut_case()
    trainer, recvs = _group_here(2)
    calls = [0, 0]
    try:
        for j, r in enumerate(recvs):
            r.keep_slices(lambda layout, j=j: calls.__setitem__(j, calls[j] + 1) or keep(j))
        into = [{"w": torch.zeros(64, 48, dtype=torch.bfloat16), "c": torch.zeros(40, 24),
                 "n": torch.zeros(7)} for _ in recvs]
        reads, layout_sent = [], []
        for step in range(4):
            sent = tensors(step)
            stats, got = _sync_group(trainer, recvs, step, sent, into)
            layout_sent.append(stats["layout_sent"])
            reads.append([len(r.last_plan.reads) for r in recvs])
            for j, g in enumerate(got):
                for n, w in sent.items():
                    box = keep(j).of(n, w.shape)[0]
                    assert torch.equal(g[n], w[tuple(slice(a, b) for a, b in box)]), (step, j, n)
        assert reads[0] == [64 + 1 + 1] * 2, reads        # a read per row of w's half
        assert reads[1:] == [[3, 3]] * 3, reads            # w, c, n: one read each
        assert layout_sent == [True, True, False, False], layout_sent
        held = [e for e in trainer._arena.held() if e[0] == "w"]
        assert [e[7] for e in held] == [[[0, 64], [0, 48]], [[0, 64], [48, 96]]], held
        assert calls == [1, 1], calls
        # a receiver that keeps w whole again: the trainer stops cutting it
        recvs[1].keep_slices(None)
        into[1] = {}
        for step in (4, 5):
            stats, got = _sync_group(trainer, recvs, step, tensors(step), into)
            assert torch.equal(got[1]["w"], tensors(step)["w"])
        assert [e[7:] for e in trainer._arena.held() if e[0] == "w"] == [()]
    finally:
        for e in (*recvs, trainer):
            e.finalize()


def test_cut_pieces_only_for_a_partition_with_a_strided_box():
    from weightsync.transport.backends.nixl.layout import cut_pieces
    t = torch.arange(24.).reshape(4, 6)
    halves = (((0, 4), (0, 3)), ((0, 4), (3, 6)))
    pieces = cut_pieces(t, 0, 24, (4, 6), None, halves)
    assert [p for p, _ in pieces] == list(halves)
    assert torch.equal(pieces[1][1], t[:, 3:])
    # rows 2..4 held (an FSDP2 shard): each half meets them
    rows = cut_pieces(t[2:], 12, 24, (4, 6), None, halves)
    assert [p for p, _ in rows] == [((2, 4), (0, 3)), ((2, 4), (3, 6))]
    assert torch.equal(rows[1][1], t[2:, 3:])
    assert cut_pieces(t, 0, 24, (4, 6), None, (((0, 2), (0, 6)), ((2, 4), (0, 6)))) is None
    assert cut_pieces(t, 0, 24, (4, 6), None, halves[:1]) is None            # no cover
    assert cut_pieces(t, 0, 24, (4, 6), None, (((0, 4), (0, 4)), ((0, 4), (2, 6)))) is None
    assert cut_pieces(t[1:3], 6, 18, (4, 6), None, halves) is not None
    assert cut_pieces(t, 3, 9, (4, 6), None, halves) is None    # not whole rows


def _shard_case(device):
    """Three tensors a TP-2 worker (rank 1) keeps as one box each, its own shards of them
    (contiguous, of the box's shape; one column shard given as a transposed view), and
    what the trainer yields at a step."""
    from weightsync.core.xferplan import Keep
    keep = Keep(boxes={"col": (((40, 80), (0, 24)),),        # rows: one read
                       "row": (((0, 32), (12, 24)),),        # a column block: strided reads
                       "tview": (((0, 16), (5, 10)),)})
    shards = {"col": torch.zeros(40, 24, device=device),
              "row": torch.zeros(32, 12, dtype=torch.bfloat16, device=device),
              "tview": torch.zeros(5, 16, device=device).t(),  # box shape, not contiguous
              "whole": torch.zeros(7, device=device)}

    def tensors(step):
        g = torch.Generator().manual_seed(step)
        return [("col", torch.randn(80, 24, generator=g).to(device)),
                ("row", torch.randn(32, 24, generator=g).to(torch.bfloat16).to(device)),
                ("tview", torch.randn(16, 10, generator=g).to(device)),
                ("whole", torch.randn(7, generator=g).to(device))]
    return keep, shards, tensors


def _check_shards_land(device):
    keep, shards, tensors = _shard_case(device)
    ptrs = {n: t.data_ptr() for n, t in shards.items()}
    trainer, recv = _pair_here(device)
    try:
        recv.keep_slices(lambda layout: keep)
        for step in range(3):
            sent = dict(tensors(step))
            got = _sync_here(trainer, recv, step, into=shards, tensors=list(sent.items()),
                             clone=False)
            for n, w in sent.items():
                box = keep.boxes.get(n, (tuple((0, d) for d in w.shape),))[0]
                want = w[tuple(slice(a, b) for a, b in box)]
                assert got[n] is shards[n], n          # the worker's own tensor, yielded
                assert torch.equal(shards[n], want), (step, n)
            assert {n: t.data_ptr() for n, t in shards.items()} == ptrs
            plan = recv._pull_plan
            # col, row and whole land straight in the shards; tview (not contiguous)
            # goes through the landing buffer, which holds only its box
            assert plan.direct == 3, plan.direct
            assert plan.landing.numel() == 512, plan.landing.numel()   # 320 B, aligned
            assert plan.plan.total_bytes == sum(t.numel() * t.element_size()
                                                for t in shards.values())
        assert recv._pull_plan is plan                 # replayed, not recompiled
    finally:
        recv.finalize()
        trainer.finalize()


def test_a_cuda_device_without_index_is_the_current_one(monkeypatch):
    """device="cuda" must compare equal to the tensors made on the current device (else
    nothing lands straight in the caller's VRAM tensors; found on two H200s)."""
    from weightsync.transport.tensors import resolve_device
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert resolve_device("cuda") == torch.device("cuda", 1)
    assert resolve_device("cuda:0") == torch.device("cuda", 0)
    assert resolve_device("cpu") == torch.device("cpu")


@pytest.mark.timeout(150)
def test_tensor_parallel_shards_land_straight_in_the_workers_own_tensors():
    """receive_into with a worker's own shards (tensors of the kept box's shape): the box's
    bytes land in them, no full-shape tensor, the plan read only the boxes and replays."""
    _check_shards_land("cpu")


def test_join_topology_refuses_offers_that_do_not_fit():
    cls = CheckpointEngineRegistry.get("nixl")
    offer = {"rank": 0, "version": 3, "lease": "x", "lease_s": 5.0, "source": "{}"}
    with pytest.raises(ValueError, match="ranks 0..1"):
        cls.join_topology([offer, dict(offer)], 1)
    from weightsync.core.errors import VersionMismatch
    with pytest.raises(VersionMismatch):
        cls.join_topology([offer, dict(offer, rank=1, version=4)], 1)
    with pytest.raises(ValueError):
        cls.join_topology([], 1)


# -- on a GPU (run on the device: pytest -m gpu) ----------------------------------------------

@pytest.mark.gpu
@pytest.mark.timeout(300)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("trainers,receivers", [(1, 1), (2, 2)])
def test_vram_to_vram_every_dtype_three_syncs(trainers, receivers):
    """Trainer tensors in VRAM, landing buffers in VRAM (UCX picks how; on one GPU two
    processes cannot use cuda_ipc, so this checks bytes, not speed)."""
    spec = _spec(None, trainers=trainers, receivers=receivers, steps=3, device="cuda",
                 engine_kwargs={"device": "cuda", "timeout": 60}, timeout=240)
    assert_clean(run_group(spec), spec)


@pytest.mark.gpu
@pytest.mark.timeout(300)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_vram_slices_land_exactly_and_a_vram_receiver_serves_a_joiner():
    """On the GPU: a receiver keeping row and column boxes of VRAM tensors gets exactly
    those bytes (fresh tensors marked with their boxes, one placed into the caller's
    tensor) for three syncs; a receiver keeping everything whole serves a joiner in VRAM."""
    import asyncio
    from concurrent.futures import ThreadPoolExecutor

    from weightsync.core.xferplan import Keep
    from weightsync.transport.tensors import partial_boxes
    cls = CheckpointEngineRegistry.get("nixl")

    def tensors(step):
        g = torch.Generator(device="cuda").manual_seed(step)
        return [(n, torch.randn(sh, generator=g, device="cuda").to(dt)) for n, sh, dt in
                (("q", (64, 96), torch.bfloat16), ("up", (300, 40), torch.float32),
                 ("norm", (96,), torch.float16))]
    keep = Keep(boxes={"q": (((0, 64), (48, 96)),), "up": (((100, 250), (0, 40)),)})
    trainer, recv = _pair_here("cuda")
    into = {"up": torch.zeros(300, 40, device="cuda")}
    try:
        recv.keep_slices(lambda layout: keep)
        for step in range(3):
            sent = dict(tensors(step))
            got = _sync_here(trainer, recv, step, into=into if step else None,
                             tensors=list(sent.items()), clone=False)
            for n, w in sent.items():
                assert got[n].device.type == "cuda"
                for box in keep.of(n, w.shape):
                    idx = tuple(slice(a, b) for a, b in box)
                    assert torch.equal(got[n][idx], w[idx]), (step, n)
            assert partial_boxes(got["norm"]) is None
            if step == 0:
                assert partial_boxes(got["q"]) == keep.boxes["q"]
            else:
                assert torch.equal(into["up"][100:250], sent["up"][100:250])
        with pytest.raises(WeightSyncError, match="only in part"):
            recv.join_offer("replica-9")
        recv.keep_slices(None)                      # whole tensors from now on
        sent = dict(tensors(3))
        _sync_here(trainer, recv, 3, tensors=list(sent.items()))
        offer = recv.join_offer("replica-9", lease_s=60)
        assert decode(offer["source"]).mem == "VRAM"
        joiner = cls(role="rollout", bucket_size=BUCKET, timeout=20, device="cuda")
        joiner.prepare()
        joiner.init_process_group(**cls.join_topology([offer], 1)[0])

        async def take():
            return {n: t.clone() async for n, t in joiner.receive_weights(3)}
        with ThreadPoolExecutor(1) as pool:
            joined = pool.submit(asyncio.run, take()).result(60)
        assert all(torch.equal(joined[n], sent[n]) for n in sent)
        assert recv.join_done(offer["lease"]) is True
        joiner.finalize()
    finally:
        recv.finalize()
        trainer.finalize()


@pytest.mark.gpu
@pytest.mark.timeout(300)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_vram_tensor_parallel_shards_land_straight_in_the_workers_own_tensors():
    _check_shards_land("cuda")
