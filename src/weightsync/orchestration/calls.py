"""Bounded, concurrent calls on worker handles: Ray actor handles or local objects.

The manager talks to its workers only through :func:`call_all`: each call names a
worker (``label``), a handle, a method and its arguments. A Ray actor handle is called
with ``.remote`` and waited for with ``ray.wait(timeout=...)``; a plain object (a worker
in this process) is called in a thread of a shared pool. Either way every call ends
within ``timeout``: a worker that does not answer gives ``SyncTimeout``, a dead or failing
one ``PeerFailed`` (a ``WeightSyncError`` raised by the worker is kept as it is), each
naming the worker, the phase and the version.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Optional

from weightsync.core.errors import PeerFailed, SyncTimeout, WeightSyncError

__all__ = ["Call", "Outcome", "call_all", "post_all", "values_or_raise", "is_ray_handle"]

logger = logging.getLogger(__name__)
_pool: Optional[concurrent.futures.ThreadPoolExecutor] = None
_pool_lock = threading.Lock()


def _local_pool() -> concurrent.futures.ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = concurrent.futures.ThreadPoolExecutor(64, thread_name_prefix="weightsync-call")
        return _pool


def is_ray_handle(handle: Any) -> bool:
    return type(handle).__name__ == "ActorHandle" and type(handle).__module__.startswith("ray")


@dataclass
class Call:
    label: str
    handle: Any
    method: str
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    patient: bool = False         # see ``settle`` of :func:`call_all`


@dataclass
class Outcome:
    label: str
    ok: bool
    value: Any = None
    error: Optional[BaseException] = None


def _wrap(exc: BaseException, label: str, method: str, phase: str, version: Any) -> BaseException:
    cause = getattr(exc, "cause", None)
    if isinstance(cause, WeightSyncError):
        return cause
    if isinstance(exc, WeightSyncError) and type(exc).__module__.startswith("weightsync"):
        return exc
    if isinstance(cause, BaseException):
        exc = cause
    name = type(exc).__name__
    if name in ("RayActorError", "ActorDiedError", "ActorUnavailableError", "WorkerCrashedError"):
        msg = f"{label} died or became unreachable during {method}: {exc}"
    else:
        msg = f"{label} failed in {method}: {name}: {exc}"
    err = PeerFailed(msg[:4000], peer=label, phase=phase, version=version)
    err.__cause__ = exc
    return err


def _timeout_error(label: str, method: str, timeout: float, phase: str, version: Any) -> SyncTimeout:
    return SyncTimeout(f"{label} did not finish {method} within {timeout:.1f}s", peer=label,
                       phase=phase, version=version)


def call_all(calls: list[Call], *, timeout: float, phase: str, version: Any = None,
             settle: Optional[float] = None) -> list[Outcome]:
    """Start every call at once and wait for all of them, at most ``timeout`` seconds.

    ``settle``: once every call marked ``patient`` has finished (the trainer ranks of a
    sync, say), the others get at most ``settle`` more seconds: peers told of a failure
    end within their own timeout, so one still running after that is hung.
    """
    if not calls:
        return []
    out: list[Optional[Outcome]] = [None] * len(calls)
    refs: dict[int, Any] = {}
    futs: dict[int, concurrent.futures.Future] = {}
    pool = _local_pool()
    for i, c in enumerate(calls):
        try:
            if is_ray_handle(c.handle):
                refs[i] = getattr(c.handle, c.method).remote(*c.args, **c.kwargs)
            else:
                futs[i] = pool.submit(getattr(c.handle, c.method), *c.args, **c.kwargs)
        except Exception as exc:  # a dead handle may fail at submission
            out[i] = Outcome(c.label, False, error=_wrap(exc, c.label, c.method, phase, version))
    deadline = time.monotonic() + timeout
    settled = False
    while refs or futs:
        if settle is not None and not settled and all(
                out[i] is not None for i, c in enumerate(calls) if c.patient):
            deadline, settled = min(deadline, time.monotonic() + settle), True
        left = deadline - time.monotonic()
        if left <= 0:
            break
        slice_ = left if not (refs and futs) else min(left, 0.05)
        if refs:
            _poll_ray(calls, refs, out, slice_, phase, version)
        if futs:
            _poll_local(calls, futs, out, slice_, phase, version)
    for i in list(refs) + list(futs):
        c = calls[i]
        out[i] = Outcome(c.label, False, error=_timeout_error(c.label, c.method,
                                                              timeout, phase, version))
    _cancel(calls, refs, futs)
    return [o for o in out]  # type: ignore[misc]


def post_all(calls: list[Call], *, phase: str) -> None:
    """Start every call and wait for none (a worker busy with something else runs it when
    it can; Ray keeps a task whose result nobody waits for). A failure is only logged:
    for calls whose outcome nobody needs, such as ending a lease given up on."""
    pool = _local_pool()

    def _log(c: Call, fut: concurrent.futures.Future) -> None:
        if fut.exception() is not None:
            logger.warning("%s.%s (%s) failed: %s", c.label, c.method, phase, fut.exception())

    for c in calls:
        try:
            if is_ray_handle(c.handle):
                getattr(c.handle, c.method).remote(*c.args, **c.kwargs)
            else:
                fut = pool.submit(getattr(c.handle, c.method), *c.args, **c.kwargs)
                fut.add_done_callback(lambda f, c=c: _log(c, f))
        except Exception as exc:  # a dead handle may fail at submission
            logger.warning("%s.%s (%s) could not start: %s", c.label, c.method, phase, exc)


def _cancel(calls: list[Call], refs: dict, futs: dict) -> None:
    """Cancel the calls that timed out, so that a worker's next call does not queue behind
    a hung one (Ray: ``ray.cancel``, which interrupts the task in its actor; a local call
    cannot be interrupted, only dropped if it has not started)."""
    for i, ref in refs.items():
        import ray

        try:
            ray.cancel(ref)
        except Exception:  # the actor may be dead already; the timeout is reported anyway
            logger.warning("could not cancel %s.%s after its timeout", calls[i].label,
                           calls[i].method, exc_info=True)
    for fut in futs.values():
        fut.cancel()


def _poll_ray(calls, refs, out, timeout, phase, version) -> None:
    """Wait up to ``timeout`` for one of ``refs``; record (and drop) every finished one."""
    import ray

    by_key = {ref.hex() if hasattr(ref, "hex") else id(ref): i for i, ref in refs.items()}
    ready, _ = ray.wait(list(refs.values()), num_returns=1, timeout=timeout)
    for ref in ready:
        i = by_key[ref.hex() if hasattr(ref, "hex") else id(ref)]
        c = calls[i]
        del refs[i]
        try:
            out[i] = Outcome(c.label, True, value=ray.get(ref, timeout=30.0))
        except Exception as exc:
            out[i] = Outcome(c.label, False, error=_wrap(exc, c.label, c.method, phase, version))


def _poll_local(calls, futs, out, timeout, phase, version) -> None:
    done, _ = concurrent.futures.wait(list(futs.values()), timeout=timeout,
                                      return_when=concurrent.futures.FIRST_COMPLETED)
    for i in [i for i, f in futs.items() if f in done]:
        c, fut = calls[i], futs.pop(i)
        exc = fut.exception()
        if exc is None:
            out[i] = Outcome(c.label, True, value=fut.result())
        else:
            out[i] = Outcome(c.label, False, error=_wrap(exc, c.label, c.method, phase, version))


def values_or_raise(outcomes: list[Outcome]) -> list[Any]:
    """The values, or raise the first failure (the others are chained in its message)."""
    failed = [o for o in outcomes if not o.ok]
    if failed:
        first = failed[0].error
        if len(failed) > 1 and isinstance(first, WeightSyncError):
            others = "; ".join(f"{o.label}: {o.error}" for o in failed[1:])[:2000]
            if hasattr(first, "add_note"):
                first.add_note(f"also failed: {others}")
        raise first
    return [o.value for o in outcomes]
