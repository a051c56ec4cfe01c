"""The codec's options: keyword arguments, else ``WEIGHTSYNC_*`` environment, else defaults.

=====================  ==============================  ===================================
keyword                environment                     meaning
=====================  ==============================  ===================================
``delta``              ``WEIGHTSYNC_DELTA``            ``True`` / ``False`` / ``"auto"``
``quantize``           ``WEIGHTSYNC_QUANTIZE``         ``"fp8-block"`` / ``"fp8-tensor"`` /
                                                       ``None`` (``none`` / ``0`` in env)
``delta_max_bytes``    ``WEIGHTSYNC_DELTA_MAX_BYTES``  trainer: bound on the base copies it
                                                       keeps to diff (tensors past it go
                                                       dense); ``None``: no bound
``quantize_skip``      (none)                          name parts never quantized
=====================  ==============================  ===================================

``"auto"``: delta only over a transport that can cross hosts (``multi_host``: collective,
nixl), where the link may be slower than the diff; not over ``inproc`` (tensors pass by
reference), ``shm`` or ``cuda_ipc`` (same-host copies run at memory speed, as fast as the
diff reads the weights: BENCHMARKS.md). Per tensor, the diff is then skipped for
:data:`AUTO_BACKOFF` syncs after one that found the tensor too changed to pay.
The backend name gives the defaults (``delta+shm``: ``delta=True``); keywords and
environment override them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Union

from weightsync.core.config import env_value, parse_bool
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


@dataclass(frozen=True)
class CodecOptions:
    delta: Union[bool, str] = False
    quantize: Optional[str] = None
    delta_max_bytes: Optional[int] = None
    quantize_skip: tuple = DEFAULT_SKIP

    def __post_init__(self) -> None:
        object.__setattr__(self, "delta", parse_delta(self.delta))
        object.__setattr__(self, "quantize", parse_quantize(self.quantize))
        limit = self.delta_max_bytes
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int)
                                  or limit < 0):
            raise ValueError(f"delta_max_bytes must be an int >= 0 or None, got {limit!r}")
        object.__setattr__(self, "quantize_skip", tuple(self.quantize_skip))

    def as_dict(self) -> dict[str, Any]:
        return {"delta": self.delta, "quantize": self.quantize,
                "delta_max_bytes": self.delta_max_bytes}


def split_options(kwargs: dict[str, Any], *, delta: Any = False,
                  quantize: Optional[str] = None) -> tuple[CodecOptions, dict[str, Any]]:
    """``(codec options, the other keywords)``; ``delta``/``quantize``: the name's defaults."""
    rest = {k: v for k, v in kwargs.items() if k not in _KEYS}
    mine = {k: kwargs[k] for k in _KEYS if k in kwargs and kwargs[k] is not None}
    if "delta" not in mine:
        mine["delta"] = env_value("DELTA", parse_delta, delta)
    if "quantize" not in kwargs:   # an explicit quantize=None turns it off
        mine["quantize"] = env_value("QUANTIZE", parse_quantize, quantize)
    if "delta_max_bytes" not in mine:
        mine["delta_max_bytes"] = env_value("DELTA_MAX_BYTES", int, None)
    return CodecOptions(**mine), rest
