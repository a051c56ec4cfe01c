"""Validated configuration of a checkpoint engine.

Values come from keyword arguments; where a keyword is left out, from ``WEIGHTSYNC_*``
environment variables read when the config is built; else from the defaults below.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from weightsync.core.plan import DEFAULT_ALIGNMENT, dtype_from_name

__all__ = ["EngineConfig", "option", "option_rows", "option_names", "build_options",
           "DEFAULT_BUCKET_SIZE", "DEFAULT_NUM_SLOTS", "DEFAULT_TIMEOUT", "env_value", "parse_bool",
           "SLEEP_LEVELS", "WAKE_TAGS", "WEIGHT_KINDS"]

DEFAULT_BUCKET_SIZE = 256 * 1024 * 1024
DEFAULT_NUM_SLOTS = 2
DEFAULT_TIMEOUT = 300.0
_ROLES = (None, "trainer", "rollout")

#: Rollout lifecycle vocabulary shared by the manager and every replica: sleep levels
#: (1 offloads weights, 2 drops them), wake-up tags, and the kinds of weight set a sync moves.
SLEEP_LEVELS = (1, 2)
WAKE_TAGS = ("weights", "kv_cache")
WEIGHT_KINDS = ("full", "base", "adapter")


def env_value(name: str, cast, default):
    """``WEIGHTSYNC_<name>`` cast by ``cast``, or ``default`` when unset or empty; a value
    that does not parse is a ``ValueError`` naming the variable."""
    raw = os.environ.get("WEIGHTSYNC_" + name)
    if raw is None or raw == "":
        return default
    try:
        return cast(raw)
    except ValueError:
        raise ValueError(f"environment variable WEIGHTSYNC_{name}={raw!r} is not valid") from None


def parse_bool(raw: str) -> bool:
    """``1/true/yes/on`` or ``0/false/no/off`` (any case); anything else is a ``ValueError``."""
    low = raw.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise ValueError(raw)


def parse_auto_bool(raw: str) -> Optional[bool]:
    """``auto`` (None: the code decides), else as :func:`parse_bool`."""
    return None if raw.strip().lower() == "auto" else parse_bool(raw)


def _parse_device(raw: str) -> str:
    """A torch device string (``cpu``, ``cuda``, ``cuda:1``); anything else is a
    ``ValueError``."""
    try:
        return str(torch.device(raw.strip()))
    except (RuntimeError, TypeError):
        raise ValueError(raw) from None


def option(env: Optional[str], cast: Callable[[str], Any], default: Any, doc: str) -> Any:
    """A field of an options dataclass.

    Its default is ``WEIGHTSYNC_<env>`` parsed by ``cast`` when that variable is set and not
    empty, read when the dataclass is built; else ``default``. ``env=None`` is a field with no
    variable. ``doc`` is one short sentence; the docs' options tables are generated from it
    (see :func:`option_rows`).
    """
    meta = {"env": ("WEIGHTSYNC_" + env) if env else None, "doc": doc, "default": default}
    if env is None:
        return field(default=default, metadata=meta)
    return field(default_factory=lambda: env_value(env, cast, default), metadata=meta)


def option_rows(cls: type) -> list[tuple[str, str, Any, str]]:
    """``(field, env variable or "", default, doc)`` for each field of an options dataclass
    declared with :func:`option` (used to generate the docs' options tables)."""
    import dataclasses
    rows = []
    for f in dataclasses.fields(cls):
        meta = f.metadata or {}
        if "doc" not in meta:
            continue
        rows.append((f.name, meta.get("env") or "", meta.get("default"), meta["doc"]))
    return rows


def option_names(cls: Optional[type]) -> tuple[str, ...]:
    """The keyword arguments of an options dataclass (``()`` for ``None``)."""
    import dataclasses
    if cls is None:
        return ()
    return tuple(f.name for f in dataclasses.fields(cls) if f.init)


def build_options(cls: Optional[type], options: Any = None, given: Optional[dict] = None, *,
                  owner: str = "this backend") -> Any:
    """The options object an engine runs with.

    ``options``: an instance of ``cls`` (or ``None``); ``given``: keyword arguments named
    like ``cls``'s fields, which override it (a ``None`` value counts as not given). With
    neither, ``cls()``: every field from its ``WEIGHTSYNC_*`` variable or its default.
    ``cls=None`` (a backend without options) takes no options. ``ValueError`` for an
    ``options`` of another type.
    """
    import dataclasses
    given = {k: v for k, v in (given or {}).items() if v is not None}
    if cls is None:
        if options is not None or given:
            raise ValueError(f"{owner} takes no backend options, got "
                             f"{sorted(given) or type(options).__name__}")
        return None
    if options is None:
        return cls(**given)
    if not isinstance(options, cls):
        raise ValueError(f"options for {owner} must be a {cls.__name__}, got "
                         f"{type(options).__name__}")
    return dataclasses.replace(options, **given) if given else options


@dataclass(kw_only=True)
class EngineConfig:
    """Settings shared by every checkpoint engine.

    ``bucket_size``: bytes per bucket (a multiple of ``alignment``); ``timeout``: seconds any
    blocking step may wait for a peer; ``device``: where buffers and received tensors live;
    ``dtype``: optional cast of floating tensors on send (e.g. ``torch.bfloat16``);
    ``num_slots``: depth of the bucket ring (>= 2 gives overlap); ``checksum``: add a
    per-bucket checksum that receivers verify; ``role``: ``"trainer"`` or ``"rollout"``
    (engines that host a server need it at ``prepare()``); ``host``: interface that
    servers bind to and advertise (loopback by default).
    """

    bucket_size: int = option("BUCKET_SIZE", int, DEFAULT_BUCKET_SIZE,
                              "Bytes per bucket (a multiple of the alignment, 256 bytes).")
    timeout: float = option("TIMEOUT", float, DEFAULT_TIMEOUT,
                            "Seconds any blocking step may wait for a peer.")
    device: str = option("DEVICE", _parse_device, "cpu",
                         "Where buffers and received tensors live (cpu, cuda, cuda:1).")
    dtype: Optional[torch.dtype] = option(
        None, str, None, "Cast floating tensors to this dtype on send (e.g. torch.bfloat16).")
    num_slots: int = option("NUM_SLOTS", int, DEFAULT_NUM_SLOTS,
                            "Depth of the bucket ring, 1 to 64 (2 or more overlap copies).")
    checksum: bool = option("CHECKSUM", parse_bool, False,
                            "Add a per-bucket checksum that receivers verify.")
    role: Optional[str] = option(None, str, None, "\"trainer\" or \"rollout\".")
    host: str = option("HOST", str, "127.0.0.1",
                       "Interface that servers bind to and advertise.")
    alignment: int = DEFAULT_ALIGNMENT

    def __post_init__(self) -> None:
        if isinstance(self.bucket_size, bool) or not isinstance(self.bucket_size, int):
            raise ValueError(f"bucket_size must be an int, got {self.bucket_size!r}")
        if self.bucket_size < self.alignment or self.bucket_size % self.alignment:
            raise ValueError(
                f"bucket_size must be a positive multiple of {self.alignment} bytes, "
                f"got {self.bucket_size}")
        if not isinstance(self.timeout, (int, float)) or not self.timeout > 0:
            raise ValueError(f"timeout must be a positive number of seconds, got {self.timeout!r}")
        self.timeout = float(self.timeout)
        if isinstance(self.dtype, str):
            self.dtype = dtype_from_name(self.dtype.replace("torch.", ""))
        if self.dtype is not None and not (
                isinstance(self.dtype, torch.dtype) and self.dtype.is_floating_point):
            raise ValueError(f"dtype must be a floating torch.dtype or None, got {self.dtype!r}")
        if isinstance(self.num_slots, bool) or not isinstance(self.num_slots, int) \
                or not 1 <= self.num_slots <= 64:
            raise ValueError(f"num_slots must be an int in [1, 64], got {self.num_slots!r}")
        if self.role not in _ROLES:
            raise ValueError(f"role must be one of {_ROLES}, got {self.role!r}")
        try:
            self.device = str(torch.device(self.device))
        except (RuntimeError, TypeError):
            raise ValueError(f"device {self.device!r} is not a torch device") from None
        if not isinstance(self.host, str) or not self.host:
            raise ValueError(f"host must be a non-empty str, got {self.host!r}")
