"""Workers with injectable faults for the manager-level reliability tests.

Importable by Ray workers (the test module puts this folder on their PYTHONPATH), so the
faults run inside real actor processes: ``os._exit`` kills the process mid-sync.
"""

from __future__ import annotations

import asyncio
import os
import threading
from typing import Any, Optional

from weightsync.core.errors import WeightSyncError
from weightsync.orchestration.calls import Call, call_all, values_or_raise
from weightsync.integrations.ray.workers import HFRolloutWorker, ToyTrainerWorker

EXIT_CODE = 17
REFUSAL = "injected: the loader refuses this version"


class FaultyRollout(HFRolloutWorker):
    """``arm(mode, version, after)``: while receiving ``version`` (any version if None),
    after ``after`` tensors: ``"raise"`` an error, ``"hang"`` until ``release()``, or
    ``"exit"`` the process; ``"refuse"``: an error before it reads a byte (a loader that
    refuses the version); ``"stall"``: once it took ``after`` tensors, ``stall_s`` seconds
    before it asks for more (with ``after`` = all of them: every byte in, its confirmation
    late), then on; ``"raise-named"``: once every tensor is loaded, an error that
    names the replica by its own name (as a vLLM replica's post-load step would). ``arm_init("hang")`` makes ``ws_init`` never return."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._mode: Optional[str] = None
        self._at: Any = None
        self._after = 3
        self._stall_s = 0.0
        self._init_mode: Optional[str] = None
        self._released = threading.Event()
        rollout, original = self.rollout, self.rollout.load_weights

        async def load(weights, *, version, **kw):
            armed = self._mode is not None and self._at in (None, version)
            if armed and self._mode == "refuse":
                raise RuntimeError(REFUSAL)
            if armed and self._mode != "raise-named":
                weights = self._faulty(weights, self._mode)
            out = await original(weights, version=version, **kw)
            if armed and self._mode == "raise-named":   # after every byte, as post-load
                raise WeightSyncError("injected failure after loading", peer=rollout.name,
                                      phase="load", version=version)
            return out

        rollout.load_weights = load

    async def _faulty(self, weights: Any, mode: str):
        count = 0
        async for item in weights:
            count += 1
            if count == self._after:
                if mode == "raise":
                    raise RuntimeError("injected failure while loading")
                if mode == "exit":
                    os._exit(EXIT_CODE)
                if mode == "hang":
                    self._released.wait(300)      # blocks this replica's loop
            yield item
            if count == self._after and mode == "stall":
                await asyncio.sleep(self._stall_s)

    def arm(self, mode: Optional[str], version: Any = None, after: int = 3,
            stall_s: float = 0.0) -> None:
        if mode not in (None, "raise", "hang", "exit", "raise-named", "refuse", "stall"):
            raise ValueError(f"unknown fault {mode!r}")
        self._mode, self._at, self._after, self._stall_s = mode, version, after, stall_s

    def arm_init(self, mode: Optional[str]) -> None:
        self._init_mode = mode

    def release(self) -> None:
        self._released.set()

    def ws_init(self, kwargs_list: list) -> None:
        if self._init_mode == "hang":
            self._released.wait(300)              # never arrives
            return
        super().ws_init(kwargs_list)

    def pid(self) -> int:
        return os.getpid()


class FaultyTrainer(ToyTrainerWorker):
    """``arm_exit(version, after)``: the process exits after yielding ``after`` tensors of
    the sync of ``version``."""

    _exit_at: Any = None
    _exit_after = 3

    def arm_exit(self, version: Any, after: int = 3) -> None:
        self._exit_at, self._exit_after = version, after

    def ws_prepare(self, backend: str, engine_kwargs: dict) -> dict:
        meta = super().ws_prepare(backend, engine_kwargs)
        engine = self._ws().engine
        original = engine.send_weights

        async def send(named, version=None):
            if self._exit_at is not None and version == self._exit_at:
                named = self._exiting(named)
            return await original(named, version)

        engine.send_weights = send
        return meta

    def _exiting(self, named: Any):
        for i, item in enumerate(named):
            if i == self._exit_after:
                os._exit(EXIT_CODE)
            yield item


def trainer_group(cls: Any, world: int, config: dict, *, timeout: float = 60.0,
                  seed: int = 0) -> list:
    """``world`` FSDP2 trainer actors of ``cls`` (a ``ray.remote`` class) in one gloo group
    whose collectives time out after ``timeout`` seconds."""
    actors = [cls.remote(rank, world) for rank in range(world)]

    def on_all(method, *args, **kw):
        return values_or_raise(call_all([Call(f"trainer rank {i}", a, method, args, kw)
                                         for i, a in enumerate(actors)],
                                        timeout=max(timeout, 120), phase="setup"))

    port = values_or_raise(call_all([Call("trainer rank 0", actors[0], "dist_master")],
                                    timeout=120, phase="setup"))[0]
    on_all("dist_init", port, timeout)
    on_all("build", config, seed=seed, fsdp=True)
    return actors
