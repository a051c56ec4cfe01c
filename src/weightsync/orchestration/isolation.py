"""Who is to blame for a failed step of a sync: the evidence rules of failure isolation.

:func:`blame` reads the outcomes of one step (trainer ranks and rollout replicas) and
returns a :class:`Verdict`:

* a replica is a *culprit* when its own call shows its own failure: it died, it did not
  answer in time (the manager's bound), or it raised an error that names no peer, names
  itself (by the manager's name, or by the name its adapter gives itself: ``self_name`` in
  its capabilities), or names one of its own receiving ranks; or when a trainer rank's
  error names one of its receiving ranks (``"rollout rank 3"``);
* a trainer rank is at fault when it died, did not answer, or raised an error of its own
  (no peer, itself, another trainer rank): nothing can be isolated then;
* an error that names a peer (``"trainer rank 0"`` on a replica) is a relay: that replica
  was told of someone else's failure and is innocent; it did not complete the version;
* a trainer rank's error that names a receiving rank whose replica completed the version
  on its own is a *late confirmation* (the trainer gave up waiting for that replica's
  confirmation, which came after: a consumer that stalled past the timeout once every byte
  was in): that replica holds the version, so it is neither a culprit nor fenced, and
  every replica the error does not list as ``confirmed`` but that completed is late too
  (:attr:`Verdict.late`); the trainer rank is not at fault either.

An error passed on from peer to peer keeps where the failure started (``origin``, e.g.
rollout rank 2 died, trainer rank 0 told rollout rank 1, which told trainer rank 1): the
rules read that origin, not the last messenger, so no healthy replica is taken for the
one that failed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Optional

from weightsync.orchestration.calls import Outcome

__all__ = ["Verdict", "blame", "describe_error", "source_of"]

_RANK = re.compile(r"^rollout rank (\d+)$")


@dataclass
class Verdict:
    culprits: dict = field(default_factory=dict)       # replica name -> reason
    trainer_fault: Optional[Outcome] = None
    relays: list = field(default_factory=list)         # replica names told of a failure
    late: dict = field(default_factory=dict)           # replica name -> the trainer's error:
                                                       # it completed, confirmed too late

    @property
    def failed(self) -> bool:
        return bool(self.culprits) or self.trainer_fault is not None or bool(self.relays)


def describe_error(err: Optional[BaseException]) -> str:
    return f"{type(err).__name__}: {getattr(err, 'detail', err)}"[:2000]


def source_of(err: Optional[BaseException]) -> Optional[str]:
    """The peer an error points at: where a relayed failure started, else its peer."""
    return getattr(err, "origin", None) or getattr(err, "peer", None)


def _owner(peer: Optional[str], rank_owner: dict[int, str]) -> Optional[str]:
    m = _RANK.match(peer or "")
    return rank_owner.get(int(m.group(1))) if m else None


def blame(trainers: list[Outcome], replicas: list[Outcome],
          rank_owner: dict[int, str], aliases: Optional[dict[str, str]] = None) -> Verdict:
    """The verdict on one step (see the module doc). ``rank_owner``: receiving rank ->
    replica name, for the group the step ran in (empty when no group is involved).
    ``aliases``: replica name -> the name its own errors give it (its adapter's
    ``self_name``)."""
    v = Verdict()
    aliases = aliases or {}
    for o in replicas:
        if o.ok:
            continue
        peer = source_of(o.error)
        if peer is not None and peer == aliases.get(o.label):
            peer = o.label                      # the replica naming itself its own way
        named = _owner(peer, rank_owner)
        if peer in (None, o.label) or named == o.label:
            v.culprits[o.label] = describe_error(o.error)   # its own word beats a peer's
        elif named is not None:
            v.culprits.setdefault(named, f"named by {o.label}: {describe_error(o.error)}")
        else:
            v.relays.append(o.label)
    completed = {o.label for o in replicas if o.ok}
    for o in trainers:
        if o.ok:
            continue
        peer = source_of(o.error)
        named = _owner(peer, rank_owner)
        if named is not None and named in completed:
            # the replica's own receive completed the version: the trainer only missed its
            # confirmation (and those of the others it does not list as confirmed)
            why = f"confirmed too late for {o.label}: {describe_error(o.error)}"
            for name in _unconfirmed(o.error, rank_owner, named) & completed:
                v.late.setdefault(name, why)
            continue
        if named is not None:
            v.culprits.setdefault(named, f"named by {o.label}: {describe_error(o.error)}")
        elif peer is None or peer == o.label or str(peer).startswith("trainer"):
            if v.trainer_fault is None:
                v.trainer_fault = o
    v.relays = [r for r in v.relays if r not in v.culprits]
    v.late = {n: why for n, why in v.late.items() if n not in v.culprits}
    return v


def _unconfirmed(err: Optional[BaseException], rank_owner: dict[int, str],
                 named: str) -> set[str]:
    """The replicas a sender's error does not list as having confirmed the version (its
    ``confirmed`` rollout ranks); without that list, the one it names."""
    confirmed = getattr(err, "confirmed", None)
    if confirmed is None:
        return {named}
    return {name for rank, name in rank_owner.items() if rank not in confirmed} | {named}
