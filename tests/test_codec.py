"""The codec layer (delta updates, FP8 on the fly) above the transports: encodings, the FP8
quantizer against a reference, and real syncs: in process (``delta+inproc``: every
protocol path, fast) and across processes with the harness (shm, collective, nixl)."""

from __future__ import annotations

import asyncio
import math
import multiprocessing as mp
import sys
import time
from dataclasses import dataclass

import pytest
import torch

from weightsync.core.errors import WireError
from weightsync.core.plan import DTYPES
from weightsync.testing import GroupSpec, run_group
from weightsync.testing.harness import same_bytes
from weightsync.transport import CheckpointEngineRegistry as Registry
from weightsync.transport.base import worker_kwargs
from weightsync.transport.tensors import aiter_items
from syncchecks import assert_clean

if mp.current_process().name != "MainProcess":   # a harness worker: register the codec names
    import weightsync.transport.codec  # noqa: F401

BUCKET = 64 * 1024


@pytest.fixture(autouse=True)
def codec():
    """The codec's modules, imported (registering its names) only when a test runs, so
    collecting this file adds no names to other modules' parametrizations."""
    import weightsync.transport.codec as c
    from weightsync.transport.codec import delta, fp8, kernels
    c.delta, c.fp8, c.kernels = delta, fp8, kernels
    return c


def _rand(g: torch.Generator, shape, dtype) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_complex:
        return torch.randn(shape, generator=g, dtype=dtype)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).clamp(-4, 4).abs().to(dtype)
    return torch.randint(0, 100, shape, generator=g).to(dtype)


def _flip(t: torch.Tensor, frac: float, g: torch.Generator) -> torch.Tensor:
    """``t`` (contiguous) with ``frac`` of its elements' low bit flipped, in place."""
    from weightsync.transport.codec.kernels import int_view
    v = int_view(t)
    k = math.ceil(frac * t.numel())
    pos = torch.randperm(t.numel(), generator=g)[:k]
    v[pos] = v[pos] ^ 1
    return t


# -- encodings --------------------------------------------------------------------------
@pytest.mark.parametrize("frac,record", [(0.0, True), (0.004, True), (0.1, True), (0.2, False),
                                         (0.97, False)])
def test_records_list_changes_up_to_an_eighth(codec, frac, record):
    delta = codec.delta
    base = _rand(torch.Generator().manual_seed(1), (100, 100), torch.bfloat16)
    new = _flip(base.clone(), frac, torch.Generator().manual_seed(2))
    rec, m = delta.encode(new, base)
    assert m == math.ceil(frac * new.numel())
    if not record:
        assert rec is None and delta.record_size(new.shape, 2, m) is None
        return
    head = delta.parse(rec)
    assert head.enc == delta.INDEX and head.count == m and rec.numel() == head.size
    assert rec.numel() == delta.record_size(new.shape, 2, m)
    assert head.entries <= max(m + 8, 1.125 * m) and head.entries % 8 == 0
    target = base.clone()
    delta.apply(head, rec, target)
    assert same_bytes(target, new)


@pytest.mark.parametrize("dname", sorted(DTYPES))
@pytest.mark.parametrize("shape", [(4000,), (37, 129)])
def test_delta_round_trip_every_dtype(codec, dname, shape):
    delta, int_view = codec.delta, codec.kernels.int_view
    g = torch.Generator().manual_seed(len(dname))
    base = _rand(g, shape, DTYPES[dname])
    new = _flip(base.clone(), 0.01, g)
    rec, m = delta.encode(new, base)
    if not delta.deltable(new):                # 16-byte elements, or 1-D uint8: dense
        assert rec is None and (new.element_size() == 16 or new.dtype == torch.uint8)
        return
    ne = int_view(new) != int_view(base)
    want = (ne.any(dim=1) if ne.dim() == 2 else ne).nonzero().view(-1)
    assert rec is not None and m == want.numel() > 0
    assert torch.equal(delta.encode_host(new, base)[1], want)
    target = base.clone()
    delta.apply(delta.parse(rec), rec, target)
    assert same_bytes(target, new)
    moved = base.clone()
    delta.scatter(moved, new, want)
    assert same_bytes(moved, new)


def test_apply_checks_the_record_against_the_tensor_before_writing(codec):
    """A base that differs where the record changes it, a value or position changed in
    transit, a truncated record: refused, nothing written."""
    delta = codec.delta
    g = torch.Generator().manual_seed(3)
    base = _rand(g, (3000,), torch.float32)
    new = _flip(base.clone(), 0.01, g)
    rec, _ = delta.encode(new, base)
    head = delta.parse(rec)
    wrong = base.clone()
    first = int(rec[delta.HEAD: delta.HEAD + 4].view(torch.int32))
    wrong[first] += 1.0                                    # drifted where the record writes
    before = wrong.clone()
    with pytest.raises(delta.ResultMismatch):
        delta.apply(head, rec, wrong)
    assert same_bytes(wrong, before)                       # nothing written
    with pytest.raises(delta.BaseMismatch):
        delta.apply(head, rec, base.clone().view(torch.int32))
    for at in (head.values_at, delta.HEAD + 1):            # a value, a position
        bad = rec.clone()
        bad[at] ^= 1
        target = base.clone()
        with pytest.raises(delta.ResultMismatch):
            delta.apply(delta.parse(bad), bad, target)
        assert same_bytes(target, base)
    for cut in (rec[:40], rec[: delta.HEAD + 3], rec[:-8]):
        with pytest.raises(WireError):
            delta.parse(cut)
    evil = rec.clone()
    evil[delta.HEAD: delta.HEAD + 4] = torch.tensor([5000], dtype=torch.int32).view(torch.uint8)
    with pytest.raises(WireError):
        delta.apply(delta.parse(evil), evil, base.clone())


def test_change_digest_sees_positions_values_and_what_they_replace(codec):
    k = codec.kernels
    idx = torch.tensor([3, 7, 100])
    old = torch.tensor([1, 2, 3], dtype=torch.int16)
    new = torch.tensor([4, 5, 6], dtype=torch.int16)
    d = k.change_digest(idx, old, new)
    assert d != 0 and k.change_digest(idx, new, new) == 0
    assert d != k.change_digest(torch.tensor([3, 7, 101]), old, new)
    assert d != k.change_digest(idx, torch.tensor([1, 2, 4], dtype=torch.int16), new)
    assert d != k.change_digest(idx, old, torch.tensor([5, 4, 6], dtype=torch.int16))
    assert d == k.change_digest(idx.flip(0), old.flip(0), new.flip(0))   # order-free


def _interpreting() -> bool:
    from weightsync.transport.codec import gpu
    return gpu.INTERPRET and gpu.triton is not None


@pytest.mark.skipif("not _interpreting()", reason="the device kernels run on the host only "
                    "under TRITON_INTERPRET=1 (test_device_kernels_through_the_interpreter)")
@pytest.mark.parametrize("block", [None, 64])
def test_interp_device_kernels_make_and_check_the_hosts_records(codec, block, monkeypatch):
    """The device kernels, run by Triton's interpreter on host tensors (on a GPU:
    test_gpu_codec.py); also with small blocks, so every test tensor spans many programs
    and a partial last one."""
    from weightsync.transport.codec import gpu
    if block is not None:
        monkeypatch.setattr(gpu, "BLOCK", block)
    device_kernel_checks(codec, torch.device("cpu"))


def device_kernel_checks(codec, device):
    """One diff launch over tensors of several dtypes and change rates makes the records the
    host makes (same header, digest, positions and values), leaves each base equal to its
    new tensor, and the receiver's verify-then-commit takes good records and refuses bad
    ones (a value, a position, the count changed; a base that differs where the record
    writes; a truncated record) with their tensors untouched."""
    from weightsync.transport.codec import gpu
    delta, int_view = codec.delta, codec.kernels.int_view
    g = torch.Generator().manual_seed(11)
    cases = [((300, 70), torch.bfloat16, 0.01), ((5000,), torch.float32, 0.05),
             ((64, 64), torch.bfloat16, 0.5), ((100,), torch.bfloat16, 0.0),
             ((257, 3), torch.float8_e4m3fn, 0.02), ((40, 50), torch.float64, 0.03)]
    items, olds = [], []
    for shape, dtype, frac in cases:
        base = _rand(g, shape, dtype)
        new = _flip(base.clone(), frac, g)
        items.append((len(items), new.clone().to(device), base.clone().to(device)))
        olds.append(base)
    enc = gpu.Encoder()
    got = enc.finish(enc.launch(items))
    for (_, new, base), old, r in zip(items, olds, got):
        assert same_bytes(base.cpu(), new.cpu())           # the base moved along
        new = new.cpu()
        want, idx = delta.encode_host(new, old)
        assert r.changed == idx.numel()
        if want is None:
            assert r.record is None
            continue
        rec = r.record.cpu()
        head = delta.parse(rec)
        assert head == delta.parse(want)                   # digest, count, entries
        pos = rec[delta.HEAD: delta.HEAD + head.count * 4].view(torch.int32).long()
        order = pos.argsort()
        assert torch.equal(pos[order], idx)
        vals = rec[head.values_at: head.size].view(int_view(new).dtype)[: head.count]
        assert torch.equal(vals[order], int_view(new)[idx])
        dec = gpu.Decoder(torch.device(device))
        target = old.to(device)
        assert dec.add("good", r.record, target)
        kept = {}
        if head.count:
            for at in (head.values_at, delta.HEAD, 24):     # a value, a position, the count
                bad = rec.clone()
                bad[at] ^= 1
                kept[at] = old.to(device)
                assert dec.add(f"bad{at}", bad.to(device), kept[at])
            drifted = old.clone()
            int_view(drifted)[int(pos[0])] ^= 2             # a base that differs there
            kept["drifted"] = drifted.to(device)
            assert dec.add("drifted", r.record, kept["drifted"])
        assert not dec.add("short", r.record[:-8], old.to(device))
        results = dict(dec.results())
        assert results.pop("good") and not any(results.values()), results
        assert same_bytes(target.cpu(), new)
        for key, t in kept.items():
            assert same_bytes(t.cpu(), drifted if key == "drifted" else old), key


@pytest.mark.skipif("not _interpreting()", reason="the device kernels run on the host only "
                    "under TRITON_INTERPRET=1 (test_device_kernels_through_the_interpreter)")
def test_interp_one_flush_commits_more_records_than_one_launch_finds(codec):
    """A receiver flush of more records than one kernel launch can look up (an 8B model's
    291 tensors at 0.5 % changed fit one arena) commits every good record."""
    many_records_commit(codec, torch.device("cpu"))


def many_records_commit(codec, device):
    from weightsync.transport.codec import gpu
    g = torch.Generator().manual_seed(5)
    n = gpu.GROUP_TENSORS + 9
    olds = [_rand(g, (64,), torch.bfloat16) for _ in range(n)]
    news = [_flip(o.clone(), 0.1, g) for o in olds]
    enc = gpu.Encoder()
    recs = []
    for at in range(0, n, gpu.GROUP_TENSORS):
        part = [(i, news[i].to(device), olds[i].clone().to(device))
                for i in range(at, min(n, at + gpu.GROUP_TENSORS))]
        recs += enc.finish(enc.launch(part))
    dec = gpu.Decoder(device)
    targets = [o.clone().to(device) for o in olds]
    for r, t in zip(recs, targets):
        assert r.record is not None and dec.add(r.key, r.record, t)
    results = dict(dec.results())
    assert len(results) == n and all(results.values()), \
        [k for k, ok in results.items() if not ok][:5]
    for t, new in zip(targets, news):
        assert same_bytes(t.cpu(), new)


def _sm90_usage(fn, signature: dict, constexprs: dict, warps: int) -> dict:
    """Registers, stack and local bytes per thread of ``fn`` compiled for an H100 (sm_90)
    by Triton's own compiler and tools, no GPU needed."""
    import os
    import re
    import subprocess
    import tempfile
    triton = pytest.importorskip("triton")
    try:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
    except ImportError:
        pytest.skip("this Triton has no ASTSource/GPUTarget")
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                        "cuobjdump")
    if not os.path.exists(tool):
        pytest.skip("Triton ships no cuobjdump here")
    kernel = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs),
                            target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as f:
            f.write(kernel.asm["cubin"])
        out = subprocess.run([tool, "--dump-resource-usage", path], capture_output=True,
                             text=True, timeout=60).stdout
    return {k: int(v) for k, v in re.findall(r"\b(REG|STACK|LOCAL):(\d+)", out)}


@pytest.mark.timeout(300)
def test_device_kernels_fit_an_h100s_registers_without_spilling():
    """The mark reads every weight once: its lanes must not spill to local memory (64-bit
    lane offsets took all 255 registers and spilled at 4096 elements x 4 warps), nor may
    the other kernels."""
    from weightsync.transport.codec import gpu
    if gpu.triton is None:
        pytest.skip("no Triton")
    tl = gpu.tl
    common = {"tab": "*i64", "owner": "*i64"}
    rec = {"ELEM": tl.int16, "POS": tl.int32, "IW": 4, "EB": gpu.EB}
    marks = dict(common, masks="*i32", bcounts="*i32")
    cases = {
        "mark": (gpu._mark, dict(marks, counts="*i64"),
                 {"ELEM": tl.int16, "BLOCK": gpu.BLOCK, "ALIGNED": True}, 255),
        "compact": (gpu._compact, dict(marks, cum="*i64"),
                    {"ELEM": tl.int16, "IW": 4, "BLOCK": gpu.BLOCK}, 255),
        "digest": (gpu._digest, dict(common, digs="*i64"), dict(rec, UELEM=tl.uint16), 255),
        "verify": (gpu._verify, dict(common, digs="*i64", bad="*i32"),
                   dict(rec, UELEM=tl.uint16), 128),
        "commit": (gpu._commit, dict(common, ok="*i32"), rec, 128),
    }
    for name, (fn, sig, consts, most) in cases.items():
        sig = dict(sig, **{k: "constexpr" for k in consts})
        use = _sm90_usage(fn, sig, consts, gpu.WARPS)
        assert use.get("STACK") == 0 and use.get("LOCAL") == 0 and 0 < use["REG"] <= most, \
            (name, use)


@pytest.mark.timeout(600)
def test_device_kernels_through_the_interpreter(tmp_path):
    """The device path of the codec on the host: Triton's interpreter runs the kernels on
    host tensors, and the in-process syncs (records encoded and applied by the kernels,
    base mismatches, tampered records, delta of FP8) run through them."""
    import os
    import subprocess
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    keys = ("interp_ or delta_in_place or corrupted or failed_sync or fp8_and_delta or "
            "gone_mid_delta")
    done = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider",
                           __file__, "-k", keys], env=env, capture_output=True, text=True,
                          timeout=560, cwd=str(tmp_path))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "9 passed" in done.stdout and "skipped" not in done.stdout, done.stdout[-500:]


# -- FP8 ----------------------------------------------------------------------------------
def reference_block_quantize(w: torch.Tensor, block: int = 128):
    """The straightforward quantizer: one block at a time."""
    rows, cols = w.shape
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    s = torch.empty(math.ceil(rows / block), math.ceil(cols / block))
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            blk = w[i * block:(i + 1) * block, j * block:(j + 1) * block].float()
            amax = blk.abs().max()
            scale = amax / 448.0 if amax > 0 else torch.tensor(1.0)
            s[i, j] = scale
            q[i * block:(i + 1) * block, j * block:(j + 1) * block] = \
                (blk / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
    return q, s


@pytest.mark.parametrize("shape", [(256, 384), (130, 200), (1, 5), (300, 129)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fp8_block_matches_reference_and_error_bound(codec, shape, dtype):
    w = (torch.randn(shape, generator=torch.Generator().manual_seed(5)) * 0.02).to(dtype)
    w[:, : min(3, shape[1])] *= 50                           # outliers in some blocks
    given = w.clone()
    q, s = codec.fp8.quantize_block(w)
    assert torch.equal(w, given)                             # the input is left alone
    rq, rs = reference_block_quantize(w)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(s, rs)
    x, err = w.float(), (codec.fp8.dequantize_block(q, s) - w.float()).abs()
    scale = s.repeat_interleave(128, 0).repeat_interleave(128, 1)[: shape[0], : shape[1]]
    bound = torch.maximum(x.abs() / 16, scale / 1024) * (1 + 1e-5)
    assert bool((err <= bound).all()), float((err - bound).max())
    assert float(q.float().abs().max()) == 448.0               # each block's amax -> 448


def test_fp8_zero_blocks_per_tensor_and_layout(codec):
    f = codec.fp8
    q, s = f.quantize_block(torch.zeros(200, 130))
    assert torch.equal(s, torch.ones(2, 2)) and not q.float().any()
    w = torch.randn(64, 48)
    q, s = f.quantize_tensor(w)
    assert s.dim() == 0 and torch.equal(s, w.abs().max() / 448)
    bound = torch.clamp(w.abs() / 16, min=float(s) / 1024) * (1 + 1e-5)
    assert bool(((f.dequantize_tensor(q, s) - w).abs() <= bound).all())
    qz = f.Quantizer("fp8-block")
    items = {"model.embed_tokens.weight": torch.randn(10, 8), "l.0.mlp.up_proj.weight":
             torch.randn(300, 130, dtype=torch.bfloat16), "l.0.input_layernorm.weight":
             torch.randn(8), "l.0.mlp.up_proj.bias": torch.randn(300)}
    out = [p for n, t in items.items() for p in qz.expand(n, t)]
    described = qz.describe([[n, list(t.shape), str(t.dtype)[6:]] for n, t in items.items()])
    assert [[n, list(t.shape), str(t.dtype)[6:]] for n, t in out] == described
    assert [n for n, _ in out].count("l.0.mlp.up_proj.weight_scale_inv") == 1
    assert dict(out)["l.0.mlp.up_proj.weight_scale_inv"].shape == (3, 2)


# -- in-process groups (delta+inproc): every protocol path --------------------------------
class Weights:
    """A small model's tensors that drift like training at a small learning rate."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.g = g
        self.d = {"l.0.proj.weight": _rand(g, (256, 260), torch.bfloat16),
                  "l.0.w32": _rand(g, (64, 80), torch.float32),
                  "l.0.bias": _rand(g, (700,), torch.bfloat16),
                  "mask": _rand(g, (3000,), torch.bool), "count": torch.tensor(7),
                  "empty": torch.empty(0, 4), "fp8": _rand(g, (900,), torch.float8_e4m3fn),
                  "cplx": _rand(g, (400,), torch.complex64),
                  "looks.like.record": torch.frombuffer(bytearray(b"WSDELTA2" + bytes(600)),
                                                        dtype=torch.uint8)}

    def step(self, frac: float = 0.01) -> None:
        for name, t in self.d.items():
            if t.numel() > 1 and name != "looks.like.record":
                _flip(t, frac, self.g)
        self.d["count"] += 1
        self.d["looks.like.record"][8:] ^= 1    # all changed: sent dense, in a RAW record


class Inproc:
    """One trainer and receivers that come and go, all engines in this process."""

    def __init__(self, backend: str = "delta+inproc", **kw) -> None:
        self.backend, self.kw = backend, {"bucket_size": BUCKET, "timeout": 20, **kw}
        self.trainer = Registry.new(backend, role="trainer", **self.kw)

    def receiver(self):
        return Registry.new(self.backend, role="rollout", **self.kw)

    def join(self, receivers: list) -> None:
        engines = [self.trainer] + receivers
        for e in engines:
            e.finalize()
        metas = [e.prepare() for e in engines]
        tk, rk = type(self.trainer).build_topology(1, len(receivers), metas)
        self.trainer.init_process_group(**worker_kwargs(tk, 0))
        for j, e in enumerate(receivers):
            e.init_process_group(**worker_kwargs(rk, j))
        self.members = receivers

    def sync(self, weights: dict, version, params: list):
        async def rx(engine, into):
            got = {}
            it = engine.receive_into(into, version) if into is not None else \
                engine.receive_weights(version)
            async for name, t in it:
                assert name not in got, f"{name} yielded twice"
                got[name] = t.clone()
            return got

        items = list(weights.items()) if isinstance(weights, dict) else weights

        async def main():
            return await asyncio.gather(self.trainer.send_weights(items, version),
                                        *[rx(e, p) for e, p in zip(self.members, params)])
        out = asyncio.run(main())
        return out[0], out[1:]


def _model(weights: Weights) -> dict:
    return {n: t.clone() for n, t in weights.d.items()}


def _exact(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    bad = [n for n in want if not same_bytes(got[n], want[n])]
    assert not bad, bad


def test_delta_in_place_then_missed_version_gets_dense(codec):
    w, g = Weights(), Inproc()
    a, b = g.receiver(), g.receiver()
    pa, pb = _model(w), None                      # b: receive_weights (its own store)
    ptr = pa["l.0.proj.weight"].data_ptr()
    g.join([a, b])
    modes = []
    for v in range(6):
        if v == 2:
            g.join([a])                           # b misses versions 2 and 3
        if v == 4:
            g.join([a, b])
        m, got = g.sync(w.d, v, [pa, pb][: len(g.members)])
        modes.append(m["codec"]["mode"])
        _exact(pa, w.d)
        for yielded in got:
            _exact(yielded, w.d)
        if v in (1, 5):
            assert m["bytes"] < 0.3 * m["codec"]["dense_bytes"], m
            assert (m["codec"]["groups"] > 0) == _interpreting()     # the device kernels
        w.step()
    assert modes == ["dense", "delta", "delta", "delta", "dense", "delta"], modes
    assert pa["l.0.proj.weight"].data_ptr() == ptr
    assert g.trainer.codec_memory()["trainer_base_bytes"] > 0
    late = g.receiver()                           # a fresh engine joins: dense, exact
    g.join([a, b, late])
    m, got = g.sync(w.d, 6, [pa, None, None])
    assert m["codec"]["mode"] == "dense" and "rollout rank 2" in m["codec"]["reason"]
    _exact(got[2], w.d)


def test_delta_in_place_from_one_refilled_export_buffer(codec):
    """An export that refills one buffer for every name (its next item rewrites the bytes):
    each name's record is made from the bytes it had when it was yielded."""
    gen = torch.Generator().manual_seed(2)
    want = {f"l.{i}.w": _rand(gen, (128, 96), torch.bfloat16) for i in range(4)}
    g = Inproc()
    r = g.receiver()
    g.join([r])
    params = {n: torch.zeros_like(t) for n, t in want.items()}
    buf = torch.empty(128, 96, dtype=torch.bfloat16)

    def refilled():
        for n, t in want.items():
            buf.copy_(t)
            yield n, buf
    for v in range(3):
        m, _ = g.sync(refilled(), v, [params])
        _exact(params, want)
        if v:
            assert m["codec"]["mode"] == "delta" and m["codec"]["delta"] == len(want), m
            assert (m["codec"]["groups"] > 0) == _interpreting()     # the device kernels
        for t in want.values():
            _flip(t, 0.01, gen)


def test_corrupted_base_and_corrupted_record_are_resent_dense(codec):
    delta = codec.delta
    w, g = Weights(), Inproc()
    a, b = g.receiver(), g.receiver()
    pa, pb = _model(w), _model(w)
    g.join([a, b])
    for v in range(2):
        g.sync(w.d, v, [pa, pb])
        w.step()
    pa["l.0.w32"][3, 3] += 1.0                    # rollout rank 0's model drifts
    m, got = g.sync(w.d, 2, [pa, pb])
    assert m["codec"]["resent"] == 1 and m["codec"]["resend_requests"] == [1, 0], m["codec"]
    assert a.last_receive["base_mismatch"] == 1 and a.last_receive["resent"] == 1
    assert b.last_receive["base_mismatch"] == 0 and m["rounds"] == 2
    _exact(pa, w.d), _exact(pb, w.d), _exact(got[0], w.d)
    w.step()
    inner_send = g.trainer.inner.send_weights

    async def tampering(items, version=None):
        async def gen():
            async for name, t in aiter_items(items):
                if name == "l.0.proj.weight" and delta.is_record(t):
                    t = t.clone()
                    t[delta.parse(t).values_at] ^= 1
                yield name, t
        return await inner_send(gen(), version)

    g.trainer.inner.send_weights = tampering
    m, _ = g.sync(w.d, 3, [pa, pb])
    assert m["codec"]["resent"] == 1 and m["codec"]["resend_requests"] == [1, 1]
    assert a.last_receive["result_mismatch"] == b.last_receive["result_mismatch"] == 1
    _exact(pa, w.d), _exact(pb, w.d)


def test_drop_and_readd_every_few_syncs(codec):
    """The benchmark runs 100 syncs, re-adding every 10; here 30, re-adding every 5."""
    w, g = Weights(), Inproc()
    a, b = g.receiver(), g.receiver()
    pa, pb = _model(w), _model(w)
    dense, joined = [], None
    for v in range(30):
        members = [a] if (v // 5) % 2 else [a, b]
        if members != joined:
            g.join(members)
            joined = members
        m, _ = g.sync(w.d, v, [pa, pb][: len(members)])
        _exact(pa, w.d)
        if b in members:
            _exact(pb, w.d)
        assert m["codec"]["resent"] == 0
        if m["codec"]["mode"] == "dense":
            dense.append(v)
        w.step(0.002)
    assert dense == [0, 10, 20], dense


def test_failed_sync_means_dense_next_time(codec):
    w, g = Weights(), Inproc(timeout=5)
    a = g.receiver()
    pa = _model(w)
    g.join([a])
    g.sync(w.d, 0, [pa])
    w.step()

    async def broken():
        send = asyncio.ensure_future(g.trainer.send_weights(list(w.d.items()), 1))
        it = a.receive_into(pa, 1)
        for _ in range(3):
            await it.__anext__()
        await it.aclose()                         # the consumer gives up mid-sync
        with pytest.raises(Exception):
            await send
    asyncio.run(broken())
    g.join([a])
    m, _ = g.sync(w.d, 2, [pa])
    assert m["codec"]["mode"] == "dense"
    _exact(pa, w.d)


def test_receiver_gone_mid_delta_leaves_old_or_new_never_wrong(codec):
    """Two receivers; one stops in the middle of a delta sync. The sync fails; the other
    receiver's tensors each hold either the old or the new version's bytes (nothing in
    between), no base is held after it, and the next sync is dense and exact."""
    w, g = Weights(), Inproc(timeout=5)
    a, b = g.receiver(), g.receiver()
    pa, pb = _model(w), _model(w)
    g.join([a, b])
    g.sync(w.d, 0, [pa, pb])
    old = _model(w)
    w.step(0.02)

    async def broken():
        send = asyncio.ensure_future(g.trainer.send_weights(list(w.d.items()), 1))
        got = asyncio.ensure_future(_drain(a.receive_into(pa, 1)))
        it = b.receive_into(pb, 1)
        await it.__anext__()
        await it.aclose()                         # b gives up after one tensor
        for fut in (send, got):
            with pytest.raises(Exception):
                await fut
    asyncio.run(broken())
    for n in w.d:
        assert same_bytes(pa[n], old[n]) or same_bytes(pa[n], w.d[n]), n
    assert a.rx.held == {} and g.trainer.bases.id is None
    g.join([a, b])
    m, _ = g.sync(w.d, 2, [pa, pb])
    assert m["codec"]["mode"] == "dense"
    _exact(pa, w.d), _exact(pb, w.d)


async def _drain(it):
    async for _ in it:
        pass


def drift_and_kill_rollout_1(engine, role, rank):
    """``GroupSpec.hook``: drifting tensors, and rollout rank 1 dies in the second sync."""
    import faults
    drift_hook(engine, role, rank)
    faults.kill_rollout_1(engine, role, rank)


@pytest.mark.timeout(180)
def test_receiver_killed_mid_delta_over_processes(codec):
    """``delta+shm`` across processes: a receiver killed in the first delta sync fails the
    sync on every other worker within the timeout, naming a rollout rank."""
    spec = CodecSpec(backend="delta+shm", hook=f"{__name__}:drift_and_kill_rollout_1",
                     receivers=2, steps=3, tiny=100, timeout=90,
                     engine_kwargs={"bucket_size": BUCKET, "timeout": 6})
    trainer, r0, r1 = run_group(spec)
    assert r1 == {"died": 17}
    assert len(trainer["steps"]) == 1 and trainer["errors"], trainer
    assert trainer["steps"][0]["codec"]["mode"] == "dense"
    assert "rollout rank" in trainer["errors"][0], trainer["errors"]
    assert len(r0["steps"]) == 1 and r0["errors"], r0


def test_fp8_and_delta_of_fp8(codec):
    quantize_block = codec.fp8.quantize_block
    gen = torch.Generator().manual_seed(9)
    src = {"l.proj.weight": torch.randn(300, 260, generator=gen).to(torch.bfloat16),
           "l.norm.weight": torch.randn(260, generator=gen).to(torch.bfloat16)}
    for backend in ("fp8+inproc", "delta+fp8+inproc"):
        g = Inproc(backend)
        r = g.receiver()
        params = {"l.proj.weight": torch.zeros(300, 260, dtype=torch.float8_e4m3fn),
                  "l.proj.weight_scale_inv": torch.zeros(3, 3),
                  "l.norm.weight": torch.zeros(260, dtype=torch.bfloat16)}
        g.join([r])
        metrics = []
        for v in range(3):
            m, _ = g.sync(src, v, [params])
            metrics.append(m)
            q, s = quantize_block(src["l.proj.weight"])
            assert same_bytes(params["l.proj.weight"], q)
            assert torch.equal(params["l.proj.weight_scale_inv"], s)
            assert same_bytes(params["l.norm.weight"], src["l.norm.weight"])
            w = src["l.proj.weight"].view(torch.int16)
            w[v::97] += 1                          # a few bf16 values move by one ulp
        c = metrics[1]["codec"]
        assert c["dense_bytes"] < 0.52 * c["source_bytes"]      # fp8: half, plus scales
        if backend.startswith("delta"):
            assert metrics[1]["bytes"] < 0.2 * c["dense_bytes"], c


def test_options_env_bound_and_names(codec, monkeypatch):
    codec_backend_name = codec.codec_backend_name
    assert codec_backend_name("shm", delta=True, quantize="fp8-block") == "delta+fp8+shm"
    assert codec_backend_name("shm") == "shm"
    assert {"delta+shm", "fp8+collective", "delta+fp8+nixl"} <= set(Registry.names())
    assert "shards" not in Registry.get("delta+nixl").capabilities
    with pytest.raises(ValueError):
        Registry.new("delta+inproc", delta="sometimes")
    assert not Registry.new("delta+inproc", delta="auto")._delta_on       # same process
    assert not Registry.new("delta+shm", delta="auto")._delta_on          # memory speed
    assert Registry.new("delta+collective", delta="auto")._delta_on
    monkeypatch.setenv("WEIGHTSYNC_DELTA", "0")
    assert not Registry.new("delta+inproc")._delta_on
    monkeypatch.delenv("WEIGHTSYNC_DELTA")
    w, g = Weights(), Inproc(delta_max_bytes=40_000, dtype=torch.bfloat16)
    a = g.receiver()
    pa = {n: (t.to(torch.bfloat16) if t.dtype == torch.float32 else t.clone())
          for n, t in w.d.items()}
    g.join([a])
    for v in range(3):
        m, _ = g.sync(w.d, v, [pa])
        _exact(pa, {n: (t.to(torch.bfloat16) if t.dtype == torch.float32 else t)
                    for n, t in w.d.items()})
        assert m["codec"]["base_bytes"] <= 40_000 and m["codec"]["untracked"] >= 1
        w.step()


def test_every_entry_point_resolves_the_options_alike(codec, monkeypatch):
    """A plain backend with delta/FP8 asked for (keyword, else WEIGHTSYNC_*) becomes its
    codec name; a codec name keeps its name and takes the keywords; bad values are
    ValueErrors. The manager and connect() both go through resolve_backend."""
    from weightsync.orchestration.manager import CheckpointEngineManager

    resolve = codec.resolve_backend
    assert resolve("shm") == ("shm", {})
    assert resolve("shm", delta=True) == ("delta+shm", {"delta": True, "quantize": None})
    assert resolve("nixl", quantize="fp8-block")[0] == "fp8+nixl"
    assert resolve("collective", delta="auto", quantize="fp8-tensor") == \
        ("delta+fp8+collective", {"delta": "auto", "quantize": "fp8-tensor"})
    assert resolve("delta+shm", delta=False) == ("delta+shm", {"delta": False})
    assert codec.split_backend_name("delta+fp8+cuda_ipc") == ("delta+fp8", "cuda_ipc")
    with pytest.raises(ValueError):
        resolve("shm", delta="maybe")
    with pytest.raises(ValueError):
        resolve("shm", quantize="int4")
    monkeypatch.setenv("WEIGHTSYNC_DELTA", "1")
    monkeypatch.setenv("WEIGHTSYNC_QUANTIZE", "fp8-block")
    assert resolve("shm")[0] == "delta+fp8+shm"
    assert resolve("shm", delta=False, quantize=None) == ("shm", {})   # keywords win
    monkeypatch.delenv("WEIGHTSYNC_QUANTIZE")
    m = CheckpointEngineManager("inproc", object(), [])
    assert m.backend == "delta+inproc" and m.codec.delta is True and m.codec.quantize is None
    monkeypatch.delenv("WEIGHTSYNC_DELTA")
    m = CheckpointEngineManager("shm", object(), [], quantize="fp8-tensor")
    assert m.backend == "fp8+shm" and m.codec.quantize == "fp8-tensor"
    assert CheckpointEngineManager("shm", object(), []).codec is None


# -- across processes, with the harness --------------------------------------------------
@dataclass(kw_only=True)
class CodecSpec(GroupSpec):
    """A ``GroupSpec`` whose unpickling in a worker imports this module (so the codec names
    are registered there before the harness creates the engine)."""


RATES = (0.0, 0.002, 0.03, 0.3, 1.0)


_ORIGINAL = None


def drifting_tensors(seed: int, *, bucket_size: int, tiny: int = 200):
    """The harness's tensor set at step 0, then ``seed`` steps of drift: per tensor, a rate
    of changed elements from ``RATES`` (so records of every form, and dense ones)."""
    out = []
    for i, (name, t) in enumerate(_ORIGINAL(0, bucket_size=bucket_size, tiny=tiny)):
        c = t.contiguous().clone()
        for step in range(1, seed + 1):
            if c.numel() > 1:
                _flip(c, RATES[i % len(RATES)], torch.Generator().manual_seed(7919 * i + step))
        out.append((name, c if t.is_contiguous() else t.clone().copy_(c)))
    return out


def drift_hook(engine, role, rank):
    """``GroupSpec.hook``: make the harness's tensors drift instead of changing entirely."""
    global _ORIGINAL
    from weightsync.testing import harness
    if _ORIGINAL is None:
        _ORIGINAL = harness.make_tensors
    harness.make_tensors = drifting_tensors


@pytest.mark.timeout(240)
@pytest.mark.parametrize("backend,trainers,receivers,pattern", [
    ("delta+shm", 1, 2, "full"), ("delta+collective", 2, 1, "disjoint"),
    ("delta+nixl", 1, 1, "full")])
def test_delta_over_real_processes(codec, backend, trainers, receivers, pattern):
    if backend not in Registry.names():
        pytest.skip(f"{backend} unavailable: {Registry.import_error(backend)}")
    spec = CodecSpec(backend=backend, trainers=trainers, receivers=receivers, steps=3, tiny=40,
                     pattern=pattern, hook=f"{__name__}:drift_hook",
                     engine_kwargs={"bucket_size": BUCKET, "timeout": 60})
    results = run_group(spec)
    assert_clean(results, spec)
    for r in results:
        if r["role"] != "trainer":
            continue
        c = [s["codec"] for s in r["steps"]]
        assert [x["mode"] for x in c] == ["dense", "delta", "delta"], c
        assert all(x["delta"] > 0 and x["resent"] == 0 for x in c[1:])
        # a fifth of the tensors change entirely, another fifth by 30 %: about 0.7 x
        assert r["steps"][2]["bytes"] < 0.8 * r["steps"][0]["bytes"], c


@pytest.mark.parametrize("pattern", ["full", "disjoint"])
def test_two_trainer_ranks_in_process(codec, pattern, monkeypatch):
    """Two trainer ranks (names yielded by both, or split), two receivers: each rank decides
    for its own tensors, and receivers get every name once, exact."""
    from weightsync.testing import harness
    monkeypatch.setattr(sys.modules[__name__], "_ORIGINAL", harness.make_tensors)
    monkeypatch.setattr(harness, "make_tensors", drifting_tensors)
    spec = GroupSpec(backend="delta+inproc", trainers=2, receivers=2, steps=3, tiny=30,
                     pattern=pattern, engine_kwargs={"bucket_size": BUCKET, "timeout": 30})
    results = run_group(spec)
    assert_clean(results, spec)
    for r in results[:2]:
        assert [s["codec"]["mode"] for s in r["steps"]] == ["dense", "delta", "delta"]


def _two_ranks_one_sync(backend: str = "delta+inproc", *, skip_done: tuple = ()):
    """Two trainer ranks (disjoint halves of one model) and two receivers, all engines in
    this process, one sync. ``skip_done``: (role, rank) pairs whose ``done`` is dropped,
    as if that engine died after its last read."""
    kw = {"bucket_size": BUCKET, "timeout": 20}
    trainers = [Registry.new(backend, role="trainer", **kw) for _ in range(2)]
    receivers = [Registry.new(backend, role="rollout", **kw) for _ in range(2)]
    engines = trainers + receivers
    metas = [e.prepare() for e in engines]
    tk, rk = type(trainers[0]).build_topology(2, 2, metas)
    for i, e in enumerate(trainers):
        e.init_process_group(**worker_kwargs(tk, i))
    for j, e in enumerate(receivers):
        e.init_process_group(**worker_kwargs(rk, j))
    for e in engines:
        link = e._link
        if (link.role, link.rank) in skip_done:
            link.done = lambda seq: None
    names = sorted(Weights().d)
    w = _model(Weights())
    halves = [[(n, w[n]) for n in names[0::2]], [(n, w[n]) for n in names[1::2]]]

    async def rx(engine):
        return {n: t.clone() async for n, t in engine.receive_weights(1)}

    async def main():
        return await asyncio.gather(*[t.send_weights(h, 1) for t, h in zip(trainers, halves)],
                                    *[rx(e) for e in receivers])
    out = asyncio.run(main())
    for got in out[2:]:
        _exact(got, w)
    return trainers, receivers


def test_rank0_closes_the_store_without_waiting_on_a_rank_that_finished(codec, caplog):
    """Every trainer rank prepares a store (it learns its rank only at init), but only rank
    0's is the group's: a higher rank must still post ``done``, or rank 0's finalize waits
    out the whole drain bound (it did: 10 s per finalize with 2+ trainer ranks)."""
    from weightsync.transport.codec import engine as codec_engine
    trainers, receivers = _two_ranks_one_sync()
    for e in receivers + trainers[1:]:
        e.finalize()
    caplog.set_level("WARNING", logger="weightsync")
    t0 = time.monotonic()
    trainers[0].finalize()
    took = time.monotonic() - t0
    assert not [r for r in caplog.records if "drain" in r.getMessage()], caplog.text
    # a hang-guard, not a timing goal: the bound itself is min(timeout 20, 10 s)
    assert took < codec_engine.DRAIN_S / 2, took


def test_rank0_closes_the_store_after_the_bound_naming_who_never_finished(codec, caplog,
                                                                         monkeypatch):
    """A receiver that never says ``done`` (died after its reads) costs rank 0 at most the
    drain bound, and the warning names it."""
    from weightsync.transport.codec import engine as codec_engine
    monkeypatch.setattr(codec_engine, "DRAIN_S", 0.5)
    trainers, receivers = _two_ranks_one_sync(skip_done=(("rollout", 1),))
    for e in receivers + trainers[1:]:
        e.finalize()
    caplog.set_level("WARNING", logger="weightsync")
    trainers[0].finalize()
    msgs = [r.getMessage() for r in caplog.records if "drain" in r.getMessage()]
    assert len(msgs) == 1 and "rollout rank 1" in msgs[0] and "trainer rank 1" not in msgs[0], \
        caplog.text
