"""A process that fails a ``collective`` sync, finalizes and exits (run as a script by
tests/test_failure_exit.py).

Trainer rank 0 runs here; its two rollout ranks run in child processes that stay alive:
rank 0's consumer raises after a few tensors, rank 1's stalls, so the trainer's broadcasts
stay posted on a group whose peers never post their side. Prints ``FINALIZED`` once
``finalize()`` returned; with ``join``, first waits for the groups to be dropped and prints
how long that took (``TEARDOWN <seconds>``).
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import sys
import threading
import time

import torch

from weightsync.transport import CheckpointEngineRegistry
from weightsync.transport.base import worker_kwargs

TIMEOUT = 6.0
KW = dict(bucket_size=1 << 16, timeout=TIMEOUT)


def _rollout(rank: int, metas: "mp.Queue", kws: "mp.Queue") -> None:
    engine = CheckpointEngineRegistry.new("collective", role="rollout", **KW)
    metas.put(engine.prepare())
    engine.init_process_group(**kws.get(timeout=60))

    async def consume() -> None:
        count = 0
        try:
            async for _ in engine.receive_weights(version=1):
                count += 1
                if rank == 0 and count == 3:
                    raise RuntimeError("injected failure")
                if rank == 1 and count == 2:
                    await asyncio.sleep(4 * TIMEOUT)      # a stalled consumer
        except Exception:  # noqa: BLE001 - the trainer's failure is what is tested
            pass

    asyncio.run(consume())
    time.sleep(60)        # alive until the parent ends it


def main(mode: str) -> None:
    ctx = mp.get_context("spawn")
    trainer = CheckpointEngineRegistry.new("collective", role="trainer", **KW)
    queues = [(ctx.Queue(), ctx.Queue()) for _ in range(2)]
    procs = [ctx.Process(target=_rollout, args=(j, m, k), daemon=True)
             for j, (m, k) in enumerate(queues)]
    for p in procs:
        p.start()
    metas = [trainer.prepare()] + [m.get(timeout=120) for m, _ in queues]
    tk, rk = type(trainer).build_topology(1, 2, metas)
    for j, (_, k) in enumerate(queues):
        k.put(worker_kwargs(rk, j))
    trainer.init_process_group(**worker_kwargs(tk, 0))
    items = [(f"t{i}", torch.randn(4096)) for i in range(64)]

    async def send() -> str:
        try:
            await trainer.send_weights(iter(items), version=1)
        except Exception as exc:  # noqa: BLE001 - expected: the sync fails
            return type(exc).__name__
        return "sent"

    print("SEND", asyncio.run(send()), flush=True)
    start = time.monotonic()
    trainer.finalize()
    if mode == "join":
        for t in threading.enumerate():
            if t.name == "weightsync-drop":
                t.join()
        print("TEARDOWN", time.monotonic() - start, flush=True)
    print("FINALIZED", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
