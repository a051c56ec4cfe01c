"""Tests of the compiled transfer plan of the pull backend (weightsync.core.xferplan)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from weightsync.core.xferplan import (
    DestLayout, HeldBox, HeldRange, Read, SourceLayout, TransferPlan, Want, compile_plan,
    read_totals,
)

from weightsync.core.errors import PlanMismatch
from weightsync.core.plan import DTYPES, itemsize


# ------------------------------------------------------------------ helpers

def full_box(shape):
    return tuple((0, n) for n in shape)


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t`` (row-major), as a flat uint8 tensor."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def random_tensor(shape, dtype: str, gen: torch.Generator) -> torch.Tensor:
    dt = DTYPES[dtype]
    if dt.is_floating_point:
        return torch.randn(shape, generator=gen).to(dt)
    info = torch.iinfo(dt)
    return torch.randint(info.min, info.max, shape, generator=gen, dtype=torch.int64).to(dt)


def build_sources(model: dict, shards: dict, region="flat"):
    """``shards``: rank -> {name: (start, stop)}. Returns layouts and region buffers."""
    layouts, regions = [], {}
    for rank, held in shards.items():
        items, parts, off = [], [], 0
        for name, (start, stop) in held.items():
            t = model[name]
            items.append(HeldRange(name=name, shape=tuple(t.shape), dtype=dtype_of(t),
                                   start=start, stop=stop, region=region, offset=off))
            raw = byte_view(t)[start * t.element_size():stop * t.element_size()]
            parts.append(raw)
            off += raw.numel()
        layouts.append(SourceLayout(rank=rank, held=tuple(items)))
        regions[rank, region] = torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)
    return layouts, regions


def build_dest(worker: str, wants_spec, model: dict, dest="land", dtypes=None):
    """``wants_spec``: [(name, box)] laid back-to-back. Returns the layout and its size."""
    wants, off = [], 0
    for name, box in wants_spec:
        dt = (dtypes or {}).get(name, dtype_of(model[name]))
        w = Want(name=name, dtype=dt, box=box, dest=dest, offset=off)
        wants.append(w)
        off += w.numel * itemsize(dt)
    return DestLayout(worker=worker, wants=tuple(wants)), off


def dtype_of(t: torch.Tensor) -> str:
    return next(n for n, d in DTYPES.items() if d == t.dtype)


def execute(plan: TransferPlan, regions: dict, dests: dict) -> None:
    """Apply the reads: memcpy of byte ranges (cast reads go through a staging copy)."""
    for r in plan.reads:
        src = regions[r.src_rank, r.src_region][r.src_offset:r.src_offset + r.nbytes]
        assert src.numel() == r.nbytes, "read past the end of a source region"
        if r.cast:
            src = src.view(DTYPES[r.src_dtype]).to(DTYPES[r.dst_dtype]).view(torch.uint8)
        out = dests[r.dst_worker, r.dst]
        assert r.dst_offset + src.numel() <= out.numel(), "write past a landing buffer"
        out[r.dst_offset:r.dst_offset + src.numel()] = src


def check_landed(layout: DestLayout, buffers: dict, model: dict) -> None:
    for w in layout.wants:
        t = model[w.name]
        expect = t[tuple(slice(a, b) for a, b in w.box)].to(DTYPES[w.dtype])
        raw = byte_view(expect)
        got = buffers[layout.worker, w.dest][w.offset:w.offset + raw.numel()]
        assert torch.equal(got, raw), f"{layout.worker}: {w.name}{list(w.box)} differs"


def fsdp_shards(model: dict, nranks: int) -> dict:
    """FSDP2 Shard(0): each rank holds a contiguous block of rows (last ranks may be short)."""
    out = {r: {} for r in range(nranks)}
    for name, t in model.items():
        rows = t.shape[0] if t.dim() else 1
        per = -(-rows // nranks) if rows else 0
        row_numel = t.numel() // rows if rows else 0
        for r in range(nranks):
            a, b = min(r * per, rows), min((r + 1) * per, rows)
            out[r][name] = (a * row_numel, b * row_numel)
    return out


def tp_wants(model: dict, worker: int, nworkers: int, kinds: dict):
    """TP shards: 'col' = rows split (column-parallel), 'row' = cols split, else full."""
    spec = []
    for name, t in model.items():
        box = list(full_box(t.shape))
        kind = kinds.get(name, "full")
        dim = {"col": 0, "row": 1}.get(kind)
        if dim is not None:
            n = t.shape[dim]
            box[dim] = (worker * n // nworkers, (worker + 1) * n // nworkers)
        spec.append((name, tuple(box)))
    return spec


def run_plan(model, sources, regions, dest_layouts, sizes, **kw):
    plan = compile_plan(sources, dest_layouts, **kw)
    buffers = {(d.worker, "land"): torch.zeros(sizes[d.worker], dtype=torch.uint8)
               for d in dest_layouts}
    execute(plan, regions, buffers)
    for d in dest_layouts:
        check_landed(d, buffers, model)
    return plan


# ------------------------------------------------------------------ full tensors

def test_full_tensors_one_rank_two_workers_coalesce_to_one_read():
    gen = torch.Generator().manual_seed(0)
    model = {f"t{i:02d}": random_tensor((i + 1, 3), "float32", gen) for i in range(20)}
    sources, regions = build_sources(model, {0: {n: (0, t.numel()) for n, t in model.items()}})
    layouts, sizes = [], {}
    for w in ("w0", "w1"):
        d, sizes[w] = build_dest(w, [(n, full_box(t.shape)) for n, t in model.items()], model)
        layouts.append(d)
    plan = run_plan(model, sources, regions, layouts, sizes)
    total = sum(t.numel() * 4 for t in model.values())
    assert len(plan.reads_for("w0")) == 1 and len(plan.reads_for("w1")) == 1
    assert plan.bytes_per_dest() == {"w0": total, "w1": total}
    assert plan.bytes_per_source() == {0: 2 * total}
    assert plan.bytes_per_pair() == {(0, "w0"): total, (0, "w1"): total}
    assert len(plan.reads_from(0)) == 2 and plan.reads_from(1) == []
    assert "w0" in str(plan) and plan.digest[:12] in plan.summary()


# ------------------------------------------------------------------ FSDP2 -> TP

KINDS = {"qkv": "col", "o": "row", "odd": "col", "wide": "row"}


def fsdp_model(dtype: str, extra: bool):
    gen = torch.Generator().manual_seed(1)
    model = {"qkv": random_tensor((16, 12), dtype, gen), "o": random_tensor((12, 16), dtype, gen),
             "odd": random_tensor((7, 5), dtype, gen), "wide": random_tensor((6, 9), dtype, gen)}
    if extra:
        model["scalar"] = random_tensor((), dtype, gen)
        model["empty"] = random_tensor((0, 6), dtype, gen)
        model["cube"] = random_tensor((4, 3, 5), dtype, gen)
    return model


def slice_bytes(model, spec):
    return sum(math.prod(b - a for a, b in box) * model[n].element_size() for n, box in spec)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32", "int8", "float8_e4m3fn"])
def test_fsdp2_to_tp_bytes_balance_and_bit_exact(dtype):
    model = fsdp_model(dtype, extra=True)
    sources, regions = build_sources(model, fsdp_shards(model, 2))
    layouts, sizes, specs = [], {}, {}
    for w in range(2):
        specs[f"w{w}"] = tp_wants(model, w, 2, KINDS)
        d, sizes[f"w{w}"] = build_dest(f"w{w}", specs[f"w{w}"], model)
        layouts.append(d)
    plan = run_plan(model, sources, regions, layouts, sizes)
    per_dest = plan.bytes_per_dest()
    for w, spec in specs.items():
        assert per_dest[w] == slice_bytes(model, spec) == sizes[w]
    assert all(not r.cast for r in plan.reads)
    assert TransferPlan.from_dict(json.loads(json.dumps(plan.to_dict()))) == plan


def test_fsdp2_to_tp_each_worker_gets_half_and_sources_balance():
    model = fsdp_model("bfloat16", extra=False)
    sources, _ = build_sources(model, fsdp_shards(model, 2))
    model_bytes = sum(t.numel() * t.element_size() for t in model.values())
    wanted = {k: model[k] for k in ("qkv", "o")}
    layouts = [build_dest(f"w{w}", tp_wants(wanted, w, 2, KINDS), wanted)[0] for w in range(2)]
    plan = compile_plan(sources, layouts)
    half = (model["qkv"].numel() + model["o"].numel()) * 2 // 2
    assert plan.bytes_per_dest() == {"w0": half, "w1": half}
    assert plan.bytes_per_source() == {0: half, 1: half}
    assert plan.total_bytes < model_bytes
    # column-parallel shard: one read; row-parallel: one read per row, the first of which
    # follows the qkv half in both rank 0's region and w0's buffer, so it coalesces with it
    assert len(plan.reads_for("w0")) == model["o"].shape[0]


def test_cast_reads_land_source_dtype_then_cast():
    model = fsdp_model("bfloat16", extra=False)
    sources, regions = build_sources(model, fsdp_shards(model, 2))
    dtypes = {"qkv": "float32", "o": "float16"}
    layouts, sizes = [], {}
    for w in range(2):
        d, sizes[f"w{w}"] = build_dest(f"w{w}", tp_wants(model, w, 2, KINDS), model, dtypes=dtypes)
        layouts.append(d)
    plan = run_plan(model, sources, regions, layouts, sizes, max_read_bytes=10)
    cast = {(r.src_dtype, r.dst_dtype) for r in plan.reads if r.cast}
    assert cast == {("bfloat16", "float32"), ("bfloat16", "float16")}
    assert any("qkv" in n and "float32" in n for n in plan.notes)


# ------------------------------------------------------------------ replicas

def test_overlapping_holders_balance_bytes_per_rank():
    gen = torch.Generator().manual_seed(2)
    sizes_ = [(64, 32), (8, 8), (100,), (3, 7), (50, 20), (1, 1), (33, 17), (16, 64)]
    model = {f"p{i}": random_tensor(s, "float32", gen) for i, s in enumerate(sizes_)}
    everything = {n: (0, t.numel()) for n, t in model.items()}
    sources, regions = build_sources(model, {0: everything, 1: everything})
    layouts, sizes = [], {}
    for w in ("w0", "w1"):
        d, sizes[w] = build_dest(w, [(n, full_box(t.shape)) for n, t in model.items()], model)
        layouts.append(d)
    plan = run_plan(model, sources, regions, layouts, sizes)
    b = plan.bytes_per_source()
    assert set(b) == {0, 1} and abs(b[0] - b[1]) <= 0.1 * max(b.values())
    unbalanced = compile_plan(sources, layouts, balance=False)
    assert unbalanced.bytes_per_source()[1] == 0


def test_one_big_replicated_tensor_is_spread_when_reads_are_capped():
    gen = torch.Generator().manual_seed(3)
    model = {"big": random_tensor((64, 64), "bfloat16", gen)}
    everything = {"big": (0, 64 * 64)}
    sources, regions = build_sources(model, {0: everything, 1: everything, 2: everything})
    d, size = build_dest("w", [("big", ((0, 64), (0, 64)))], model)
    plan = run_plan(model, sources, regions, [d], {"w": size}, max_read_bytes=1000)
    assert max(r.nbytes for r in plan.reads) <= 1000
    b = plan.bytes_per_source()
    assert max(b.values()) - min(b.values()) <= 1000


# ------------------------------------------------------------------ bad inputs

def base_layouts():
    """A valid layout of 'good' plus a 'bad.w' tensor the cases below break."""
    held = [HeldRange(name="good", shape=(4, 4), dtype="float32", start=0, stop=16,
                      region="r", offset=0),
            HeldRange(name="bad.w", shape=(4, 6), dtype="bfloat16", start=0, stop=24,
                      region="r", offset=64)]
    wants = [Want(name="good", dtype="float32", box=((0, 4), (0, 4)), dest="d", offset=0),
             Want(name="bad.w", dtype="bfloat16", box=((0, 4), (0, 3)), dest="d", offset=64)]
    return held, wants


def replace(items, name, **kw):
    cls = type(items[0])
    out = []
    for x in items:
        if x.name == name:
            fields = {f: getattr(x, f) for f in x.__dataclass_fields__}
            x = cls(**{**fields, **kw})
        out.append(x)
    return out


BAD = {
    "box outside shape": lambda h, w: (h, replace(w, "bad.w", box=((0, 4), (2, 7)))),
    "box wrong rank": lambda h, w: (h, replace(w, "bad.w", box=((0, 4),))),
    "name not held": lambda h, w: (h[:1], w),
    "shape differs across ranks": lambda h, w: (
        h + [replace(h, "bad.w", shape=(6, 4), region="r2")[1]], w),
    "dtype differs across ranks": lambda h, w: (
        h + [replace(h, "bad.w", dtype="float16", region="r2")[1]], w),
    "shape changed": lambda h, w: (h, replace(w, "bad.w", shape=(4, 7))),
    "float to int": lambda h, w: (h, replace(w, "bad.w", dtype="int16")),
    "float to bool": lambda h, w: (h, replace(w, "bad.w", dtype="bool")),
    "coverage gap": lambda h, w: (replace(h, "bad.w", start=0, stop=12), w),
    "held stop past numel": lambda h, w: (replace(h, "bad.w", stop=25), w),
    "held stop before start": lambda h, w: (replace(h, "bad.w", start=10, stop=5), w),
    "held negative offset": lambda h, w: (replace(h, "bad.w", offset=-2), w),
    "want negative offset": lambda h, w: (h, replace(w, "bad.w", offset=-8)),
    "overlapping dest ranges": lambda h, w: (h, replace(w, "bad.w", offset=60)),
}


def split_ranks(held):
    """Put the second 'bad.w' entry (if any) on another rank."""
    first, extra = held[:2], held[2:]
    layouts = [SourceLayout(rank=0, held=tuple(first))]
    if extra:
        layouts.append(SourceLayout(rank=1, held=tuple(extra)))
    return layouts


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_inputs_raise_plan_mismatch_naming_the_tensor(case):
    held, wants = BAD[case](*base_layouts())
    with pytest.raises(PlanMismatch) as err:
        compile_plan(split_ranks(held), [DestLayout(worker="w0", wants=tuple(wants))])
    msg = str(err.value)
    assert "bad.w" in msg and "good:" not in msg, msg
    if case == "shape changed":
        assert "shape changed" in msg
    if case == "coverage gap":
        assert "[12, 15)" in msg  # row 2 is the first row no rank holds


def test_the_valid_base_layout_compiles():
    held, wants = base_layouts()
    plan = compile_plan(split_ranks(held), [DestLayout(worker="w0", wants=tuple(wants))])
    assert plan.bytes_per_dest() == {"w0": 16 * 4 + 12 * 2}


def test_all_problems_are_reported_at_once():
    held, wants = base_layouts()
    wants = replace(wants, "bad.w", box=((0, 9), (0, 3)))
    wants = replace(wants, "good", dtype="int32")
    with pytest.raises(PlanMismatch) as err:
        compile_plan(split_ranks(held), [DestLayout(worker="w0", wants=tuple(wants))])
    msg = str(err.value)
    assert "2 problem(s) [bad.w, good]" in msg and "outside shape" in msg and "cast" in msg


def test_duplicate_rank_and_worker_are_rejected():
    held, wants = base_layouts()
    src = SourceLayout(rank=0, held=tuple(held))
    dst = DestLayout(worker="w0", wants=tuple(wants))
    with pytest.raises(PlanMismatch, match="rank 0"):
        compile_plan([src, src], [dst])
    with pytest.raises(PlanMismatch, match="worker w0"):
        compile_plan([src], [dst, dst])


@pytest.mark.parametrize("make", [
    lambda: HeldRange(name="x", shape=(2,), dtype="float99", start=0, stop=2, region="r",
                      offset=0),
    lambda: HeldRange(name="x", shape=(2.5,), dtype="float32", start=0, stop=2, region="r",
                      offset=0),
    lambda: HeldRange(name="", shape=(2,), dtype="float32", start=0, stop=2, region="r",
                      offset=0),
    lambda: Want(name="x", dtype="float32", box=((0, 1, 2),), dest="d", offset=0),
    lambda: Want(name="x", dtype="float32", box=(0, 1), dest="d", offset=0),
    lambda: SourceLayout(rank=-1, held=()),
    lambda: DestLayout(worker="w", wants=("x",)),
    lambda: Read(src_rank=0, src_region="r", src_offset=0, nbytes=0, dst_worker="w", dst="d",
                 dst_offset=0),
    lambda: Read(src_rank=0, src_region="r", src_offset=0, nbytes=3, dst_worker="w", dst="d",
                 dst_offset=0, cast=True, src_dtype="bfloat16", dst_dtype="float32"),
])
def test_malformed_values_raise_value_error(make):
    with pytest.raises(ValueError):
        make()


# ------------------------------------------------------------------ serialization

def small_plan(shape=(8, 6)):
    held = (HeldRange(name="a", shape=shape, dtype="bfloat16", start=0,
                      stop=math.prod(shape), region="r", offset=0),)
    want = Want(name="a", dtype="float32", box=((0, 4), (0, 3)), dest="d", offset=16)
    return compile_plan([SourceLayout(rank=0, held=held), SourceLayout(rank=1, held=held)],
                        [DestLayout(worker="w", wants=(want,), notes=("a asked in full",))])


def test_round_trip_and_digest_stability():
    plan = small_plan()
    d = json.loads(json.dumps(plan.to_dict()))
    again = TransferPlan.from_dict(d)
    assert again == plan and again.digest == plan.digest == small_plan().digest
    assert again.to_dict() == d
    assert "w: a asked in full" in plan.notes
    assert small_plan(shape=(8, 7)).digest != plan.digest


def test_plan_does_not_depend_on_input_order_but_on_every_layout_detail():
    model = fsdp_model("bfloat16", extra=True)
    sources, _ = build_sources(model, fsdp_shards(model, 2))
    dests = [build_dest(f"w{w}", tp_wants(model, w, 2, KINDS), model)[0] for w in range(2)]
    plan = compile_plan(sources, dests)
    shuffled = [DestLayout(worker=d.worker, wants=d.wants[::-1]) for d in dests[::-1]]
    again = compile_plan(sources[::-1], shuffled)
    assert again == plan and again.digest == plan.digest
    moved = [SourceLayout(rank=s.rank, held=tuple(replace(list(s.held), "o", offset=s.held[1]
                                                          .offset + 2))) for s in sources]
    assert compile_plan(moved, dests).digest != plan.digest


def test_integer_like_inputs_are_normalized_to_python_ints():
    import numpy as np
    held = HeldRange(name="x", shape=torch.Size([2, 3]), dtype="float32", start=np.int64(0),
                     stop=np.int32(6), region="r", offset=np.uint16(8))
    want = Want(name="x", dtype="float32", box=[(np.int64(0), 2), [0, 3]], dest="d", offset=0)
    assert type(held.shape[0]) is int and type(held.stop) is int and held.offset == 8
    assert want.box == ((0, 2), (0, 3))
    plan = compile_plan([SourceLayout(rank=np.int64(0), held=[held])],
                        [DestLayout(worker="w", wants=[want])])
    assert plan.reads == (Read(src_rank=0, src_region="r", src_offset=8, nbytes=24,
                               dst_worker="w", dst="d", dst_offset=0),)
    json.dumps(plan.to_dict())


def test_digest_is_the_same_in_another_process():
    code = ("import sys; sys.path.insert(0, %r); from test_xferplan import small_plan; "
            "print(small_plan().digest)" % os.path.dirname(__file__))
    env = dict(os.environ, PYTHONHASHSEED="12345")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, check=True, timeout=120)
    assert out.stdout.strip() == small_plan().digest


@pytest.mark.parametrize("change", [
    lambda d: d.pop("reads"),
    lambda d: d.update(extra=1),
    lambda d: d.update(format="other/9"),
    lambda d: d.update(read_fields=d["read_fields"][::-1]),
    lambda d: d.update(reads=[d["reads"][0][:5]]),
    lambda d: d.update(reads="nope"),
    lambda d: d["reads"][0].__setitem__(3, -4),
    lambda d: d["reads"][0].__setitem__(0, "zero"),
    lambda d: d["reads"][0].__setitem__(8, None),
    lambda d: d["reads"][0].__setitem__(7, 1),
    lambda d: d.update(notes=[1]),
    lambda d: d.update(tensors=[["a", [8, -6], "bfloat16"]]),
    lambda d: d.update(tensors=[["a", [8, 6]]]),
    lambda d: d.update(digest="0" * 64),
    lambda d: d["reads"][0].__setitem__(2, d["reads"][0][2] + 2),  # digest no longer fits
])
def test_malformed_from_dict_raises_value_error(change):
    d = json.loads(json.dumps(small_plan().to_dict()))
    change(d)
    with pytest.raises(ValueError):
        TransferPlan.from_dict(d)
    with pytest.raises(ValueError):
        TransferPlan.from_dict([1, 2])


# ------------------------------------------------------------------ scale

@pytest.mark.timeout(60)
def test_llama_like_layout_compiles_with_coalesced_column_shards():
    hidden, inter, layers = 4096, 11008, 32
    mats = [("q", (hidden, hidden), "col"), ("k", (hidden, hidden), "col"),
            ("v", (hidden, hidden), "col"), ("o", (hidden, hidden), "row"),
            ("gate", (inter, hidden), "col"), ("up", (inter, hidden), "col"),
            ("down", (hidden, inter), "row")]
    sources = []
    for rank in range(2):
        held, off = [], 0
        for layer in range(layers):
            for m, shape, _ in mats:
                n = math.prod(shape)
                held.append(HeldRange(name=f"l{layer}.{m}", shape=shape, dtype="bfloat16",
                                      start=rank * n // 2, stop=(rank + 1) * n // 2,
                                      region="flat", offset=off))
                off += n
        sources.append(SourceLayout(rank=rank, held=tuple(held)))
    dests = []
    for w in range(2):
        wants, off = [], 0
        for layer in range(layers):
            for m, shape, kind in mats:
                box = [(0, shape[0]), (0, shape[1])]
                dim = 0 if kind == "col" else 1
                box[dim] = (w * shape[dim] // 2, (w + 1) * shape[dim] // 2)
                want = Want(name=f"l{layer}.{m}", dtype="bfloat16", box=tuple(box),
                            dest="land", offset=off)
                wants.append(want)
                off += want.numel * 2
        dests.append(DestLayout(worker=f"w{w}", wants=tuple(wants)))
    plan = compile_plan(sources, dests)
    model_bytes = layers * sum(math.prod(s) for _, s, _ in mats) * 2
    assert plan.bytes_per_dest() == {"w0": model_bytes // 2, "w1": model_bytes // 2}
    assert plan.bytes_per_source() == {0: model_bytes // 2, 1: model_bytes // 2}
    row_runs = layers * hidden * 2  # o and down: one read per row
    for w in ("w0", "w1"):
        reads = plan.reads_for(w)
        assert row_runs - 2 * layers <= len(reads) <= row_runs + 2 * layers
        # q, k, v coalesce into one read; gate, up into another
        assert sum(r.nbytes >= hidden * hidden for r in reads) == 2 * layers


# ------------------------------------------------------------------ boxes held (trainer TP)

def box_sources(model: dict, boxes: dict, region="flat"):
    """``boxes``: rank -> {name: box}; each rank holds its boxes row-major, back to back
    (what a tensor-parallel trainer rank's local shards are). Layouts and region buffers."""
    layouts, regions = [], {}
    for rank, held in boxes.items():
        items, parts, off = [], [], 0
        for name, box in held.items():
            t = model[name]
            items.append(HeldBox(name=name, shape=tuple(t.shape), dtype=dtype_of(t), box=box,
                                 region=region, offset=off))
            raw = byte_view(t[tuple(slice(a, b) for a, b in box)])
            parts.append(raw)
            off += raw.numel()
        layouts.append(SourceLayout(rank=rank, held=tuple(items)))
        regions[rank, region] = torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)
    return layouts, regions


def tp_boxes(model: dict, kinds: dict, tp: int, t: int) -> dict:
    return dict(tp_wants(model, t, tp, kinds))


@pytest.mark.parametrize("src_tp,dst_tp", [(2, 4), (4, 2), (2, 1), (3, 2)])
def test_trainer_tp_shards_land_bit_exact_in_another_tp(src_tp, dst_tp):
    """Trainer ranks hold TP boxes (row-parallel ones are column slices: one run per row,
    not a flat range); workers of another TP size get exactly their boxes, no rank is read
    for bytes it does not hold, and each worker takes in its share once."""
    g = torch.Generator().manual_seed(3)
    model = {"q": random_tensor((24, 12), "bfloat16", g), "o": random_tensor((12, 24), "bfloat16", g),
             "e": random_tensor((2, 6, 12), "float32", g), "n": random_tensor((12,), "bfloat16", g)}
    kinds = {"q": "col", "o": "row", "e": "row"}
    sources, regions = box_sources(model, {r: tp_boxes(model, kinds, src_tp, r)
                                           for r in range(src_tp)})
    dests, sizes = [], {}
    for w in range(dst_tp):
        d, n = build_dest(f"w{w}", tp_wants(model, w, dst_tp, kinds), model)
        dests.append(d)
        sizes[d.worker] = n
    plan = run_plan(model, sources, regions, dests, sizes)
    kept = {d.worker: sum(w.numel * itemsize(w.dtype) for w in d.wants) for d in dests}
    assert plan.bytes_per_dest() == kept
    held = {s.rank: sum(h.numel * itemsize(h.dtype) for h in s.held) for s in sources}
    # replicated "n" is read from one of the ranks per worker; the rest from its one holder
    assert sum(plan.bytes_per_source().values()) == sum(kept.values())
    assert all(0 < b <= held[r] * dst_tp for r, b in plan.bytes_per_source().items())


def test_replicated_tp_boxes_balance_over_data_parallel_ranks():
    """TP 2 x DP 2 (Megatron: every DP rank holds the same TP box): the reads of each box
    are spread over its two holders, and bytes land exactly."""
    g = torch.Generator().manual_seed(4)
    model = {f"l{i}.o": random_tensor((64, 32), "bfloat16", g) for i in range(4)}
    kinds = {n: "row" for n in model}
    boxes = {dp * 2 + t: tp_boxes(model, kinds, 2, t) for dp in range(2) for t in range(2)}
    sources, regions = box_sources(model, boxes)
    d, n = build_dest("w0", tp_wants(model, 0, 1, kinds), model)
    plan = run_plan(model, sources, regions, [d], {"w0": n})
    per = plan.bytes_per_source()
    total = sum(t.numel() * 2 for t in model.values())
    assert sum(per.values()) == total
    assert all(abs(b - total / 4) <= 0.1 * total for b in per.values()), per


def test_a_box_past_the_shape_or_an_uncovered_part_is_a_plan_mismatch():
    g = torch.Generator().manual_seed(5)
    model = {"o": random_tensor((4, 6), "float32", g)}
    held = (HeldBox(name="o", shape=(4, 6), dtype="float32", box=((0, 4), (0, 7)),
                    region="r", offset=0),)
    d, _ = build_dest("w0", [("o", full_box((4, 6)))], model)
    with pytest.raises(PlanMismatch, match=r"o.*rank 0 holds box \[\(0, 4\), \(0, 7\)\], not within"):
        compile_plan([SourceLayout(rank=0, held=held)], [d])
    half = (HeldBox(name="o", shape=(4, 6), dtype="float32", box=((0, 4), (0, 3)),
                    region="r", offset=0),)
    with pytest.raises(PlanMismatch, match="no rank holds elements"):
        compile_plan([SourceLayout(rank=0, held=half)], [d])
    with pytest.raises(ValueError, match="HeldBox"):
        HeldBox(name="o", shape=(4, 6), dtype="float32", box=((0, 4), 3), region="r", offset=0)


@pytest.mark.parametrize("replica", [1, 2, 4, 8])
def test_receivers_compiling_alone_spread_over_replicated_holders(replica):
    """Four data-parallel ranks hold the same tensor; worker 0 of each of 16 replicas of
    ``replica`` workers (ranks ``k * replica``) compiles alone with its rank as ``spread``:
    every holder serves the same share whatever the replica size (``spread=0``, or the
    rank mod 4, would put them all on one rank when 4 divides the replica size)."""
    g = torch.Generator().manual_seed(6)
    model = {"o": random_tensor((8, 16), "bfloat16", g)}
    sources, _ = box_sources(model, {r: {"o": full_box((8, 16))} for r in range(4)})
    d, _ = build_dest("w", [("o", full_box((8, 16)))], model)
    per = {}
    for k in range(16):
        for rd in compile_plan(sources, [d], spread=k * replica).reads:
            per[rd.src_rank] = per.get(rd.src_rank, 0) + rd.nbytes
    assert sorted(per) == [0, 1, 2, 3] and len(set(per.values())) == 1, per
    assert {rd.src_rank for rd in compile_plan(sources, [d]).reads} == {0}


def test_read_totals_equal_each_receivers_own_compile():
    """read_totals (sources prepared once, one compile per destination, no Read objects)
    gives, for every destination, the bytes and READs per rank of compile_plan([that
    destination]) with the same spread and prior: what the planner counts is what each
    receiver of the backend compiles."""
    g = torch.Generator().manual_seed(7)
    model = {"o": random_tensor((48, 32), "bfloat16", g), "q": random_tensor((32, 16), "float32", g),
             "n": random_tensor((16,), "bfloat16", g)}
    kinds = {"o": "row", "q": "col"}
    boxes = {dp * 2 + t: tp_boxes(model, kinds, 2, t) for dp in range(3) for t in range(2)}
    sources, _ = box_sources(model, boxes)
    dests = [build_dest(f"w{i}", tp_wants(model, i % 4, 4, kinds), model,
                        dtypes={"q": "bfloat16"})[0] for i in range(8)]
    spread = list(range(8))
    prior = [None, {0: 10_000}, {5: 1}, None, {1: 99, 3: 7}, None, None, {2: 4096}]
    got = read_totals(sources, dests, spread=spread, prior=prior, max_read_bytes=512)
    for d, sp, pr, totals in zip(dests, spread, prior, got):
        plan = compile_plan(sources, [d], spread=sp, prior=pr, max_read_bytes=512)
        want = {}
        for r in plan.reads:
            b, n = want.get(r.src_rank, (0, 0))
            want[r.src_rank] = (b + r.nbytes, n + 1)
        assert totals == want
    assert len({tuple(sorted(t)) for t in got}) > 1          # receivers read different ranks
    with pytest.raises(ValueError, match="one entry per destination"):
        read_totals(sources, dests, spread=[0])


def test_a_box_two_ranks_stage_alike_is_one_read_not_one_per_row():
    """Two ranks each hold a (64, 96) weight staged column half by column half (as nixl
    trainers do once every receiver keeps such halves). A receiver wanting one half reads
    it in one piece from one rank, not row by row alternating between the ranks (which no
    read could coalesce); two halves compiled together go one to each rank; a read limit
    still cuts a half into pieces spread over both."""
    shape, isz = (64, 96), 2
    halves = (((0, 64), (0, 48)), ((0, 64), (48, 96)))
    size = 64 * 48 * isz
    srcs = [SourceLayout(rank=r, held=tuple(
        HeldBox(name="w", shape=shape, dtype="bfloat16", box=b, region="b0", offset=i * size)
        for i, b in enumerate(halves))) for r in (0, 1)]

    def want(worker, b):
        return DestLayout(worker=worker, wants=(Want(name="w", dtype="bfloat16", box=b,
                                                     dest="d", offset=0),))
    one = compile_plan(srcs, [want("r1", halves[1])])
    assert [(r.src_offset, r.nbytes) for r in one.reads] == [(size, size)], one.reads
    both = compile_plan(srcs, [want("r0", halves[0]), want("r1", halves[1])])
    assert sorted(r.src_rank for r in both.reads) == [0, 1], both.reads
    cut = compile_plan(srcs, [want("r1", halves[1])], max_read_bytes=size // 4)
    assert len(cut.reads) == 4 and {r.src_rank for r in cut.reads} == {0, 1}, cut.reads
    assert sum(r.nbytes for r in cut.reads) == size
