"""What each side keeps between syncs to send and apply deltas, and what it costs.

Trainer (:class:`SenderBases`): per tracked tensor, a copy of what was last sent (same
device and dtype as the tensor on the wire: after the cast, after FP8 quantization) and
its digest (hashed in a thread after each sync, off the critical path). Memory: the size
of the weight set as sent (bf16 model: 2 bytes/parameter; FP8: about 1), bounded by
``delta_max_bytes`` (tensors past the bound are not tracked and always go dense); tensors
of at most :data:`SMALL` bytes are never tracked (a record is never smaller). ``id`` names
the base receivers must hold for a delta (None: none yet, or the last sync failed): a new
random one after every completed sync.

Receiver (:class:`ReceiverBases`): the base of a tensor is the receiver's own tensor
when it was passed to ``receive_into`` with the same dtype and shape (no memory); else a
private copy in ``store`` (``receive_weights``, names not in ``params``, or a model that
holds another dtype): up to the size of the weight set. ``held`` maps each trainer rank
to the base id this receiver holds from it, set only when a sync completed.
"""

from __future__ import annotations

import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping, Optional

import torch

from weightsync.transport.codec import delta
from weightsync.transport.codec.digest import digest
from weightsync.transport.codec.options import AUTO_BACKOFF

__all__ = ["SenderBases", "ReceiverBases", "SendStats", "ReceiveStats", "SMALL", "new_id"]

#: Tensors of at most this many bytes always go dense (a record header costs about this).
SMALL = 256


def new_id() -> str:
    return secrets.token_hex(8)


@dataclass
class SendStats:
    tensors: int = 0
    delta: int = 0             # sent as a record
    dense: int = 0             # sent as they are
    untracked: int = 0         # dense because of delta_max_bytes
    source_bytes: int = 0      # the tensors as given (after the cast, before FP8)
    dense_bytes: int = 0       # what a dense sync of the same tensors would move
    record_bytes: int = 0      # bytes of the records sent
    sent_dense_bytes: int = 0  # bytes of the tensors sent dense
    compared: int = 0          # elements diffed
    changed: int = 0           # of those, elements that changed
    encode_seconds: float = 0.0
    resent: int = 0            # tensors sent again, dense, after a receiver's mismatch
    phases: dict = field(default_factory=dict)      # seconds per step of the sync
    _mark: float = field(default_factory=time.perf_counter)

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.phases[name] = self.phases.get(name, 0.0) + now - self._mark
        self._mark = now

    def as_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in self.__dict__.items() if not k.startswith("_")}
        out["changed_fraction"] = self.changed / self.compared if self.compared else None
        return out


@dataclass
class ReceiveStats:
    applied: int = 0           # delta records applied and verified
    dense: int = 0
    no_base: int = 0           # a record for a tensor this receiver holds no base of
    base_mismatch: int = 0     # the base digest differed: not applied
    result_mismatch: int = 0   # applied, but the digest after differed
    resent: int = 0            # received again, dense, in the second round
    needs: list = field(default_factory=list)
    apply_seconds: float = 0.0
    phases: dict = field(default_factory=dict)
    _mark: float = field(default_factory=time.perf_counter)

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.phases[name] = self.phases.get(name, 0.0) + now - self._mark
        self._mark = now

    def as_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in self.__dict__.items() if not k.startswith("_")}
        out["needs"] = len(self.needs)
        return out


def _fits(dest: Optional[torch.Tensor], dtype: torch.dtype, shape: tuple) -> bool:
    return (dest is not None and dest.dtype == dtype and tuple(dest.shape) == tuple(shape)
            and dest.is_contiguous())


def _copy_into(old: Optional[torch.Tensor], t: torch.Tensor) -> torch.Tensor:
    if _fits(old, t.dtype, tuple(t.shape)) and old.device == t.device:
        old.copy_(t)
        return old
    return t.detach().clone(memory_format=torch.contiguous_format)


class SenderBases:
    """The trainer rank's copies to diff against (see the module doc).

    Digests of the bases are computed off the sync's critical path: a tensor whose base
    changed is marked dirty, and :meth:`start_refresh` hashes the dirty ones in a thread
    after the sync (while the trainer trains); the next sync waits for it first
    (:meth:`wait_refresh`)."""

    def __init__(self, *, limit: Optional[int], auto: bool) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self.digests: dict[str, tuple[int, int]] = {}
        self.dirty: set[str] = set()
        self.backoff: dict[str, int] = {}
        self.nbytes = 0
        self.limit = limit
        self.auto = auto
        self.id: Optional[str] = None
        self._refresh: Optional[threading.Thread] = None

    def encode(self, name: str, t: torch.Tensor, *, allow: bool, wrap: bool,
               stats: SendStats) -> torch.Tensor:
        """What to send for ``t``: a record, or ``t`` (``wrap``: in a RAW record where it
        looks like one). Updates the base to ``t`` either way."""
        start = time.perf_counter()
        try:
            return self._encode(name, t, allow, wrap, stats)
        finally:
            stats.encode_seconds += time.perf_counter() - start

    def _encode(self, name: str, t: torch.Tensor, allow: bool, wrap: bool,
                stats: SendStats) -> torch.Tensor:
        nbytes = t.numel() * t.element_size()
        stats.tensors += 1
        stats.dense_bytes += nbytes
        if nbytes <= SMALL:
            self._forget(name)
            return self._dense(t, wrap, stats)
        t = t if t.is_contiguous() else t.contiguous()
        base = self.tensors.get(name)
        skip = self.backoff.get(name, 0)
        if skip:
            self.backoff[name] = skip - 1
        if allow and not skip and name in self.digests and name not in self.dirty \
                and _fits(base, t.dtype, tuple(t.shape)) and base.device == t.device:
            rec, idx = delta.encode(t, base, self.digests[name])
            stats.compared += t.numel()
            stats.changed += idx.numel()
            delta.scatter(base, t, idx)
            if idx.numel():
                self.dirty.add(name)
            if rec is not None:
                stats.delta += 1
                stats.record_bytes += rec.numel()
                return rec
            if self.auto:
                self.backoff[name] = AUTO_BACKOFF
            return self._dense(t, wrap, stats)
        if not self._keep(name, t):
            stats.untracked += 1
        return self._dense(t, wrap, stats)

    @staticmethod
    def _dense(t: torch.Tensor, wrap: bool, stats: SendStats) -> torch.Tensor:
        stats.dense += 1
        stats.sent_dense_bytes += t.numel() * t.element_size()
        return delta.raw_record(t) if wrap and delta.is_record(t) else t

    def _keep(self, name: str, t: torch.Tensor) -> bool:
        old = self.tensors.get(name)
        nbytes = t.numel() * t.element_size()
        old_bytes = 0 if old is None else old.numel() * old.element_size()
        if self.limit is not None and self.nbytes - old_bytes + nbytes > self.limit:
            self._forget(name)
            return False
        self.tensors[name] = _copy_into(old, t)
        self.nbytes += nbytes - old_bytes
        self.dirty.add(name)
        return True

    def _forget(self, name: str) -> None:
        old = self.tensors.pop(name, None)
        if old is not None:
            self.nbytes -= old.numel() * old.element_size()
        self.digests.pop(name, None)
        self.dirty.discard(name)

    # -- digests, off the critical path --------------------------------------------------
    def start_refresh(self) -> None:
        """Hash the dirty bases in a thread (call after a sync)."""
        self.wait_refresh()
        if not self.dirty:
            return
        todo = [(n, self.tensors[n]) for n in sorted(self.dirty) if n in self.tensors]
        self.dirty = set()
        self._refresh = threading.Thread(target=self._hash, args=(todo,), daemon=True,
                                         name="weightsync-codec-digests")
        self._refresh.start()

    def _hash(self, todo: list) -> None:
        for name, t in todo:
            self.digests[name] = digest(t)

    def wait_refresh(self) -> None:
        if self._refresh is not None:
            self._refresh.join()
            self._refresh = None

    def resend(self, names: list[str], wrap: bool) -> Iterator[tuple[str, torch.Tensor]]:
        """The current value of each of ``names`` this rank tracks, dense."""
        for name in names:
            t = self.tensors.get(name)
            if t is not None:
                yield name, (delta.raw_record(t) if wrap and delta.is_record(t) else t)

    def clear(self) -> None:
        self.wait_refresh()
        self.tensors.clear()
        self.digests.clear()
        self.dirty.clear()
        self.backoff.clear()
        self.nbytes = 0
        self.id = None


class ReceiverBases:
    """The receiver's side (see the module doc). ``keep``: hold bases (delta on)."""

    def __init__(self, *, keep: bool) -> None:
        self.keep = keep
        self.store: dict[str, torch.Tensor] = {}
        self.held: dict[str, str] = {}
        self.version: Any = None

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.store.values())

    def take_dense(self, name: str, t: torch.Tensor,
                   params: Optional[Mapping[str, torch.Tensor]]) -> torch.Tensor:
        """Land a dense tensor: into ``params[name]`` if there, else the store (when
        keeping bases), else yield it as it came."""
        dest = params.get(name) if params is not None else None
        if dest is not None:
            if t is not dest:
                if tuple(dest.shape) != tuple(t.shape):
                    raise ValueError(f"receive_into: {name} has shape {tuple(t.shape)}, "
                                     f"params[{name!r}] has {tuple(dest.shape)}")
                dest.copy_(t)
            if self.keep and not _fits(dest, t.dtype, tuple(t.shape)):
                self.store[name] = _copy_into(self.store.get(name), t)
            else:
                self.store.pop(name, None)
            return dest
        if not self.keep:
            return t
        self.store[name] = _copy_into(self.store.get(name), t)
        return self.store[name]

    def take_record(self, name: str, rec: torch.Tensor,
                    params: Optional[Mapping[str, torch.Tensor]],
                    stats: ReceiveStats) -> Optional[torch.Tensor]:
        """Apply a record; the tensor to yield, or None if it needs a dense resend."""
        head = delta.parse(rec)
        if head.enc == delta.RAW:
            stats.dense += 1
            return self.take_dense(name, delta.dense_view(head, rec), params)
        dest = params.get(name) if params is not None else None
        candidates = [c for c in (dest, self.store.get(name)) if _fits(c, head.dtype, head.shape)]
        if not candidates:
            stats.no_base += 1
            return None
        for target in candidates:
            try:
                delta.apply(head, rec, target)
            except delta.BaseMismatch:
                continue
            except delta.ResultMismatch:
                stats.result_mismatch += 1
                return None
            stats.applied += 1
            if target is dest:
                self.store.pop(name, None)
                return dest
            if dest is not None:
                dest.copy_(target)
                return dest
            return target
        stats.base_mismatch += 1
        return None

    def clear(self) -> None:
        self.store.clear()
        self.held.clear()
        self.version = None
