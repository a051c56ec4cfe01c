"""A rollout that fails before it reads (its loader refuses, its check raises) tells the
group at once (``abort_receive``): every peer of that sync ends within a fraction of the
timeout, with an error that names the rollout and carries its text, and the next sync of
a rebuilt group is exact. The managers' paths are in test_abort_paths.py."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

import faults
from weightsync.testing import GroupSpec, run_group
from weightsync.transport import CheckpointEngineRegistry
from weightsync.transport.base import worker_kwargs

TIMEOUT = 40.0        # long: a peer left to its timeout fails the bounds below
BACKENDS = [b for b in ("shm", "collective", "nixl", "delta+shm")
            if b in CheckpointEngineRegistry.names()]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_rollout_that_fails_before_reading_ends_the_sync_for_everyone(backend):
    spec = GroupSpec(backend=backend, hook="faults:refuse_rollout_1", tiny=50, steps=3,
                     receivers=2, timeout=150,
                     engine_kwargs={"bucket_size": 64 * 1024, "timeout": TIMEOUT})
    trainer, r0, r1 = run_group(spec)
    assert len(r1["steps"]) == 1 and faults.REFUSAL in r1["errors"][0], r1
    assert len(trainer["steps"]) == 1 and trainer["errors"], trainer
    err = trainer["errors"][0]
    assert err.startswith("PeerFailed") and "rollout rank 1" in err and faults.REFUSAL in err, err
    assert trainer["origins"] == ["rollout rank 1"], trainer
    assert trainer["failed_after_s"] < TIMEOUT / 8, trainer
    if len(r0["steps"]) > 1:    # nixl: each receiver pulls on its own; it got all of it
        assert backend == "nixl" and not any(r0["steps"][1][k] for k in ("missing", "bad"))
    else:                       # told, not left waiting: by the trainer's relay of the
        # report, or by the trainer ending the sync (its closed link) when that comes first
        assert r0["errors"] and r0["failed_after_s"] < TIMEOUT / 8, r0
        assert r0["origins"][0] in ("rollout rank 1", "trainer rank 0"), r0


@pytest.mark.timeout(180)
@pytest.mark.parametrize("backend", ["shm", "collective"])
def test_a_report_of_the_next_sync_read_while_confirming_this_one_is_kept(backend):
    """Rollout rank 1 confirms sync 1, then refuses sync 2 at once, while the trainer still
    waits for rollout rank 0's (late) confirmation of sync 1: sync 1 completes everywhere,
    and sync 2 fails at its start with rollout rank 1's error (not at the timeout)."""
    spec = GroupSpec(backend=backend, hook="faults:refuse_rollout_1_while_0_confirms",
                     tiny=50, steps=3, receivers=2, timeout=150,
                     engine_kwargs={"bucket_size": 64 * 1024, "timeout": TIMEOUT})
    trainer, r0, r1 = run_group(spec)
    assert len(r0["steps"]) >= 1 and len(r1["steps"]) == 1, (r0, r1)
    assert len(trainer["steps"]) == 1 and faults.REFUSAL in trainer["errors"][0], trainer
    assert trainer["failed_after_s"] < TIMEOUT / 8, trainer


@pytest.mark.timeout(60)
def test_inproc_rollout_that_fails_before_reading_ends_the_sync_for_everyone():
    kw = {"bucket_size": 1 << 16, "timeout": TIMEOUT}
    cls = CheckpointEngineRegistry.get("inproc")
    tr, r0, r1 = cls(role="trainer", **kw), cls(role="rollout", **kw), cls(role="rollout", **kw)
    tk, rk = cls.build_topology(1, 2, [e.prepare() for e in (tr, r0, r1)])
    tr.init_process_group(**worker_kwargs(tk, 0))
    for j, e in enumerate((r0, r1)):
        e.init_process_group(**worker_kwargs(rk, j))

    async def receive(e):
        return [n async for n, _ in e.receive_weights(version=1)]

    async def refuse():
        await asyncio.sleep(0.2)
        r1.abort_receive(RuntimeError(faults.REFUSAL), version=1)

    async def main():
        items = [(f"t{i}", torch.ones(3)) for i in range(4)]
        return await asyncio.gather(tr.send_weights(items, version=1), receive(r0), refuse(),
                                    return_exceptions=True)

    start = time.monotonic()
    sent, got, _ = asyncio.run(main())
    assert time.monotonic() - start < TIMEOUT / 8
    for err in (sent, got):
        assert isinstance(err, Exception) and faults.REFUSAL in str(err), err
    assert sent.origin == "rollout rank 1"
    for e in (tr, r0, r1):
        e.finalize()


@pytest.mark.timeout(60)
def test_a_consumer_that_raises_mid_loop_tells_the_trainer_what_happened_not_cancelled():
    """A rollout's own code raises inside ``async for ... in receive_weights()``; the loop
    ends (``asyncio.run`` cancels what the receive had pending). The trainer fails at once
    naming that rollout and saying its caller left the loop, not a bare CancelledError."""
    import socket
    import threading

    import weightsync
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"
    params = {f"w{i}": torch.randn(1000) for i in range(8)}
    got: dict = {}

    def trainer():
        t = weightsync.connect("shm", role="trainer", address=address, token="t" * 16,
                               timeout=TIMEOUT)
        try:
            t.send(params, version=1)
        except Exception as exc:  # noqa: BLE001 - the test looks at it
            got["trainer"] = exc
        finally:
            t.finalize()

    thread = threading.Thread(target=trainer)
    thread.start()
    r = weightsync.connect("shm", role="rollout", address=address, token="t" * 16,
                           timeout=TIMEOUT)

    async def consume():
        async for name, _ in r.receive_weights(version=1):
            raise ValueError(f"loader bug at {name}")
    start = time.perf_counter()
    with pytest.raises(ValueError, match="loader bug"):
        asyncio.run(consume())
    thread.join(TIMEOUT)
    r.finalize()
    err = got["trainer"]
    assert time.perf_counter() - start < TIMEOUT / 4
    assert "rollout rank 0" in str(err) and "left the loop" in str(err), err
    assert "CancelledError" not in str(err), err
