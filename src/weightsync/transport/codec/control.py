"""The codec's control exchange: a few small JSON values per sync through a control store.

Trainer rank 0 hosts the store (:func:`~weightsync.transport.control.store.host_store`:
one interface, token-checked, bounded frames); every codec engine of the group connects.
Per sync ``seq`` (both sides count their syncs from ``init_process_group``)::

    rollout r  -> held/r      {"held": {trainer rank: base id}, "version": v}
    trainer t  -> mode/t      {"delta": bool, "base": id | null, "new": id, "wrap": bool}
    rollout r  -> needs/1/r   {"needs": [names to resend dense]}    after round 1
    rollout r  -> needs/2/r   {"needs": [...]}                       after a resend round
    any        -> done/<role>/i  {}                                after its last read

Trainer rank 0 closes the store only once every other engine posted ``done`` for the
last sync (bounded: :meth:`CodecLink.drain`, which warns naming whoever did not), so none
loses it in the middle of a read. Every trainer engine serves a store of its own from
``prepare`` (it learns its rank only at ``init_process_group``); only rank 0's is the
group's (:attr:`CodecLink.hosts`), and every other trainer rank posts ``done`` too.

Trainer ranks wait for every ``held`` before they encode, receivers for every ``mode``
before they receive; everybody reads every ``needs/1``, so all agree whether a resend
round follows. A side that fails posts ``{"error": ...}`` in place of its next value, so
peers waiting on it learn at once. Every wait is bounded (``SyncTimeout`` naming who did
not answer); a lost store is ``PeerFailed`` naming trainer rank 0.
"""

from __future__ import annotations

import json
import logging
import threading
from typing import Any, Optional

from weightsync.core.errors import PeerFailed, SyncTimeout, WireError
from weightsync.core.remote import failure_origin
from weightsync.transport.control.server import ControlClient, StoreTimeout

__all__ = ["CodecLink"]

logger = logging.getLogger(__name__)


class CodecLink:
    def __init__(self, client: ControlClient, *, token: str, role: str, rank: int,
                 world: int, receivers: int) -> None:
        self._client = client
        self._prefix = f"wsc/{token}"
        self.role, self.rank, self.world, self.receivers = role, rank, world, receivers
        #: this engine's process serves the group's store (every other engine posts done)
        self.hosts = role == "trainer" and rank == 0
        self._mine: list[str] = []
        self._gc: Optional[threading.Thread] = None
        self._gc_client: Optional[ControlClient] = None

    def _key(self, seq: int, what: str, who: int) -> str:
        return f"{self._prefix}/{seq}/{what}/{who}"

    def post(self, seq: int, what: str, value: dict[str, Any]) -> None:
        key = self._key(seq, what, self.rank)
        try:
            self._client.set(key, json.dumps(value, separators=(",", ":")))
        except ConnectionError as exc:
            raise PeerFailed(f"lost the codec control store ({exc})", peer="trainer rank 0",
                             phase="codec") from None
        self._mine.append(key)

    def done(self, seq: int) -> None:
        """This side read everything of sync ``seq`` it needs from the store."""
        self.post(seq, f"done/{self.role}", {})

    def drain(self, seq: int, timeout: float) -> None:
        """Trainer rank 0, whose process hosts the store, before closing it: wait (at most
        ``timeout``) until every other engine of the group is done with sync ``seq``, so
        one a little behind does not lose the store in the middle of its last reads."""
        keys = [self._key(seq, "done/trainer", t) for t in range(self.world)
                if not (self.role == "trainer" and t == self.rank)]
        keys += [self._key(seq, "done/rollout", r) for r in range(self.receivers)]
        try:
            self._client.wait(keys, timeout)
        except StoreTimeout:              # one that failed or died after its last read
            who = ["{} rank {}".format(*keys[i].split("/")[-2:]) for i in self._missing(keys)]
            logger.warning("weightsync codec: closing the store after the %.1f s drain bound; "
                           "%s did not finish sync %d", timeout, ", ".join(who) or "a peer",
                           seq)
        except OSError:                   # the store is gone already
            return

    def post_error(self, seq: int, what: str, exc: BaseException) -> None:
        """Best effort: tell whoever waits for this side's ``what`` that it failed (and
        where the failure started: a relayed one keeps its origin)."""
        try:
            self.post(seq, what, {"error": f"{type(exc).__name__}: {exc}",
                                  "origin": failure_origin(exc) or f"{self.role} rank {self.rank}"})
        except Exception:  # the store itself may be gone
            pass

    def gather(self, seq: int, what: str, side: str, timeout: float,
               version: Any = None) -> list[dict[str, Any]]:
        """Every ``side`` worker's ``what`` of sync ``seq``, in rank order."""
        count = self.world if side == "trainer" else self.receivers
        keys = [self._key(seq, what, i) for i in range(count)]
        try:
            self._client.wait(keys, timeout)
            raw = [self._client.get(k) for k in keys]
        except StoreTimeout:
            missing = self._missing(keys)
            who = f"{side} rank {missing[0]}" if missing else f"{side} ranks"
            raise SyncTimeout(f"codec: {side} ranks {missing} did not post {what!r} in time",
                              peer=who, phase="codec", version=version) from None
        except ConnectionError as exc:
            raise PeerFailed(f"lost the codec control store ({exc})", peer="trainer rank 0",
                             phase="codec", version=version) from None
        return [self._decode(v, f"{side} rank {i}", version) for i, v in enumerate(raw)]

    def _missing(self, keys: list[str]) -> list[int]:
        try:
            return [i for i, k in enumerate(keys) if not self._client.check([k])]
        except ConnectionError:
            return []

    @staticmethod
    def _decode(raw: bytes, peer: str, version: Any) -> dict[str, Any]:
        try:
            value = json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            value = None
        if not isinstance(value, dict):
            raise WireError("codec: malformed control value", peer=peer, phase="codec",
                            version=version)
        if "error" in value:
            raise PeerFailed(f"codec: {peer} failed: {value.get('error')}", peer=peer,
                             phase="codec", version=version,
                             origin=str(value.get("origin") or peer))
        return value

    def forget_before(self, seq: int) -> None:
        """Delete what this side posted for syncs before ``seq`` (bounds the store), in a
        thread on a connection of its own, off the sync's path."""
        keep, stale = [], []
        for key in self._mine:
            (stale if int(key.split("/")[2]) < seq else keep).append(key)
        self._mine = keep
        if not stale:
            return
        self._join_gc()
        if self._gc_client is None:
            self._gc_client = self._client.clone()
        self._gc = threading.Thread(target=self._delete, args=(self._gc_client, stale),
                                    daemon=True, name="weightsync-codec-gc")
        self._gc.start()

    @staticmethod
    def _delete(client: ControlClient, keys: list[str]) -> None:
        for key in keys:
            try:
                client.delete_key(key)
            except Exception:  # the store is going away: nothing left to bound
                return

    def _join_gc(self) -> None:
        if self._gc is not None:
            self._gc.join()
            self._gc = None

    def close(self, owner: Optional[ControlClient] = None) -> None:
        self._join_gc()
        if self._gc_client is not None:
            self._gc_client.close()
            self._gc_client = None
        if self._client is not owner:
            self._client.close()
