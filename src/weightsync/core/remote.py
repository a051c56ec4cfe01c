"""Failures as they cross the wire, and back.

:func:`error_msg` turns an exception into the :class:`~weightsync.core.wire.ErrorMsg` a
peer posts when its side of a sync fails; :func:`raise_remote` raises what such a message
reports, keeping where the failure started (``origin``) so that a peer that only relayed
it is not blamed. Used by the sync protocol (``weightsync.transport.protocol``) and by
every backend that reads its peers' reports.
"""

from __future__ import annotations

import re
from typing import Any, Optional

from weightsync.core.errors import PeerFailed, SyncTimeout, WeightSyncError
from weightsync.core.wire import ErrorMsg

__all__ = ["failure_origin", "error_msg", "raise_remote", "wire_version"]

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
    return ErrorMsg(version=wire_version(version), seq=seq, error=name,
                    message=f"{type(exc).__name__}: {exc}"[:60000], peer=peer, phase=phase,
                    origin=failure_origin(exc))


def wire_version(version: Any) -> Any:
    """A version as the wire carries it (JSON scalars as they are, anything else as text)."""
    return version if version is None or type(version) in (int, str) else str(version)


def raise_remote(msg: ErrorMsg, *, phase: str) -> None:
    """Raise the failure a peer reported; ``origin`` keeps where it started, so a peer that
    only passed it on is not taken for the one that failed."""
    raise PeerFailed(f"{msg.peer} failed in {msg.phase}: {msg.message}", peer=msg.peer,
                     phase=phase, version=msg.version, origin=msg.origin or msg.peer)
