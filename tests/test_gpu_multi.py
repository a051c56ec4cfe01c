"""Every GPU backend across two GPUs: the trainer on GPU 0, rollout ranks on GPU 1.

Conformance (every dtype incl. fp8, 0-d, empty, non-contiguous, bigger than a bucket,
many tiny; three syncs; every name once, bit-exact) and one fault per backend: a rollout
process killed in the middle of a sync makes the others fail with an error naming it
within a few timeouts, never a hang. ``collective`` runs on NCCL, which takes one GPU per
rank, so its groups are 1 -> 1 on two GPUs (the fault: the only receiver dies); the others
run 1 -> 2 with both receivers on GPU 1. Skipped with fewer than two GPUs
(``benchmarks/run_multi_gpu.sh`` runs it on the device)."""

import importlib.util

import pytest
import torch

from syncchecks import assert_clean
from weightsync.testing import GroupSpec, run_group

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                       reason="needs two GPUs"),
]

BUCKET = 1 << 20
TIMEOUT = 15     # the engines' timeout (NCCL's first collective takes seconds to connect)
BACKENDS = ["collective", "cuda_ipc", "nixl"]


def _spec(backend: str, **kw) -> GroupSpec:
    if backend == "nixl" and importlib.util.find_spec("nixl") is None:
        pytest.skip("nixl is not installed")
    receivers = 1 if backend == "collective" else 2
    engine_kwargs = {"bucket_size": BUCKET, "timeout": TIMEOUT, "device": "cuda",
                     **kw.pop("engine_kwargs", {})}
    kw.setdefault("steps", 3)
    kw.setdefault("timeout", 240)
    return GroupSpec(backend=backend, receivers=receivers, device="cuda", tiny=200,
                     gpus=(0,) + (1,) * receivers, engine_kwargs=engine_kwargs, **kw)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend", BACKENDS)
def test_every_dtype_across_gpus_three_syncs(backend):
    spec = _spec(backend)
    assert_clean(run_group(spec), spec)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend", ["collective", "cuda_ipc"])
def test_cast_to_bf16_across_gpus(backend):
    spec = _spec(backend, steps=2, engine_kwargs={"dtype": torch.bfloat16})
    assert_clean(run_group(spec), spec)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend", BACKENDS)
def test_rollout_killed_mid_sync_across_gpus(backend):
    """The receiver dies while its second sync yields tensors. A nixl receiver yields only
    once it has pulled everything and reported so, so for its trainer that sync is
    complete: the failure shows in the next one."""
    hook = "faults:kill_rollout_0" if backend == "collective" else "faults:kill_rollout_1"
    results = run_group(_spec(backend, hook=hook))
    trainer, rollouts = results[0], results[1:]
    dead_rank = 0 if backend == "collective" else 1
    assert rollouts[dead_rank] == {"died": 17}, rollouts[dead_rank]
    done = 2 if backend == "nixl" else 1            # syncs that completed before the error
    assert len(trainer["steps"]) == done and trainer["errors"], trainer
    assert f"rollout rank {dead_rank}" in trainer["errors"][0], trainer
    assert trainer["failed_after_s"] < 3 * TIMEOUT, trainer
    if backend != "collective":           # the surviving receiver is told, not left waiting
        r0 = rollouts[0]
        assert len(r0["steps"]) == done and r0["errors"], r0
        assert r0["failed_after_s"] < 3 * TIMEOUT, r0


@pytest.mark.timeout(300)
def test_collective_consumer_reads_a_slot_only_after_its_broadcast():
    """NCCL receivers hand a slot to the consumer only once the broadcast into it
    completed. With the trainer's broadcasts running late, the bytes are exact; the mutant
    without that wait reads stale slots (the test can fail)."""
    spec = _spec("collective", hook="faults:slow_trainer_gpu", steps=2)
    assert_clean(run_group(spec), spec)
    mutant = run_group(_spec("collective", hook="faults:collective_reads_unordered", steps=2))
    assert any(step["bad"] for step in mutant[1]["steps"]), mutant[1]
