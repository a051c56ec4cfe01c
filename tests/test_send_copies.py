"""Copies a trainer makes to send: a tensor larger than a bucket goes out in chunks, and is
cast to the wire dtype and made contiguous once per sync, not once per chunk."""

import json

import pytest
import torch

from weightsync.testing import GroupSpec, run_group
from syncchecks import assert_clean

BUCKET = 64 * 1024


def cast_count_hook(engine, role, rank):
    """Trainer: count, per sync and shape, the ``Tensor.to`` calls that cast and the
    ``Tensor.contiguous`` calls that copy inside ``send_weights``; written to
    ``$WS_CASTS_OUT``."""
    if role != "trainer":
        return
    import os
    import torch
    on, syncs = [False], []
    to, contiguous = torch.Tensor.to, torch.Tensor.contiguous

    def counted(orig, kind):
        def call(self, *args, **kwargs):
            out = orig(self, *args, **kwargs)
            copied = out.dtype != self.dtype if kind == "cast" else out.data_ptr() != self.data_ptr()
            if on[0] and copied:
                key = f"{kind} {tuple(self.shape)}"
                syncs[-1][key] = syncs[-1].get(key, 0) + 1
            return out
        return call

    torch.Tensor.to = counted(to, "cast")
    torch.Tensor.contiguous = counted(contiguous, "contiguous")
    send, finalize = engine.send_weights, engine.finalize

    async def send_weights(*args, **kwargs):
        syncs.append({})
        on[0] = True
        try:
            return await send(*args, **kwargs)
        finally:
            on[0] = False

    def done():
        with open(os.environ["WS_CASTS_OUT"], "w") as f:
            json.dump(syncs, f)
        finalize()

    engine.send_weights, engine.finalize = send_weights, done


@pytest.mark.timeout(180)
@pytest.mark.parametrize("backend", ["shm", "collective"])
def test_a_chunked_tensor_is_cast_once_per_sync(backend, monkeypatch, tmp_path):
    monkeypatch.setenv("WS_CASTS_OUT", str(tmp_path / "casts.json"))
    spec = GroupSpec(backend=backend, steps=2, tiny=10, hook="test_send_copies:cast_count_hook",
                     engine_kwargs={"bucket_size": BUCKET, "timeout": 60, "dtype": torch.bfloat16})
    results = run_group(spec)
    assert_clean(results, spec)
    big = (5 * BUCKET // 2) // 4 + 3          # the harness's "big.f32": 2 chunks in bf16
    syncs = json.loads((tmp_path / "casts.json").read_text())
    assert len(syncs) == 2
    for counts in syncs:
        assert counts.get(f"cast ({big},)") == 1, json.dumps(counts)
