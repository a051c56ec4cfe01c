"""The codec on a real GPU: FP8 block quantization on CUDA against the CPU quantizer (bit for
bit); the delta codec's device kernels against the host's records (positions of 4 and 8
bytes); in-process delta syncs of CUDA tensors (records diffed, checked and applied by the
kernels, base mismatches and tampered records sent again dense, delta of FP8); and delta
syncs over ``cuda_ipc`` between processes. Skipped without CUDA."""

import types

import pytest
import torch

from weightsync.testing import run_group
from weightsync.testing.harness import same_bytes
from syncchecks import assert_clean
from test_codec import BUCKET, CodecSpec, Inproc, Weights, device_kernel_checks, many_records_commit

pytestmark = pytest.mark.gpu
DEVICE = "cuda"


def _codec():
    from weightsync.transport.codec import delta, kernels
    return types.SimpleNamespace(delta=delta, kernels=kernels)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("shape", [(1000, 1300), (4096, 4096), (7, 129)])
def test_fp8_block_on_cuda_equals_cpu(shape):
    from weightsync.transport.codec.fp8 import dequantize_block, quantize_block
    w = (torch.randn(shape, generator=torch.Generator().manual_seed(3)) * 0.05).to(torch.bfloat16)
    q_cpu, s_cpu = quantize_block(w)
    q_gpu, s_gpu = quantize_block(w.cuda())
    assert torch.equal(s_gpu.cpu(), s_cpu)
    assert torch.equal(q_gpu.cpu().view(torch.uint8), q_cpu.view(torch.uint8))
    err = (dequantize_block(q_gpu, s_gpu).cpu() - w.float()).abs()
    bound = torch.maximum(w.float().abs() / 16, s_cpu.repeat_interleave(128, 0)
                          .repeat_interleave(128, 1)[: shape[0], : shape[1]] / 1024)
    assert bool((err <= bound * 1.0001).all())


@pytest.mark.timeout(120)
@pytest.mark.parametrize("block", [None, 256, 1024])
def test_device_kernels_make_and_check_the_hosts_records(block, monkeypatch):
    """Also with other elements per program (the kernels row's other shapes)."""
    from weightsync.transport.codec import gpu
    if block is not None:
        monkeypatch.setattr(gpu, "BLOCK", block)
    device_kernel_checks(_codec(), torch.device("cuda"))


@pytest.mark.timeout(120)
def test_one_flush_commits_more_records_than_one_launch_finds():
    many_records_commit(_codec(), torch.device("cuda"))


@pytest.mark.timeout(300)
def test_a_tensor_past_two_billion_elements_takes_8_byte_positions():
    """Positions past 2**31 go in 8 bytes; the record applies exactly, the base moves along."""
    from weightsync.transport.codec import delta, gpu
    n = (1 << 31) + 4096
    new = torch.randint(-100, 100, (n // 4096, 4096), dtype=torch.int8, device="cuda")
    base = new.clone()
    flat = new.view(-1)
    pos = torch.tensor([0, 7, 1 << 30, (1 << 31) - 1, 1 << 31, n - 1], device="cuda")
    flat[pos] += 1
    enc = gpu.Encoder()
    (got,) = enc.finish(enc.launch([("w", new, base)]))
    assert got.changed == pos.numel() and torch.equal(base, new)
    head = delta.parse(got.record)
    assert head.index_width == 8 and head.count == pos.numel()
    target = new.clone()
    target.view(-1)[pos] -= 1                                # the old version
    dec = gpu.Decoder(torch.device("cuda"))
    assert dec.add("w", got.record, target)
    assert dec.results() == [("w", True)]
    assert torch.equal(target, new)


def _cuda_weights() -> Weights:
    w = Weights()
    w.d = {n: t.to(DEVICE) for n, t in w.d.items()}
    return w


def _exact(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    bad = [n for n in want if not same_bytes(got[n].cpu(), want[n].cpu())]
    assert not bad, bad


@pytest.mark.timeout(300)
def test_delta_syncs_of_cuda_tensors_in_process():
    """delta+inproc with CUDA tensors: receive_into and receive_weights, exact at every
    sync; delta syncs go through the device kernels; a receiver whose tensor was written
    since, and a record changed on its way, are sent again dense; exact after."""
    w, g = _cuda_weights(), Inproc()
    a, b = g.receiver(), g.receiver()
    pa = {n: t.clone() for n, t in w.d.items()}
    g.join([a, b])
    for v in range(4):
        m, got = g.sync(w.d, v, [pa, None])
        assert m["codec"]["mode"] == ("dense" if v == 0 else "delta"), m["codec"]
        assert m["codec"]["resent"] == 0
        if v:
            assert m["codec"]["groups"] > 0 and m["bytes"] < 0.3 * m["codec"]["dense_bytes"]
        _exact(pa, w.d)
        _exact(got[1], w.d)
        w.step()
    pa["l.0.w32"][3, 3] += 1.0                    # rollout rank 0's model drifts
    m, got = g.sync(w.d, 4, [pa, None])
    assert m["codec"]["resent"] == 1 and a.last_receive["base_mismatch"] == 1
    _exact(pa, w.d), _exact(got[1], w.d)
    w.step()
    from weightsync.transport.codec import delta
    from weightsync.transport.tensors import aiter_items
    inner_send = g.trainer.inner.send_weights

    async def tampering(items, version=None):
        async def gen():
            async for name, t in aiter_items(items):
                if name == "l.0.proj.weight" and t.dtype == torch.uint8 and t.dim() == 1:
                    t = t.clone()
                    t[delta.parse(t).values_at] ^= 1
                yield name, t
        return await inner_send(gen(), version)
    g.trainer.inner.send_weights = tampering
    m, got = g.sync(w.d, 5, [pa, None])
    assert m["codec"]["resent"] == 1 and a.last_receive["result_mismatch"] == 1
    _exact(pa, w.d), _exact(got[1], w.d)


@pytest.mark.timeout(300)
def test_delta_of_fp8_on_cuda_in_process():
    from weightsync.transport.codec.fp8 import quantize_block
    gen = torch.Generator().manual_seed(9)
    src = {"l.proj.weight": torch.randn(300, 260, generator=gen).to(torch.bfloat16).cuda(),
           "l.norm.weight": torch.randn(260, generator=gen).to(torch.bfloat16).cuda()}
    g = Inproc("delta+fp8+inproc")
    r = g.receiver()
    params = {"l.proj.weight": torch.zeros(300, 260, dtype=torch.float8_e4m3fn, device="cuda"),
              "l.proj.weight_scale_inv": torch.zeros(3, 3, device="cuda"),
              "l.norm.weight": torch.zeros(260, dtype=torch.bfloat16, device="cuda")}
    g.join([r])
    for v in range(3):
        m, _ = g.sync(src, v, [params])
        q, s = quantize_block(src["l.proj.weight"])
        assert same_bytes(params["l.proj.weight"].cpu(), q.cpu())
        assert torch.equal(params["l.proj.weight_scale_inv"], s)
        assert same_bytes(params["l.norm.weight"].cpu(), src["l.norm.weight"].cpu())
        if v:
            assert m["codec"]["mode"] == "delta" and m["codec"]["delta"] >= 1
        src["l.proj.weight"].view(torch.int16)[v::97] += 1   # a few values move by one ulp


@pytest.mark.timeout(300)
@pytest.mark.parametrize("receivers", [1, 2])
def test_delta_over_cuda_ipc(receivers):
    spec = CodecSpec(backend="delta+cuda_ipc", device="cuda", receivers=receivers, steps=3,
                     tiny=40, hook="test_codec:drift_hook",
                     engine_kwargs={"bucket_size": BUCKET, "timeout": 60, "device": "cuda"})
    results = run_group(spec)
    assert_clean(results, spec)
    trainer = results[0]["steps"]
    assert [s["codec"]["mode"] for s in trainer] == ["dense", "delta", "delta"]
    assert all(s["codec"]["delta"] > 0 and s["codec"]["resent"] == 0 for s in trainer[1:])
    assert all(s["codec"]["groups"] > 0 for s in trainer[1:])
    assert trainer[2]["bytes"] < 0.8 * trainer[0]["bytes"]
