"""Failures as they cross the wire, and back.

:func:`error_msg` turns an exception into the :class:`~weightsync.core.wire.ErrorMsg` a
peer posts when its side of a sync fails; :func:`raise_remote` raises what such a message
reports, keeping where the failure started (``origin``) so that a peer that only relayed
it is not blamed. Used by the sync protocol (``weightsync.transport.protocol``) and by
every backend that reads its peers' reports.
"""

from __future__ import annotations

import asyncio
import numbers
import operator
import re
from typing import Any, Optional

from weightsync.core.errors import PeerFailed, SyncTimeout, WeightSyncError
from weightsync.core.wire import ErrorMsg

__all__ = ["failure_origin", "error_msg", "normalize_version", "raise_remote", "wire_version"]

_ONE_PEER = re.compile(r"^(trainer|rollout) rank \d+$")


def failure_origin(exc: BaseException) -> Optional[str]:
    """Where the failure ``exc`` started, as far as this process knows: the origin it was
    relayed with, else the one peer it saw go away or fall silent (a lost link, a missed
    deadline); ``None``: here (its own error, or one it cannot pin on a single peer)."""
    if not isinstance(exc, WeightSyncError):
        return None
    if exc.origin is not None:
        return exc.origin
    if isinstance(exc, (PeerFailed, SyncTimeout)) and _ONE_PEER.match(exc.peer or ""):
        return exc.peer
    return None


def error_msg(exc: BaseException, *, seq: int, version: Any, peer: str, phase: str) -> ErrorMsg:
    name = type(exc).__name__ if isinstance(exc, WeightSyncError) else "PeerFailed"
    if isinstance(exc, (asyncio.CancelledError, GeneratorExit)):   # says nothing by itself
        text = (f"{peer} stopped in the middle of the sync: its caller left the loop over "
                "the weights early (it raised or broke out), or its task was cancelled")
    else:
        text = f"{type(exc).__name__}: {exc}"
    return ErrorMsg(version=wire_version(version), seq=seq, error=name, message=text[:60000],
                    peer=peer, phase=phase, origin=failure_origin(exc))


def normalize_version(version: Any) -> Any:
    """The one form of a weight version, taken at the API boundary (``send_weights``,
    ``receive_weights``) on both sides, so that equal versions compare equal everywhere:
    an ``int``, an int subclass or a numpy integer -> ``int``; a ``str`` (or subclass) ->
    ``str``; ``None`` -> ``None``. Anything else (``bool``, floats, tuples...) is refused
    with ``ValueError``: it would not survive the wire as itself."""
    if version is None:
        return None
    if isinstance(version, str):
        return str.__str__(version)
    if isinstance(version, numbers.Integral) and not isinstance(version, bool):
        return operator.index(version)
    raise ValueError(f"version must be an int or a str (or None), got {version!r} "
                     f"({type(version).__name__})")


def wire_version(version: Any) -> Any:
    """A version as the wire carries it: :func:`normalize_version`'s form, and anything
    it refuses as text (so that reporting a failure never fails on an odd version)."""
    try:
        return normalize_version(version)
    except ValueError:
        return str(version)


def raise_remote(msg: ErrorMsg, *, phase: str) -> None:
    """Raise the failure a peer reported; ``origin`` keeps where it started, so a peer that
    only passed it on is not taken for the one that failed."""
    raise PeerFailed(f"{msg.peer} failed in {msg.phase}: {msg.message}", peer=msg.peer,
                     phase=phase, version=msg.version, origin=msg.origin or msg.peer)
