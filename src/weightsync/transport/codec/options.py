"""The codec's options (:class:`CodecOptions`): keyword arguments, else ``WEIGHTSYNC_*``
environment, else the backend name's defaults.

``"auto"`` delta: only over a transport that can cross hosts (``multi_host``: collective,
nixl), where the link may be slower than the diff; not over ``inproc`` (tensors pass by
reference), ``shm`` or ``cuda_ipc`` (same-host copies run at memory speed, as fast as the
diff reads the weights). Per tensor, the diff is then skipped for :data:`AUTO_BACKOFF`
syncs after one that found the tensor too changed to pay. The backend name gives the
defaults (``delta+shm``: ``delta=True``); keywords and environment override them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional, Union

from weightsync.core.config import env_value, option, parse_bool
from weightsync.transport.codec.fp8 import DEFAULT_SKIP, SCHEMES

__all__ = ["CodecOptions", "split_options", "parse_delta", "parse_quantize", "AUTO_BACKOFF"]

AUTO_BACKOFF = 3
_KEYS = ("delta", "quantize", "delta_max_bytes", "quantize_skip")


def parse_delta(value: Any) -> Union[bool, str]:
    if isinstance(value, str):
        low = value.strip().lower()
        if low == "auto":
            return "auto"
        try:
            return parse_bool(low)
        except ValueError:
            raise ValueError(f"delta must be True, False or 'auto', got {value!r}") from None
    if isinstance(value, bool):
        return value
    raise ValueError(f"delta must be True, False or 'auto', got {value!r}")


def parse_quantize(value: Any) -> Optional[str]:
    if value is None:
        return None
    if isinstance(value, str):
        low = value.strip().lower()
        if low in ("", "none", "0", "off", "false", "no"):
            return None
        if low in SCHEMES:
            return low
    raise ValueError(f"quantize must be one of {SCHEMES} or None, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class CodecOptions:
    """Options of the codec layer (``delta+<backend>``, ``fp8+<backend>``, or a plain
    backend given ``delta=`` / ``quantize=``).

    Keyword arguments of the engine, of :func:`~weightsync.connect` and of the manager, or
    one object (``options=CodecOptions(...)``, taken as given: its ``delta`` and
    ``quantize`` replace the name's defaults). A field left out comes from its
    ``WEIGHTSYNC_*`` variable, read when the options are built, else from its default;
    built by an engine, the default is the backend name's (``delta+shm``: ``delta=True``).
    """

    delta: Union[bool, str] = option(
        "DELTA", parse_delta, False,
        "Send only what changed since the last sync: True, False or \"auto\" (only over "
        "transports that cross hosts, collective and nixl).")
    quantize: Optional[str] = option(
        "QUANTIZE", parse_quantize, None,
        "Quantize weights on the fly: \"fp8-block\", \"fp8-tensor\" or None (\"none\" in "
        "the environment).")
    delta_max_bytes: Optional[int] = option(
        "DELTA_MAX_BYTES", int, None,
        "Trainer: at most this many bytes of base copies kept to diff against (tensors past "
        "it go dense); None: no bound.")
    quantize_skip: tuple = option(
        None, tuple, DEFAULT_SKIP, "Name parts of tensors that are never quantized.")

    def __post_init__(self) -> None:
        object.__setattr__(self, "delta", parse_delta(self.delta))
        object.__setattr__(self, "quantize", parse_quantize(self.quantize))
        limit = self.delta_max_bytes
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int)
                                  or limit < 0):
            raise ValueError(f"delta_max_bytes must be an int >= 0 or None, got {limit!r}")
        skip = self.quantize_skip
        if isinstance(skip, str) or not all(isinstance(x, str) for x in skip):
            raise ValueError(f"quantize_skip must be a sequence of str, got {skip!r}")
        object.__setattr__(self, "quantize_skip", tuple(skip))

    def as_dict(self) -> dict[str, Any]:
        return {"delta": self.delta, "quantize": self.quantize,
                "delta_max_bytes": self.delta_max_bytes}


def split_options(kwargs: dict[str, Any], *, delta: Any = False,
                  quantize: Optional[str] = None) -> tuple[CodecOptions, dict[str, Any]]:
    """``(codec options, the other keywords)`` of an engine's keyword arguments.

    ``delta`` / ``quantize``: the backend name's defaults, used where neither a keyword nor
    the environment gives one. ``kwargs["options"]`` may hold a :class:`CodecOptions`
    (taken as given, keywords override it), another options object or a list of them
    (left in the other keywords for the inner engine)."""
    rest = {k: v for k, v in kwargs.items() if k not in _KEYS}
    given = {k: kwargs[k] for k in _KEYS if k in kwargs and kwargs[k] is not None}
    if "quantize" in kwargs:      # an explicit quantize=None turns it off
        given["quantize"] = kwargs["quantize"]
    objects = rest.pop("options", None)
    objects = list(objects) if isinstance(objects, (list, tuple)) else \
        ([] if objects is None else [objects])
    mine = [o for o in objects if isinstance(o, CodecOptions)]
    others = [o for o in objects if not isinstance(o, CodecOptions)]
    if len(mine) > 1:
        raise ValueError("options holds more than one CodecOptions")
    if others:
        rest["options"] = others[0] if len(others) == 1 else others
    if mine:
        return (dataclasses.replace(mine[0], **given) if given else mine[0]), rest
    if "delta" not in given:
        given["delta"] = env_value("DELTA", parse_delta, delta)
    if "quantize" not in given:
        given["quantize"] = env_value("QUANTIZE", parse_quantize, quantize)
    return CodecOptions(**given), rest
