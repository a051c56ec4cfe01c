"""Fault-injection hooks for weightsync.testing.GroupSpec(hook="faults:NAME").

Each runs inside a worker process before init_process_group and wraps the engine.
"""

import os

KILL_AFTER = 40  # tensors into the second sync


def _kill_receiver(engine, rank_to_kill):
    orig = engine.receive_weights
    syncs = {"n": 0}

    async def wrapped(version=None):
        syncs["n"] += 1
        count = 0
        async for item in orig(version):
            count += 1
            if syncs["n"] == 2 and count == KILL_AFTER:
                os._exit(17)
            yield item

    engine.receive_weights = wrapped


def kill_rollout_1(engine, role, rank):
    if role == "rollout" and rank == 1:
        _kill_receiver(engine, rank)


def kill_rollout_2(engine, role, rank):
    if role == "rollout" and rank == 2:
        _kill_receiver(engine, rank)


def kill_trainer_0(engine, role, rank):
    if role != "trainer" or rank != 0:
        return
    orig = engine.send_weights
    syncs = {"n": 0}

    async def wrapped(named_tensors, version=None):
        syncs["n"] += 1

        def items():
            for i, item in enumerate(named_tensors):
                if syncs["n"] == 2 and i == KILL_AFTER:
                    os._exit(17)
                yield item

        return await orig(items(), version)

    engine.send_weights = wrapped


def corrupt_rollout_0(engine, role, rank):
    """Flip one byte of every bucket rollout rank 0 receives (after transport, before use)."""
    if role != "rollout" or rank != 0:
        return
    orig = engine._rx_fetch

    def fetch(stream, msg):
        buf = orig(stream, msg)
        if msg.nbytes:
            buf[msg.nbytes // 2] ^= 0x5A
        return buf

    engine._rx_fetch = fetch


def never_init_rollout_1(engine, role, rank):
    if role == "rollout" and rank == 1:
        def stuck(**kwargs):
            import time
            time.sleep(3600)
        engine.init_process_group = stuck


def linger_rollouts_on_error(engine, role, rank):
    """A rollout rank that fails (e.g. version mismatch) but whose process stays alive."""
    if role != "rollout":
        return
    orig = engine.receive_weights

    async def wrapped(version=None):
        try:
            async for item in orig(version):
                yield item
        except Exception:
            import asyncio
            await asyncio.sleep(12)
            raise

    engine.receive_weights = wrapped
