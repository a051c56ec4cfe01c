"""Names, shapes and dtypes of a weight set on ms-swift's path, checked before bytes move.

ms-swift hands trainer rank 0's engine one iterator (a collective export every trainer
rank walks once), so the layout of a sync cannot be read ahead of its bytes. Trainer rank 0
therefore knows the layout of a sync from:

* ``described``: the trainer actor's ``weightsync_describe_weights(adapter_only)``, a
  metadata-only description (``[[name, shape, dtype], ...]``), when the actor has one (the
  CPU harness does; ms-swift's ``MegatronWorker`` does not);
* ``recorded``: else what its last complete send of the same weight set (full or
  adapter-only) yielded, recorded on the way (metadata only, no extra pass);
* none: the first sync of a weight set without a description is not checked before bytes
  (the rollout checks what arrives, as without this module).

The layout is keyed by its digest (:class:`Layout`); every rollout keeps the digests it
has accepted (per weight set and peft config), so a layout is sent to and checked by a
rollout once, and a steady sync adds no message. While sending, :class:`LayoutFeed` holds
the export to the layout checked for this sync: a tensor that is not in it, differs in
shape or dtype, comes twice, or is missing at the end fails the send with
:class:`~weightsync.core.errors.PlanMismatch` naming it (bytes of earlier tensors have
moved by then; the recorded layout is dropped, so the next sync is a first pass again).

Rollout side: :func:`default_check_weights` checks a layout with the actor's weightsync
rollout adapter (``self.rollout.check_weights``: HF or vLLM replica), else, for ms-swift's
``VllmServer``, against the safetensors headers of its local model folder; else it cannot
check (``None``) and the sync goes on unchecked for that rollout.
"""

from __future__ import annotations

import hashlib
import json
import logging
from typing import Any, Optional

import torch

from weightsync.core.digests import MAX_LISTED
from weightsync.core.errors import PlanMismatch
from weightsync.core.plan import dtype_from_name, dtype_name
from weightsync.transport.tensors import CASTABLE, wire_dtype

__all__ = ["Layout", "LayoutFeed", "layout_mismatch", "default_check_weights", "KINDS"]

logger = logging.getLogger(__name__)
KINDS = ("full", "adapter")


def _entry(entry: Any, cast: Optional[torch.dtype]) -> list:
    if not (isinstance(entry, (list, tuple)) and len(entry) == 3):
        raise ValueError(f"bad weight description {entry!r:.200}: want [name, shape, dtype]")
    name, shape, dtype = entry
    if not isinstance(name, str) or not name:
        raise ValueError(f"bad tensor name {name!r:.200} in a weight description")
    dims = [int(d) for d in shape]
    held = dtype_from_name(dtype) if isinstance(dtype, str) else dtype
    if cast is not None and held in CASTABLE:
        held = cast
    return [name, dims, dtype_name(held)]


class Layout:
    """One weight set's ``[[name, shape, dtype], ...]`` (sorted by name, the engine's dtype
    cast applied) and its digest."""

    def __init__(self, entries: list, source: str) -> None:
        self.entries = sorted(entries)
        names = [e[0] for e in self.entries]
        dup = sorted({n for n in names if names.count(n) > 1}) if len(set(names)) != len(names) \
            else []
        if dup:
            raise ValueError(f"the weight description names {dup[:MAX_LISTED]} twice")
        self.by_name = {e[0]: e for e in self.entries}
        self.source = source
        self.digest = hashlib.sha256(json.dumps(self.entries).encode()).hexdigest()[:32]

    @classmethod
    def of(cls, described: Any, cast: Optional[torch.dtype], source: str = "described",
           previous: Optional["Layout"] = None) -> "Layout":
        """A description from the trainer actor (``previous``: reuse it when equal)."""
        if not isinstance(described, (list, tuple)):
            raise ValueError("weightsync_describe_weights must return a list of [name, shape, "
                             f"dtype], got {type(described).__name__}")
        entries = sorted(_entry(e, cast) for e in described)
        if previous is not None and previous.entries == entries:
            previous.source = source
            return previous
        return cls(entries, source)

    @classmethod
    def union(cls, parts: list["Layout"]) -> "Layout":
        """The layout of a sync whose senders yield ``parts`` (a name yielded by several
        must have one shape and dtype: each name reaches a rollout once)."""
        if len(parts) == 1:
            return parts[0]
        merged: dict[str, list] = {}
        for part in parts:
            for entry in part.entries:
                seen = merged.setdefault(entry[0], entry)
                if seen != entry:
                    raise ValueError(f"trainer ranks yield {entry[0]!r} as {seen[1:]} and as "
                                     f"{entry[1:]}")
        return cls(list(merged.values()), "+".join(sorted({p.source for p in parts})))


def _why(want: list, shape: list, dtype: str) -> Optional[str]:
    if want[1] != shape:
        return f"shape {tuple(shape)}, the checked layout has {tuple(want[1])}"
    if want[2] != dtype:
        return f"dtype {dtype}, the checked layout has {want[2]}"
    return None


class LayoutFeed:
    """A sending trainer's export on its way into the engine (``who``: the trainer, as
    errors name it): records each tensor's layout (no copy) and holds it to ``expected``
    (this trainer's part of the layout checked for this sync) if given."""

    def __init__(self, feed: Any, expected: Optional[Layout], cast: Optional[torch.dtype], *,
                 version: Any = None, who: str = "trainer rank 0") -> None:
        self._feed, self.expected, self.cast, self.version = feed, expected, cast, version
        self.who = who
        self._async = hasattr(feed, "__aiter__")
        self._it: Any = None
        self.seen: list = []
        self._names: set = set()
        self.complete = False
        self.deviated = False

    # -- iteration ------------------------------------------------------------------------
    def __iter__(self) -> "LayoutFeed":
        if self._async:
            raise TypeError("an async export: iterate with async for")
        self._it = iter(self._feed)
        return self

    def __next__(self) -> Any:
        try:
            item = next(self._it)
        except StopIteration:
            self._end()
            raise
        return self._see(item)

    def __aiter__(self) -> "LayoutFeed":
        self._it = self._feed.__aiter__() if self._async else iter(self._feed)
        return self

    async def __anext__(self) -> Any:
        try:
            item = await self._it.__anext__() if self._async else next(self._it)
        except (StopIteration, StopAsyncIteration):
            self._end()
            raise StopAsyncIteration from None
        return self._see(item)

    # -- checks ---------------------------------------------------------------------------
    def _see(self, item: Any) -> Any:
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)
                and isinstance(item[1], torch.Tensor)):
            return item                   # the engine refuses it with its own message
        name, tensor = item
        entry = [name, [int(d) for d in tensor.shape], dtype_name(wire_dtype(tensor, self.cast))]
        if name in self._names:
            self._deviate(name, "twice")
        self._names.add(name)
        self.seen.append(entry)
        if self.expected is not None:
            want = self.expected.by_name.get(name)
            if want is None:
                self._deviate(name, "which the checked layout does not have")
            why = _why(want, entry[1], entry[2])
            if why is not None:
                self._deviate(name, f"with {why}")
        return item

    def _end(self) -> None:
        if self.expected is not None and len(self._names) != len(self.expected.by_name):
            missing = sorted(set(self.expected.by_name) - self._names)
            if missing:
                self._deviate(missing[0], "nowhere: the export ended without it",
                              names=missing)
        self.complete = True

    def _deviate(self, name: str, what: str, names: Optional[list] = None) -> None:
        self.deviated = True
        names = names or [name]
        source = self.expected.source if self.expected is not None else "recorded"
        err = PlanMismatch(
            f"{self.who}'s export yields {name!r} {what} (checked before this sync: the "
            f"{source} layout, digest {self.expected.digest if self.expected else '-'}); "
            f"{len(names)} tensor(s): {names[:MAX_LISTED]}. Bytes of earlier tensors have "
            "moved; the next sync checks the export as it is then", peer=self.who,
            phase="send", version=self.version)
        err.names = names  # type: ignore[attr-defined]
        raise err

    def layout(self) -> Optional[Layout]:
        """The layout of a complete export (None if it did not end)."""
        if not self.complete:
            return None
        if self.expected is not None:
            return self.expected
        try:
            return Layout(self.seen, "recorded")
        except ValueError:
            return None


def layout_mismatch(bad: dict, kind: str, version: Any) -> PlanMismatch:
    """The refusal for ``bad`` (rollout name -> ``[[tensor, why], ...]``)."""
    names = sorted({p[0] for problems in bad.values() for p in problems})
    listed = "; ".join(f"{who}: " + ", ".join(f"{n} ({why})" for n, why in problems[:MAX_LISTED])
                       for who, problems in bad.items())
    err = PlanMismatch(f"the {kind} weight set of trainer rank 0 does not fit {sorted(bad)}: "
                       f"{len(names)} offending tensor(s), refused before any byte moved: "
                       f"{listed}"[:8000], peer=next(iter(bad)), phase="validate",
                       version=version)
    err.names, err.problems = names, bad   # type: ignore[attr-defined]
    return err


def _problem_list(out: Any) -> Optional[list]:
    if out is None:
        return None
    if not isinstance(out, (list, tuple)):
        raise ValueError(f"a weight check must return [[name, why], ...] or None, got {out!r:.200}")
    return [[str(p[0]), str(p[1])] for p in out]


def default_check_weights(actor: Any, offered: list, adapter_only: bool,
                          peft_config: Optional[dict]) -> Optional[list]:
    """Problems (``[[name, why], ...]``) of loading ``offered`` into this rollout actor's
    model, or None when it cannot tell (see the module doc)."""
    kind = "adapter" if adapter_only else "full"
    rollout = getattr(actor, "rollout", None)
    check = getattr(rollout, "check_weights", None)
    if callable(check):
        return _problem_list(check(offered, kind=kind, adapter_config=peft_config))
    folder = getattr(getattr(actor, "_engine", None), "model_id", None)   # ms-swift VllmServer
    if isinstance(folder, str):
        from weightsync.rollout.vllm.apply import checkpoint_header
        from weightsync.rollout.vllm.checks import check_offered
        header = checkpoint_header(folder)
        if header is not None:
            return _problem_list(check_offered(header, offered, kind, torch.bfloat16, None))
    return None
