"""A persistent event loop in a background thread, for sync callers of async engines.

Engines expose ``async`` send/receive. Worker objects (Ray actors, local workers) are
called synchronously, often from different threads; running every coroutine on one
long-lived loop keeps loop-bound state valid across syncs and lets a call be bounded by
a timeout from the caller's side.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import weakref
from typing import Any, Awaitable, Optional

from weightsync.core.errors import SyncTimeout

__all__ = ["AsyncRunner"]


class AsyncRunner:
    """Runs coroutines on a private loop thread; ``run`` blocks with a timeout. The loop
    and its thread end at :meth:`close`, or when the runner is garbage-collected (an
    adapter dropped without ``close`` leaves no thread, selector or socket pair behind)."""

    def __init__(self, name: str = "weightsync-loop") -> None:
        self._name = name
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._thread: Optional[threading.Thread] = None
        self._lock = threading.Lock()

    def _ensure(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None or self._loop.is_closed():
                loop = asyncio.new_event_loop()
                ready = threading.Event()

                def main() -> None:
                    asyncio.set_event_loop(loop)
                    loop.call_soon(ready.set)
                    try:
                        loop.run_forever()
                    finally:
                        loop.close()

                self._thread = threading.Thread(target=main, name=self._name, daemon=True)
                self._thread.start()
                ready.wait(10.0)
                self._loop = loop
                # the thread holds the loop, not the runner: stop it with the runner
                weakref.finalize(self, _stop, loop)
            return self._loop

    def run(self, coro: Awaitable[Any], *, timeout: float, phase: str = "run",
            version: Any = None, peer: Optional[str] = None) -> Any:
        """Run ``coro`` on the loop thread; ``SyncTimeout`` after ``timeout`` seconds."""
        loop = self._ensure()
        if threading.current_thread() is self._thread:
            raise RuntimeError("AsyncRunner.run called from its own loop thread")
        fut = asyncio.run_coroutine_threadsafe(coro, loop)
        try:
            return fut.result(timeout)
        except concurrent.futures.TimeoutError:
            fut.cancel()
            raise SyncTimeout(f"{phase} did not finish within {timeout:.1f}s", peer=peer,
                              phase=phase, version=version) from None

    def close(self) -> None:
        with self._lock:
            loop, thread = self._loop, self._thread
            self._loop = self._thread = None
        if loop is not None and not loop.is_closed():
            _stop(loop)
            if thread is not None and thread is not threading.current_thread():
                thread.join(5.0)


def _stop(loop: asyncio.AbstractEventLoop) -> None:
    """Stop ``loop`` from any thread (its thread closes it once it has stopped)."""
    try:
        loop.call_soon_threadsafe(loop.stop)
    except RuntimeError:      # closed already
        pass
