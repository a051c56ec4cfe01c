"""Sync a dict of tensors from a trainer process into a rollout process.

    python examples/two_process_sync.py shm        # or: collective

connect() needs the job's token in every process (here: WEIGHTSYNC_TOKEN, which the
spawned rollout process inherits).
"""

import asyncio
import multiprocessing as mp
import os
import secrets
import sys

import torch

import weightsync


def rollout(backend: str) -> None:
    engine = weightsync.connect(backend, role="rollout", address="127.0.0.1:29555")
    model = {"w": torch.zeros(1024, 1024), "b": torch.zeros(1024)}

    async def receive():
        async for name, tensor in engine.receive_into(model, version=1):
            pass                             # tensor is model[name], written in place

    asyncio.run(receive())
    print("rollout got", {k: float(v.sum()) for k, v in model.items()})
    engine.finalize()


if __name__ == "__main__":
    backend = sys.argv[1] if len(sys.argv) > 1 else "shm"
    os.environ.setdefault("WEIGHTSYNC_TOKEN", secrets.token_hex(16))  # the job's secret
    child = mp.get_context("spawn").Process(target=rollout, args=(backend,))
    child.start()
    engine = weightsync.connect(backend, role="trainer", address="127.0.0.1:29555")
    weights = {"w": torch.ones(1024, 1024), "b": torch.full((1024,), 2.0)}
    print(asyncio.run(engine.send_weights(weights.items(), version=1)))
    child.join(timeout=60)
    engine.finalize()
