"""What each side keeps between syncs to send and apply deltas, and what it costs.

Trainer (:class:`SenderBases`): per tracked tensor, a copy of what was last sent (same
device and dtype as the tensor on the wire: after the cast, after FP8 quantization).
Memory: the size of the weight set as sent (bf16 model: 2 bytes/parameter; FP8: about 1),
bounded by ``delta_max_bytes`` (tensors past the bound are not tracked and always go
dense); tensors of at most :data:`SMALL` bytes are never tracked (a record is never
smaller). ``id`` names the base receivers must hold for a delta (None: none yet, or the
last sync failed): a new random one after every completed sync. One sync's encode is an
:class:`EncodeRun`: host tensors are diffed one by one (numpy), device tensors in groups by
:mod:`.gpu` (its memory: see there).

Receiver (:class:`ReceiverBases`): the base of a tensor is the receiver's own tensor
when it was passed to ``receive_into`` with the same dtype and shape (no memory); else a
private copy in ``store`` (``receive_weights``, names not in ``params``, or a model that
holds another dtype): up to the size of the weight set. ``held`` maps each trainer rank
to the base id this receiver holds from it, set only when a sync completed. A record is
applied only onto the very tensor the last sync left the base in: the same storage and
address, and, where torch counts them, no in-place writes since (its version counter);
anything else (a tensor replaced, or written by the caller) is a base mismatch, sent
again dense. Writes that bypass torch's counter (``.data``, raw pointers) are caught
where the record changes the tensor (the change digest covers the values replaced);
after loading weights into a model behind the codec's back, call the engine's
``drop_codec_state()``.
"""

from __future__ import annotations

import secrets
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping, Optional

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from weightsync.transport.codec import delta, gpu
from weightsync.transport.codec.options import AUTO_BACKOFF
from weightsync.transport.tensors import ReplayedLasting

__all__ = ["SenderBases", "EncodeRun", "ReceiverBases", "SendStats", "ReceiveStats", "SMALL",
           "STAGED", "new_id"]

#: Tensors of at most this many bytes always go dense (a record header costs about this).
SMALL = 256


def new_id() -> str:
    return secrets.token_hex(8)


class _Laps:
    """What the send and receive stats share: ``lap(name)`` adds the seconds since the last
    lap to ``phases[name]``; ``_public()`` is every field whose name has no leading ``_``."""

    phases: dict
    _mark: float

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.phases[name] = self.phases.get(name, 0.0) + now - self._mark
        self._mark = now

    def _public(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if not k.startswith("_")}


@dataclass
class SendStats(_Laps):
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
    encode_seconds: float = 0.0   # host time in the encode (device work is queued)
    groups: int = 0            # device launches of the diff
    resent: int = 0            # tensors sent again, dense, after a receiver's mismatch
    phases: dict = field(default_factory=dict)      # seconds per step of the sync
    _mark: float = field(default_factory=time.perf_counter)

    def as_dict(self) -> dict[str, Any]:
        out = self._public()
        out["changed_fraction"] = self.changed / self.compared if self.compared else None
        return out


@dataclass
class ReceiveStats(_Laps):
    applied: int = 0           # delta records applied and verified
    dense: int = 0
    no_base: int = 0           # a record for a tensor this receiver holds no base of
    base_mismatch: int = 0     # the tensor is not the one the base was left in: not applied
    result_mismatch: int = 0   # the record's checks failed: not applied
    resent: int = 0            # received again, dense, in the second round
    needs: list = field(default_factory=list)
    apply_seconds: float = 0.0
    phases: dict = field(default_factory=dict)
    _mark: float = field(default_factory=time.perf_counter)

    def as_dict(self) -> dict[str, Any]:
        out = self._public()
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
    """The trainer rank's copies to diff against (see the module doc)."""

    def __init__(self, *, limit: Optional[int], auto: bool) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self.backoff: dict[str, int] = {}
        self.nbytes = 0
        self.limit = limit
        self.auto = auto
        self.id: Optional[str] = None
        #: which of the caller's tensors outlive their item (their diff may wait for a group)
        self.lasting = ReplayedLasting()
        self.encoder = gpu.Encoder()

    def keep(self, name: str, t: torch.Tensor) -> bool:
        """Track ``t`` as the base of ``name`` (a copy); False past ``limit``."""
        old = self.tensors.get(name)
        nbytes = t.numel() * t.element_size()
        old_bytes = 0 if old is None else old.numel() * old.element_size()
        if self.limit is not None and self.nbytes - old_bytes + nbytes > self.limit:
            self.forget(name)
            return False
        self.tensors[name] = _copy_into(old, t)
        self.nbytes += nbytes - old_bytes
        return True

    def forget(self, name: str) -> None:
        old = self.tensors.pop(name, None)
        if old is not None:
            self.nbytes -= old.numel() * old.element_size()

    def resend(self, names: list[str], wrap: bool) -> Iterator[tuple[str, torch.Tensor]]:
        """The current value of each of ``names`` this rank tracks, dense."""
        for name in names:
            t = self.tensors.get(name)
            if t is not None:
                yield name, _wrapped(t, wrap)

    def clear(self) -> None:
        self.tensors.clear()
        self.backoff.clear()
        self.lasting.reset()
        self.nbytes = 0
        self.id = None


def _wrapped(t: torch.Tensor, wrap: bool) -> torch.Tensor:
    """``t`` in a RAW record where a receiver could take it for one."""
    return delta.raw_record(t) if wrap and delta.is_record(t) else t


class EncodeRun:
    """One sync's encode on a trainer rank: :meth:`add` each tensor as it is to go on the
    wire, in order, and send what it returns; then send what :meth:`close` returns.

    Device tensors whose base is tracked are diffed in groups (:class:`~.gpu.Encoder`): a
    group is launched once it holds :data:`~.gpu.GROUP_BYTES`; a caller's tensor that its
    next item may rewrite is diffed from a copy taken at once. A launched group's records
    are handed out once the next group is launched (its counts read back while that one
    runs). A tensor that goes dense after its diff is sent from its base, which holds its
    bytes by then."""

    def __init__(self, bases: SenderBases, *, allow: bool, wrap: bool, stats: SendStats,
                 version: Any = None) -> None:
        self.bases, self.allow, self.wrap, self.stats = bases, allow, wrap, stats
        self.version = version
        self._group: list = []
        self._group_bytes = 0
        self._pending: deque = deque()

    def lasting(self, name: str, t: torch.Tensor) -> bool:
        """Ask (in order, for every tensor of the caller's) whether ``t`` outlives its item."""
        return self.bases.lasting.lasting(name, t, version=self.version)

    def add(self, name: str, t: torch.Tensor, *, own: bool, lasting: bool = False
            ) -> list[tuple[str, torch.Tensor]]:
        """``t`` to send under ``name``: ``own`` when the codec made it (a cast, an FP8
        piece: nobody else writes it); ``lasting`` (for the caller's tensors) as
        :meth:`lasting` answered."""
        start = time.perf_counter()
        try:
            return self._add(name, t, own, lasting)
        finally:
            self.stats.encode_seconds += time.perf_counter() - start

    def _add(self, name: str, t: torch.Tensor, own: bool, lasting: bool) -> list:
        b, stats = self.bases, self.stats
        nbytes = t.numel() * t.element_size()
        stats.tensors += 1
        stats.dense_bytes += nbytes
        if nbytes <= SMALL or not delta.deltable(t):
            b.forget(name)
            return [self._dense(name, t)]
        if not t.is_contiguous():
            t, own = t.contiguous(), True
        base = b.tensors.get(name)
        skip = b.backoff.get(name, 0)
        if skip:
            b.backoff[name] = skip - 1
        if not (self.allow and not skip and _fits(base, t.dtype, tuple(t.shape))
                and base.device == t.device):
            if not b.keep(name, t):
                stats.untracked += 1
            return [self._dense(name, t)]
        stats.compared += t.numel()
        if not gpu.available(t.device):     # the host (a device without Triton: via it)
            host = t.device.type == "cpu"
            rec, idx = delta.encode_host(t if host else t.cpu(), base if host else base.cpu())
            delta.scatter(base, t, idx)
            if rec is not None and not host:
                rec = rec.to(t.device)
            return [self._result(name, t, rec, idx.numel())]
        if not (own or lasting):
            # the export may rewrite it once its iterator moves on; the records are made
            # from it after that: diff a copy of it (queued now, so ordered before them)
            t = t.clone()
        self._group.append((name, t, base))
        self._group_bytes += nbytes
        if self._group_bytes >= gpu.GROUP_BYTES or len(self._group) >= gpu.GROUP_TENSORS:
            return self._launch()
        return []

    def close(self) -> list[tuple[str, torch.Tensor]]:
        """What is left to send once every tensor was added."""
        out = self._launch()
        while self._pending:
            out += self._finish()
        return out

    def _launch(self) -> list:
        out = []
        if self._group:
            self._pending.append(self.bases.encoder.launch(self._group))
            self.stats.groups += 1
            self._group, self._group_bytes = [], 0
        while len(self._pending) > 1 or (self._pending and self._pending[0].readback.ready()):
            out += self._finish()
        return out

    def _finish(self) -> list:
        group = self._pending.popleft()
        out = []
        for got, (_, t, base) in zip(self.bases.encoder.finish(group), group.items):
            out.append(self._result(got.key, base, got.record, got.changed))
        return out

    def _result(self, name: str, dense: torch.Tensor, rec: Optional[torch.Tensor],
                changed: int) -> tuple[str, torch.Tensor]:
        self.stats.changed += changed
        if rec is not None:
            self.stats.delta += 1
            self.stats.record_bytes += rec.numel()
            return name, rec
        if self.bases.auto:
            self.bases.backoff[name] = AUTO_BACKOFF
        return self._dense(name, dense)

    def _dense(self, name: str, t: torch.Tensor) -> tuple[str, torch.Tensor]:
        self.stats.dense += 1
        self.stats.sent_dense_bytes += t.numel() * t.element_size()
        return name, _wrapped(t, self.wrap)


def _mark(t: torch.Tensor) -> tuple:
    """What identifies the tensor a base was left in (see :meth:`ReceiverBases.holds`)."""
    try:
        version = t._version
    except RuntimeError:       # an inference tensor counts no versions
        version = None
    return (t.data_ptr(), tuple(t.shape), t.dtype, StorageWeakRef(t.untyped_storage()),
            version)


def _same(mark: Optional[tuple], t: torch.Tensor) -> bool:
    if mark is None or mark[0] != t.data_ptr() or mark[1] != tuple(t.shape) \
            or mark[2] != t.dtype or mark[3].expired() \
            or mark[3].cdata != t.untyped_storage()._cdata:
        return False
    try:
        return mark[4] == t._version
    except RuntimeError:
        return mark[4] is None


@dataclass
class _Pending:
    name: str
    target: torch.Tensor
    dest: Optional[torch.Tensor]


class ReceiverBases:
    """The receiver's side (see the module doc). ``keep``: hold bases (delta on)."""

    def __init__(self, *, keep: bool) -> None:
        self.keep = keep
        self.store: dict[str, torch.Tensor] = {}
        self.held: dict[str, str] = {}
        self.version: Any = None
        self.marks: dict[str, tuple] = {}
        self._decoders: dict[torch.device, gpu.Decoder] = {}
        self._staged: dict[str, _Pending] = {}

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.store.values())

    def holds(self, name: str, t: Optional[torch.Tensor]) -> bool:
        """Whether ``t`` is the tensor the last sync left the base of ``name`` in."""
        return t is not None and _same(self.marks.get(name), t)

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
                self.marks[name] = _mark(self.store[name])
            else:
                self.store.pop(name, None)
                if self.keep:
                    self.marks[name] = _mark(dest)
            return dest
        if not self.keep:
            return t
        self.store[name] = _copy_into(self.store.get(name), t)
        self.marks[name] = _mark(self.store[name])
        return self.store[name]

    def is_record(self, name: str, t: torch.Tensor,
                  params: Optional[Mapping[str, torch.Tensor]]) -> bool:
        """Whether ``t``, received in a sync where trainers send records, is one: a 1-D
        ``uint8`` tensor for a name whose tensor is not one is; for a name whose tensor is
        one too (or unknown) the magic is read on the host (rare)."""
        if t.dtype != torch.uint8 or t.dim() != 1:
            return False
        known = params.get(name) if params is not None else None
        if known is None:
            known = self.store.get(name)
        if known is not None and not (known.dtype == torch.uint8 and known.dim() == 1):
            return t.numel() >= delta.HEAD
        return delta.is_record(t)

    def take_record(self, name: str, rec: torch.Tensor,
                    params: Optional[Mapping[str, torch.Tensor]],
                    stats: ReceiveStats) -> Any:
        """Apply a record: the tensor to yield; None if it needs a dense resend; or
        :data:`STAGED` (a record checked and applied on the device: its outcome comes
        from :meth:`finish_records`)."""
        dest = params.get(name) if params is not None else None
        target = next((c for c in (dest, self.store.get(name)) if self.holds(name, c)), None)
        if target is not None and gpu.available(target.device):
            decoder = self._decoders.get(target.device)
            if decoder is None:
                decoder = self._decoders[target.device] = gpu.Decoder(target.device)
            if decoder.add(name, rec, target):
                self._staged[name] = _Pending(name, target, dest)
                return STAGED
        # on the host: a host tensor, a RAW record, no base, or not a record for it
        head = delta.parse(rec)
        if head.enc == delta.RAW:
            stats.dense += 1
            return self.take_dense(name, delta.dense_view(head, rec), params)
        if target is None:
            if name in self.marks:
                stats.base_mismatch += 1
            else:
                stats.no_base += 1
            return None
        try:
            delta.apply(head, rec.to(target.device), target)
        except delta.BaseMismatch:
            stats.base_mismatch += 1
            return None
        except delta.ResultMismatch:
            stats.result_mismatch += 1
            return None
        stats.applied += 1
        return self._landed(name, target, dest)

    def _landed(self, name: str, target: torch.Tensor,
                dest: Optional[torch.Tensor]) -> torch.Tensor:
        if dest is not None and target is not dest:
            dest.copy_(target)
            out = dest
        else:
            out = target
        self.marks[name] = _mark(target)
        return out

    def finish_records(self, stats: ReceiveStats) -> list[tuple[str, Optional[torch.Tensor]]]:
        """The outcome of every staged record: ``(name, tensor to yield)``, or ``(name,
        None)`` for one that failed its checks (its tensor untouched)."""
        out = []
        for decoder in self._decoders.values():
            for name, ok in decoder.results():
                p = self._staged.pop(name)
                if ok:
                    stats.applied += 1
                    out.append((name, self._landed(name, p.target, p.dest)))
                else:
                    stats.result_mismatch += 1
                    out.append((name, None))
        self._staged.clear()
        return out

    def drop_staged(self) -> None:
        """A receive that ends early: forget what was staged (nothing of it committed is
        trusted: the failed sync leaves no base held)."""
        try:
            for decoder in self._decoders.values():
                decoder.results()
        except Exception:  # the receive failed already: its own error is the one to see
            pass
        self._staged.clear()

    def clear(self) -> None:
        self.store.clear()
        self.held.clear()
        self.marks.clear()
        self._staged.clear()
        self.version = None


#: :meth:`ReceiverBases.take_record`'s answer for a record queued on the device.
STAGED = object()
