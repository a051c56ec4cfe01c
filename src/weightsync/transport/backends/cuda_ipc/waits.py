"""Host waits for another process's CUDA events, bounded, without polling (``cuda_ipc``).

A wait hands the event to a helper thread of the calling thread, which blocks in the
driver (``IpcOps.block``: ``cudaEventSynchronize``, the GIL released) and wakes the caller
the moment the work behind the event is done. The caller itself waits on a
``threading.Event`` in short slices, so its deadline and its "give up" check (a receive
that ended) hold as with polling. A helper that is still blocked when its caller's
deadline passes (or whose caller gave up) is left behind, a daemon thread; the calling
thread gets a fresh one for its next wait. After ``MAX_STUCK`` helpers left at a deadline,
every later wait polls.

Polling (``query`` with sleeps doubling from 10 us to 100 us) was what ``cuda_ipc`` did
before; it stays as ``mode="poll"`` (``CudaIpcOptions.event_wait``).

Lifecycle: a :class:`EventWaiter` is made per engine; ``wait`` may be called from any
thread; ``close`` ends the helpers that are idle (blocked ones end when their event
completes).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Optional

__all__ = ["EventWaiter", "MAX_STUCK"]

logger = logging.getLogger(__name__)

#: Helpers left blocked past their caller's deadline before waits fall back to polling.
MAX_STUCK = 4
_SLICE = 0.002     # how often a blocked caller looks at its deadline and its "give up" check


class _Helper:
    """One daemon thread that blocks on events for one calling thread."""

    def __init__(self, block: Callable[[Any], None], name: str) -> None:
        self._block = block
        self._cv = threading.Condition()
        self._job: Optional[tuple] = None
        self._closed = False
        threading.Thread(target=self._run, name=name, daemon=True).start()

    def submit(self, event: Any) -> tuple[threading.Event, list]:
        flag, error = threading.Event(), []
        with self._cv:
            self._job = (event, flag, error)
            self._cv.notify()
        return flag, error

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify()

    def _run(self) -> None:
        while True:
            with self._cv:
                while self._job is None and not self._closed:
                    self._cv.wait()
                if self._job is None:
                    return
                event, flag, error = self._job
                self._job = None
            try:
                self._block(event)
            except BaseException as exc:  # handed to the caller (a CUDA error, say)
                error.append(exc)
            flag.set()


class EventWaiter:
    """Bounded host waits on events; ``block(event)`` must return once the event is done
    (or raise)."""

    def __init__(self, block: Callable[[Any], None], done: Callable[[Any], bool], *,
                 mode: str = "block", name: str = "weightsync-event-wait") -> None:
        if mode not in ("block", "poll"):
            raise ValueError(f"mode must be 'block' or 'poll', got {mode!r}")
        self._block, self._done = block, done
        self.mode = mode
        self._name = name
        self._local = threading.local()
        self._helpers: list[_Helper] = []
        self._lock = threading.Lock()
        self.stuck = 0

    def wait(self, event: Any, *, deadline: float,
             give_up: Callable[[], bool] = lambda: False) -> bool:
        """Wait until ``event`` is done: True; False once ``give_up()`` turns true first;
        ``TimeoutError`` at ``deadline`` (``time.monotonic``). Errors of the device
        (``RuntimeError``) propagate."""
        if self._done(event):
            return True
        if self.mode == "poll" or self.stuck >= MAX_STUCK:
            return self._poll(event, deadline, give_up)
        helper = getattr(self._local, "helper", None)
        if helper is None:
            helper = self._local.helper = _Helper(self._block, self._name)
            with self._lock:
                self._helpers.append(helper)
        flag, error = helper.submit(event)
        while not flag.wait(_SLICE):
            over = give_up()
            if over or time.monotonic() > deadline:
                # the helper still blocks (for good, if the peer died): leave it behind
                self._local.helper = None
                with self._lock:
                    self.stuck += not over
                    self._helpers.remove(helper)
                helper.close()
                if over:
                    return False
                logger.debug("an event wait left its helper blocked (%d so far)", self.stuck)
                raise TimeoutError("event not done by the deadline")
        if error:
            raise error[0]
        return True

    def _poll(self, event: Any, deadline: float, give_up: Callable[[], bool]) -> bool:
        delay = 10e-6
        while not self._done(event):
            if give_up():
                return False
            if time.monotonic() > deadline:
                raise TimeoutError("event not done by the deadline")
            time.sleep(delay)
            delay = min(2 * delay, 100e-6)
        return True

    def close(self) -> None:
        with self._lock:
            helpers, self._helpers = self._helpers, []
        for helper in helpers:
            helper.close()
        self._local = threading.local()
