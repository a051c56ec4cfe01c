"""The one exception hierarchy of weightsync.

Every error raised by weightsync on a failed sync derives from :class:`WeightSyncError`
and says, where known, which peer failed, in which phase, for which version.
"""

from __future__ import annotations

__all__ = [
    "WeightSyncError",
    "SyncTimeout",
    "PeerFailed",
    "PlanMismatch",
    "VersionMismatch",
    "WireError",
    "IntegrityError",
    "BackendUnavailable",
    "TopologyError",
    "AuthenticationError",
]


class WeightSyncError(RuntimeError):
    """Base class: a weight sync failed.

    ``peer`` names the remote side (e.g. ``"trainer rank 1"``), ``phase`` the step of the
    lifecycle (``"init"``, ``"send"``, ``"receive"``...), ``version`` the weight version.
    ``origin`` is set on an error that relays another peer's failure: the peer where that
    failure started (``peer`` is then only the messenger); ``None`` when not relayed.
    ``confirmed``, on a sender's error that came once every byte was out (the wait for the
    receivers' confirmations): the rollout ranks that confirmed the whole version before it
    (they hold it); the others may still complete it on their side (a receiver that resumes
    after a stall) or not. ``None``: not known.
    """

    def __init__(
        self,
        message: str,
        *,
        peer: str | None = None,
        phase: str | None = None,
        version: object = None,
        origin: str | None = None,
        confirmed: tuple[int, ...] | None = None,
    ) -> None:
        self.peer = peer
        self.origin = origin
        self.confirmed = None if confirmed is None else tuple(sorted(int(r) for r in confirmed))
        self.phase = phase
        self.version = version
        self.detail = message
        parts = [message]
        ctx = []
        if peer is not None:
            ctx.append(f"peer={peer}")
        if phase is not None:
            ctx.append(f"phase={phase}")
        if version is not None:
            ctx.append(f"version={version}")
        if origin is not None and origin != peer:
            ctx.append(f"origin={origin}")
        if ctx:
            parts.append("(" + ", ".join(ctx) + ")")
        super().__init__(" ".join(parts))

    def __str__(self) -> str:
        text = super().__str__()
        if self.confirmed is not None:   # may be set after construction (the sender's wait)
            text += f" (rollout ranks {list(self.confirmed)} confirmed the version)"
        return text

    def __reduce__(self):  # keep context across pickling (Ray actors re-raise these)
        return (
            _rebuild,
            (type(self), self.detail, self.peer, self.phase, self.version, self.origin,
             self.confirmed),
        )


def _rebuild(cls, detail, peer, phase, version, origin=None, confirmed=None):
    extra = {} if confirmed is None else {"confirmed": confirmed}
    return cls(detail, peer=peer, phase=phase, version=version, origin=origin, **extra)


class SyncTimeout(WeightSyncError):
    """A peer did not answer within the configured timeout."""


class PeerFailed(WeightSyncError):
    """A peer reported an error or went away during a sync."""


class PlanMismatch(WeightSyncError):
    """The tensors offered or expected do not match the agreed plan or the model."""


class VersionMismatch(WeightSyncError):
    """The receiver expected another weight version than the sender sent."""


class WireError(WeightSyncError):
    """A control message was malformed, too large, of an unknown kind or version."""


class IntegrityError(WeightSyncError):
    """Received bytes failed their checksum, or a weight digest did not match."""


class BackendUnavailable(WeightSyncError):
    """A backend was asked for whose optional dependency could not be imported."""


class TopologyError(WeightSyncError):
    """``build_topology`` returned lists that do not fit the workers."""


class AuthenticationError(WeightSyncError):
    """A peer presented a wrong job token (or none) and was refused."""
