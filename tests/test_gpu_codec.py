"""The codec on a real GPU (issue 16): FP8 block quantization on CUDA against the CPU
quantizer (bit for bit), and delta syncs of CUDA tensors over ``cuda_ipc`` between
processes (records encoded and applied on the device). Skipped without CUDA."""

import pytest
import torch

from weightsync.testing import run_group
from syncchecks import assert_clean
from test_codec import BUCKET, CodecSpec

pytestmark = pytest.mark.gpu


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
    assert trainer[2]["bytes"] < 0.8 * trainer[0]["bytes"]
