"""Which trainer rank sends which tensor when several ranks yield the same names.

The first sync (or the first after a reset) has no agreement yet: every rank sends what it
yields and receivers keep the first copy of each name. At the end of every sync the ranks
exchange the names they yielded through a store; each name is then owned by one of the
ranks that yield it, picked by a stable hash, so ownership is spread over the ranks and
every later sync sends each name once. If a rank stops yielding a name it owns, the sync
fails with ``PlanMismatch`` (and the next sync agrees afresh) instead of losing the name.
Trainer rank 0 hosts the store: the other ranks post when they have read an agreement, and
rank 0 waits for that (bounded, :meth:`Ownership.drain`) before its store closes.
"""

from __future__ import annotations

import hashlib
import time
import zlib
from typing import Optional

from weightsync.core.errors import PeerFailed, PlanMismatch, SyncTimeout
from weightsync.core.remote import raise_remote
from weightsync.core.wire import ErrorMsg, Message, NamesMsg, decode, encode
from weightsync.transport.control.server import ControlClient, StoreTimeout

__all__ = ["Ownership", "owner_of"]


def owner_of(name: str, holders: list[int]) -> int:
    """Deterministic owner among the sorted ranks that yield ``name``."""
    return holders[zlib.crc32(name.encode()) % len(holders)]


class Ownership:
    def __init__(self, store: ControlClient, prefix: str, rank: int, world: int,
                 timeout: float) -> None:
        self._store = store.clone()
        self._prefix = prefix
        self.rank = rank
        self.world = world
        self._timeout = timeout
        self._owner: Optional[dict[str, int]] = None
        self._posted = -1        # the last seq this rank posted its names (or failure) for
        self._agreed = 0         # the last seq whose agreement this rank read
        self._readers: tuple[int, ...] = tuple(range(1, world))  # who reads it (drain)

    def reset(self) -> None:
        self._owner = None

    def close(self) -> None:
        self._store.close()

    def should_send(self, name: str) -> bool:
        if self._owner is None:
            return True
        return self._owner.get(name, self.rank) == self.rank

    def _key(self, seq: int, rank: int) -> str:
        return f"{self._prefix}/names/{seq}/{rank}"

    def _read_key(self, rank: int) -> str:
        return f"{self._prefix}/read/{rank}"    # the last seq that rank read, overwritten

    def drain(self, timeout: float) -> None:
        """Trainer rank 0, whose process hosts the store, before it closes it: wait (at
        most ``timeout``) until every other rank that posted its names for the last
        agreement has read it, so a rank that is a little behind does not lose the store
        in the middle of its reads. A rank that posted its failure instead reads nothing
        more and is not waited for; one that never comes (it died) only costs the bound."""
        if self.rank != 0 or self.world < 2 or self._agreed < 1:
            return
        keys = [self._read_key(r) for r in self._readers]
        if not keys:
            return
        deadline = time.monotonic() + timeout
        try:
            while True:
                self._store.wait(keys, max(0.0, deadline - time.monotonic()))
                if all(int(self._store.get(k)) >= self._agreed for k in keys):
                    return
                if time.monotonic() >= deadline:
                    return
                time.sleep(0.005)
        except (StoreTimeout, OSError, ValueError):  # one never read, the store is gone
            return

    def fail(self, seq: int, msg: ErrorMsg) -> None:
        """This rank's sync ``seq`` failed before the exchange: post the failure in place
        of its names, so ranks waiting in :meth:`agree` learn it now, with its origin."""
        if self._posted == seq:
            return
        self._posted = seq
        self._store.set(self._key(seq, self.rank), encode(msg))

    def _exchange(self, seq: int, yielded: list[str], version: object) -> dict[int, list[str]]:
        digest = hashlib.sha256("\0".join(yielded).encode()).hexdigest()[:32]
        self._posted = seq
        keys = [self._key(seq, r) for r in range(self.world)]
        try:
            self._store.set(keys[self.rank], encode(NamesMsg(seq=seq, rank=self.rank,
                                                             digest=digest,
                                                             names=tuple(yielded))))
            self._store.wait(keys, self._timeout)
            msgs = [decode(self._store.get(k)) for k in keys]
            if seq > 1:
                self._store.delete_key(self._key(seq - 1, self.rank))
            if self.rank != 0:     # done reading rank 0's store up to this sync (see drain)
                self._store.set(self._read_key(self.rank), str(seq).encode())
            self._agreed = seq
            # a rank that posted its failure reads no more: nothing to wait for at teardown
            self._readers = tuple(r for r in range(1, self.world)
                                  if not isinstance(msgs[r], ErrorMsg))
        except StoreTimeout:
            try:
                missing = [r for r, k in enumerate(keys) if not self._store.check([k])]
            except ConnectionError:
                missing = []
            raise SyncTimeout(f"trainer ranks {missing} did not finish walking their tensors",
                              peer=f"trainer rank {missing[0] if missing else '?'}",
                              phase="ownership", version=version) from None
        except ConnectionError as exc:
            raise PeerFailed(f"lost the control store of trainer rank 0 ({exc})",
                             peer="trainer rank 0", phase="ownership", version=version) from None
        return {r: list(self._names(r, msg, version).names) for r, msg in enumerate(msgs)}

    @staticmethod
    def _names(rank: int, msg: Message, version: object) -> NamesMsg:
        if isinstance(msg, ErrorMsg):
            raise_remote(msg, phase="ownership")
        if not isinstance(msg, NamesMsg) or msg.rank != rank or msg.names is None:
            raise PlanMismatch("bad names message", peer=f"trainer rank {rank}",
                               phase="ownership", version=version)
        return msg

    def agree(self, seq: int, yielded: list[str], version: object = None) -> None:
        """End-of-sync agreement; raises ``PlanMismatch`` if a name was not sent."""
        per_rank = self._exchange(seq, yielded, version)
        holders: dict[str, list[int]] = {}
        for r in range(self.world):
            for name in per_rank[r]:
                holders.setdefault(name, []).append(r)
        missing = []
        if self._owner is not None:
            for name, ranks in holders.items():
                owner = self._owner.get(name)
                if owner is not None and owner not in ranks:
                    missing.append(name)
        self._owner = {name: owner_of(name, ranks) for name, ranks in holders.items()}
        if missing:
            raise PlanMismatch(
                f"{len(missing)} tensors were not sent because their owning trainer rank no "
                f"longer yields them: {sorted(missing)[:10]}; ownership is re-agreed for the "
                "next sync", peer=f"trainer rank {self.rank}", phase="ownership",
                version=version)
