"""A trainer worker that answers no engine call while it trains, as a Ray actor does
during a training step (an actor runs one method at a time): for the tests and
``benchmarks/late_joiner.py`` (what a busy trainer holds up: elastic joins).

    busy = BusyTrainer(ToyTrainerWorker())
    with busy.training(step):      # train_step runs; engine calls wait until it ends
        manager.add_replica(new)   # "auto" gives up on the trainer, a replica serves
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator

__all__ = ["BusyTrainer"]


class BusyTrainer:
    """Wraps a trainer worker (every attribute passes through); its
    ``execute_checkpoint_engine`` waits while :meth:`training` runs, and records the
    engine methods it was asked for in ``engine_calls``."""

    def __init__(self, inner: Any) -> None:
        self._inner, self._busy = inner, threading.Lock()
        self.engine_calls: list[str] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def execute_checkpoint_engine(self, method: str, *args: Any, **kwargs: Any) -> Any:
        with self._busy:
            self.engine_calls.append(method)
            return self._inner.execute_checkpoint_engine(method, *args, **kwargs)

    @contextlib.contextmanager
    def training(self, step: int) -> Iterator[None]:
        """Train ``step`` now, and answer no engine call until the block ends."""
        with self._busy:
            self._inner.train_step(step)
            yield
