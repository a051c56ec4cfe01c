"""A model's weights inside one process: sleep/wake (:class:`WeightParking`, vLLM's sleep
levels), the staging copy of an atomic sync (:class:`WeightStaging`) and the atomic-sync
calls of a replica built on it (:class:`StagedSync`, mixed into the HF replica).

Level 1 copies every weight to host memory and frees the device copy (kept: wake_up
restores it); level 2 frees them (discarded: wake_up re-allocates them filled with NaN for
floating tensors, so a weight that no sync restored can never pass for a real one).

A staging copy costs one copy of the weights (tied tensors once, each in its live dtype
and on its device), allocated at the first staged receive: the new version is received
into it while the live weights keep their version; commit swaps the storages (no copy),
so the copy then holds the previous version until it is released, and an abort after a
commit swaps it back.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional, Sequence

import torch

from weightsync.core.errors import WeightSyncError

__all__ = ["WeightParking", "WeightStaging", "StagedSync"]


class WeightParking:
    """``share``: weights re-allocated by a wake-up go to shared memory (a replica whose
    model lives there: ``HFRolloutReplica(share_memory=True)``)."""

    def __init__(self, *, share: bool = False) -> None:
        self.share = share
        self.level = 0                  # 0: awake; 1 or 2: weights asleep at that level
        self._parked: dict[int, tuple] = {}   # id -> (name, tensor, backup, shape, dtype, dev)
        self._discarded: dict[int, str] = {}         # id -> name; cleared as syncs restore

    @property
    def asleep(self) -> bool:
        return self.level > 0

    def park(self, tensors: dict[str, torch.Tensor], level: int) -> None:
        if self.asleep:
            if level > self.level:   # deepen: drop the host copies too
                for key, (name, t, _, shape, dtype, dev) in self._parked.items():
                    self._parked[key] = (name, t, None, shape, dtype, dev)
                    self._discarded[key] = name
                self.level = level
            return
        seen = set()
        for name, t in tensors.items():
            if id(t) in seen:
                continue
            seen.add(id(t))
            backup = t.data.to("cpu", copy=True) if level == 1 else None
            self._parked[id(t)] = (name, t, backup, tuple(t.shape), t.dtype, t.device)
            if level >= 2:
                self._discarded[id(t)] = name
            t.data = torch.empty(0, dtype=t.dtype, device=t.device)
        self.level = level

    def restore(self) -> None:
        if not self.asleep:
            return
        for _, t, backup, shape, dtype, dev in self._parked.values():
            if backup is not None:
                t.data = backup.to(dev)
            elif dtype.is_floating_point:
                t.data = torch.full(shape, float("nan"), dtype=dtype, device=dev)
            else:
                t.data = torch.zeros(shape, dtype=dtype, device=dev)
            if self.share and t.device.type == "cpu":
                t.data.share_memory_()
        self._parked.clear()
        self.level = 0

    def loaded(self, t: torch.Tensor) -> None:
        self._discarded.pop(id(t), None)

    def unrestored(self, live: Optional[dict[str, torch.Tensor]] = None) -> list[str]:
        """Names discarded by level 2 that no sync has written since (among ``live``)."""
        if live is not None:
            ids = {id(t) for t in live.values()}
            for key in [k for k in self._discarded if k not in ids]:
                del self._discarded[key]
        return sorted(self._discarded.values())


class WeightStaging:
    """The staging copy of ``version`` (rounds ``kinds``) of one model's weights."""

    def __init__(self, version: Any, kinds: Sequence[str], *, share: bool = False) -> None:
        self.share = share                 # the copy in shared memory (as the live weights)
        self.version = version
        self.missing = set(kinds)          # rounds not staged completely yet
        self.committed = False             # swapped in: the copy holds the previous weights
        self.previous: Any = None          # (version, fence reason) before the commit
        self._pairs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}   # id(live) -> (live, copy)

    def targets(self, live: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``name -> staging tensor`` for ``live`` (allocated on first use; tied names
        share one)."""
        out = {}
        for name, t in live.items():
            pair = self._pairs.get(id(t))
            if pair is None:
                copy = torch.empty_like(t.data)
                if self.share and copy.device.type == "cpu":
                    copy.share_memory_()
                pair = self._pairs[id(t)] = (t, copy)
            out[name] = pair[1]
        return out

    @property
    def nbytes(self) -> int:
        return sum(c.numel() * c.element_size() for _, c in self._pairs.values())

    @property
    def complete(self) -> bool:
        return not self.missing and bool(self._pairs)

    def live(self) -> Iterator[torch.Tensor]:
        return (t for t, _ in self._pairs.values())

    def swap(self) -> None:
        """Exchange the live and the staged storage of every tensor (commit; again: roll
        back); all or none of them."""
        done: list[int] = []
        try:
            for key in list(self._pairs):
                self._exchange(key)
                done.append(key)
        except BaseException:
            for key in done:
                self._exchange(key)
            raise
        self.committed = not self.committed

    def _exchange(self, key: int) -> None:
        live, copy = self._pairs[key]
        current = live.data
        live.data = copy
        self._pairs[key] = (live, current)


class StagedSync:
    """The atomic-sync calls (see :mod:`weightsync.rollout.protocol`) of a replica whose
    model lives in this process. Its class provides ``name``, ``_version``, ``_fence`` (a
    ``SyncFence``), ``gate``, ``_parking``, ``_in_flight``, ``_record``, ``_check_idle``,
    ``_stage_lock`` (a lock), ``_staging`` (None) and ``_stage_refusal(kinds)`` (why it
    cannot stage ``kinds``, or None); its ``load_weights`` receives into
    ``_staging_of(version)`` when that is not None."""

    _staging: Optional[WeightStaging]
    _version: Any

    def begin_sync(self, version: Any, kinds: Sequence[str], *, staged: bool = False) -> None:
        """Fence until ``version`` is applied, or (``staged``) receive it into a copy."""
        with self._stage_lock:
            self._staging = None        # a new sync: an earlier copy is of no use
            if not staged:
                return super().begin_sync(version, kinds)   # type: ignore[misc]
            why = self._stage_refusal(list(kinds))
            if why:
                raise ValueError(f"{self.name} cannot stage this sync: {why}")
            self._fence.begin(version, list(kinds), staged=True)
            self._staging = WeightStaging(version, kinds,
                                          share=getattr(self, "share_memory", False))

    def _staging_of(self, version: Any) -> Optional[WeightStaging]:
        """The copy a receive of ``version`` goes into (None: into the live weights)."""
        with self._stage_lock:
            s = self._staging
            if s is not None and s.version != version:
                self._staging = s = None           # another version: that copy is stale
            if s is not None and s.committed:
                raise WeightSyncError(f"{self.name}: version {version!r} is already "
                                      "committed", phase="receive", version=version)
            return s

    @contextlib.contextmanager
    def _paused(self) -> Iterator[None]:
        here = not self.gate.paused
        if here:             # never swap weights under a running generation
            self.gate.pause(abort=False)
        try:
            yield
        finally:
            if here:
                self.gate.resume()

    def commit_sync(self, version: Any) -> dict:
        """Swap the complete staged copy of ``version`` in (the old weights are kept until
        ``release_sync``, for ``abort_sync``)."""
        self._record(f"commit:{version}")
        with self._stage_lock:
            s = self._staging
            if s is None or s.version != version or not s.complete:
                lacks = f" (lacks {sorted(s.missing)})" if s is not None and s.missing else ""
                raise WeightSyncError(f"{self.name}: no complete staged copy of version "
                                      f"{version!r} to commit{lacks}", phase="commit",
                                      version=version)
            if not s.committed:
                self._check_idle("commit")
                if self._parking.asleep:
                    raise WeightSyncError(f"{self.name} is asleep; wake_up before commit",
                                          phase="commit", version=version)
                with self._paused():
                    s.previous = (self._version, self._fence.reason)
                    s.swap()
                    for t in s.live():
                        self._parking.loaded(t)
                    self._version = version
                    self._fence.end_staged(committed=True)
            return {"version": version, "staged_bytes": s.nbytes}

    def abort_sync(self, version: Any = None) -> dict:
        """Drop the staged copy; after a commit of ``version``, swap the old weights back.
        Returns the version now served, whether it rolled back, and ``busy`` (a receive
        still runs past its bound)."""
        self._record(f"abort:{version}")
        with self._stage_lock:
            s, self._staging = self._staging, None
            rolled = s is not None and s.committed and s.version == version
            if rolled:
                with self._paused():
                    s.swap()                              # type: ignore[union-attr]
                    self._version, reason = s.previous    # type: ignore[union-attr,misc]
                    if reason:
                        self._fence.fence(reason)
            elif s is not None and not s.committed:
                self._fence.end_staged(committed=False)
            return {"version": self._version, "rolled_back": rolled,
                    "busy": self._in_flight > 0}

    def release_sync(self, version: Any) -> dict:
        """The sync of ``version`` is decided: free the old weights."""
        self._record(f"release:{version}")
        with self._stage_lock:
            s = self._staging
            if s is not None and s.version == version:
                if not s.committed:
                    raise WeightSyncError(f"{self.name}: version {version!r} was not "
                                          "committed", phase="release", version=version)
                self._staging = None
            return {"version": self._version}
