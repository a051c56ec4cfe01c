"""Typed, versioned control messages and their strict codec.

Messages are JSON objects ``{"wsv": 1, "kind": ..., ...}``. The decoder accepts nothing
else: unknown kinds or fields, wrong types, dtypes off the whitelist, negative sizes and
messages over the size limit all raise :class:`~weightsync.core.errors.WireError`. No message is
ever unpickled. Tensor bytes never travel in these messages, only their layout.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields
from typing import Any, ClassVar, Optional, Union

from weightsync.core.errors import WireError
from weightsync.core.plan import DTYPES, TensorMeta, itemsize

__all__ = [
    "DIRECT_SLOT", "DIRECT_BASE",
    "WIRE_VERSION",
    "MAX_MESSAGE_BYTES",
    "Message",
    "BucketMsg",
    "DoneMsg",
    "ErrorMsg",
    "NamesMsg",
    "AckMsg",
    "HelloMsg",
    "SourceMsg",
    "PullMsg",
    "StagedMsg",
    "PulledMsg",
    "WantsMsg",
    "LandMsg",
    "PUSHED_SLOT",
    "encode",
    "decode",
]

#: ``BucketMsg.slot`` of a tensor sent outside the buckets (a *direct* tensor)
DIRECT_SLOT = 1 << 20
#: ``BucketMsg.index`` of direct tensors starts here (acks name them by index)
DIRECT_BASE = 1 << 40


WIRE_VERSION = 1
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
_MAX_NAME = 4096
_MAX_DIMS = 64
_MAX_INT = 2**62
_ITEMSIZE = {name: itemsize(name) for name in DTYPES}

Version = Union[int, str, None]


@dataclass(frozen=True)
class Message:
    kind: ClassVar[str] = ""


@dataclass(frozen=True)
class BucketMsg(Message):
    """Bucket ``index`` of stream ``stream`` of sync ``seq`` is ready in ``slot``.

    ``entries`` is ``None`` when the receiver's cached layout of this bucket is still
    right (plan replay); otherwise it is the bucket's new layout.
    """

    kind: ClassVar[str] = "bucket"
    version: Version
    seq: int
    stream: int
    index: int
    slot: int
    nbytes: int
    layout: str
    entries: Optional[tuple[TensorMeta, ...]] = None
    checksum: Optional[int] = None
    #: a direct tensor whose storage the sender shared (torch shared memory): ``(fd, inode,
    #: storage nbytes, byte offset)`` for receivers that map it (``transport.peermem``)
    shared: Optional[tuple[int, int, int, int]] = None
    #: the bytes were ready when this was sent: no event of the sender's to wait for
    ready: bool = False


@dataclass(frozen=True)
class DoneMsg(Message):
    """Stream ``stream`` finished sync ``seq`` after ``num_buckets`` buckets."""

    kind: ClassVar[str] = "done"
    version: Version
    seq: int
    stream: int
    num_buckets: int
    num_tensors: int
    nbytes: int
    signature: str


@dataclass(frozen=True)
class ErrorMsg(Message):
    """The peer that wrote it failed; every other peer of the sync must stop."""

    kind: ClassVar[str] = "error"
    version: Version
    seq: int
    error: str
    message: str
    peer: str
    phase: str
    origin: Optional[str] = None  # where a relayed failure started (None: at ``peer``)


@dataclass(frozen=True)
class NamesMsg(Message):
    """Names a trainer rank yielded in sync ``seq`` (ownership agreement)."""

    kind: ClassVar[str] = "names"
    seq: int
    rank: int
    digest: str
    names: Optional[tuple[str, ...]] = None


@dataclass(frozen=True)
class AckMsg(Message):
    """Receiver ``rank`` is done with bucket ``index`` (or, if ``final``, the whole sync)."""

    kind: ClassVar[str] = "ack"
    seq: int
    stream: int
    rank: int
    index: int
    final: bool = False


@dataclass(frozen=True)
class HelloMsg(Message):
    """Set-up handshake: a sender describes its buffers, or a receiver says it attached.

    ``segments`` names shared-memory segments; ``handles`` carries device-memory
    descriptors (text, e.g. CUDA IPC handles in hex) for engines that map GPU buffers.
    """

    kind: ClassVar[str] = "hello"
    stream: int
    rank: int
    bucket_size: int
    num_slots: int
    segments: tuple[str, ...] = ()
    handles: tuple[str, ...] = ()


@dataclass(frozen=True)
class SourceMsg(Message):
    """What trainer rank ``stream`` serves to point-to-point pulls (``nixl``), sent when it
    changes: its agent (``metadata``: base64 of the NIXL agent metadata), the memory it
    registered (``regions``: ``[name, address, nbytes, device]``), and where each tensor's
    held elements live (``held``: ``[name, shape, dtype, start, stop, region, offset]``,
    elements ``[start, stop)`` of the row-major flattened tensor at byte ``offset``; an
    8th field ``box``, a ``[start, stop]`` per dim, says the rank holds that slice of the
    full tensor row-major from ``offset`` instead, ``[start, stop)`` then being
    ``[0, its element count)``)."""

    kind: ClassVar[str] = "source"
    seq: int
    stream: int
    agent: str
    metadata: str
    mem: str
    digest: str
    regions: tuple[tuple[str, int, int, int], ...] = ()
    held: tuple[tuple, ...] = ()


@dataclass(frozen=True)
class PullMsg(Message):
    """Trainer rank ``stream`` serves ``version`` (sync ``seq``) from the layout ``digest``:
    receivers pull it now (the one message per sync once the plan is compiled). ``staged``
    False: the rank is still writing its staging blocks; a :class:`StagedMsg` names each
    block once it holds this version (reads of it may start then)."""

    kind: ClassVar[str] = "pull"
    version: Version
    seq: int
    stream: int
    digest: str
    staged: bool = True


@dataclass(frozen=True)
class StagedMsg(Message):
    """Trainer rank ``stream``'s staging ``blocks`` (region names of its layout) now hold
    sync ``seq``'s bytes (after a :class:`PullMsg` with ``staged=False``)."""

    kind: ClassVar[str] = "staged"
    seq: int
    stream: int
    blocks: tuple[str, ...] = ()


@dataclass(frozen=True)
class PulledMsg(Message):
    """Receiver ``rank`` has read every byte of sync ``seq`` it needs from ``stream``
    (``nbytes``), on the plan whose digest is ``plan``: the trainer may reuse its memory."""

    kind: ClassVar[str] = "pulled"
    seq: int
    stream: int
    rank: int
    nbytes: int
    plan: str


@dataclass(frozen=True)
class WantsMsg(Message):
    """Receiver ``rank`` keeps only some boxes of these tensors (a tensor-parallel worker;
    none: ``[]``): ``wants`` holds ``[name, [box, ...]]``, a box a ``[start, stop]`` per dim
    of the full tensor. Sent to every trainer rank when it changes (empty: every tensor whole again),
    so they may stage such a tensor box by box and each box is one read."""

    kind: ClassVar[str] = "wants"
    rank: int
    wants: tuple[tuple[str, tuple[tuple[tuple[int, int], ...], ...]], ...] = ()


@dataclass(frozen=True)
class LandMsg(Message):
    """Rollout rank ``rank`` receives sync ``seq`` now, and these of its own tensors live
    in shared memory the trainer may write straight into during that sync: ``landings``
    holds ``[name, shape, dtype, fd, inode, storage nbytes, byte offset]`` (``fd`` one of
    the receiver's descriptors; ``transport.peermem``), or is ``None`` when they are those
    of the receiver's last message (same ``digest``). Sent to every trainer rank at the
    start of every receive, so a trainer never writes into memory in use by an engine."""

    kind: ClassVar[str] = "land"
    seq: int
    rank: int
    digest: str
    landings: Optional[tuple[tuple[str, tuple[int, ...], str, int, int, int, int], ...]] = None


#: ``BucketMsg.slot`` of tensors the trainer wrote straight into a receiver's memory
#: (its ``LandMsg``): the message lists them, the bytes are already there
PUSHED_SLOT = (1 << 20) + 1

_KINDS: dict[str, type[Message]] = {
    c.kind: c for c in (BucketMsg, DoneMsg, ErrorMsg, NamesMsg, AckMsg, HelloMsg, SourceMsg,
                        PullMsg, StagedMsg, PulledMsg, WantsMsg, LandMsg)}
_OPTIONAL = {"entries": None, "checksum": None, "names": None, "final": False,
             "segments": (), "handles": (), "origin": None, "staged": True, "blocks": (),
             "wants": (), "shared": None, "landings": None, "ready": False}
_ERROR_NAMES = {
    "WeightSyncError", "SyncTimeout", "PeerFailed", "PlanMismatch", "VersionMismatch",
    "WireError", "IntegrityError", "BackendUnavailable", "TopologyError", "AuthenticationError",
}


def encode(msg: Message) -> bytes:
    """Serialize a message to JSON bytes."""
    body: dict[str, Any] = {"wsv": WIRE_VERSION, "kind": msg.kind}
    for f in fields(msg):
        value = getattr(msg, f.name)
        if f.name == "entries" and value is not None:
            value = [e.to_list() for e in value]
        elif f.name == "wants":
            value = [[n, [[list(p) for p in box] for box in boxes]] for n, boxes in value]
        elif isinstance(value, tuple):
            value = list(value)
        body[f.name] = value
    data = json.dumps(body, separators=(",", ":")).encode()
    if len(data) > MAX_MESSAGE_BYTES:
        raise WireError(f"message of {len(data)} bytes exceeds {MAX_MESSAGE_BYTES}")
    return data


def _fail(why: str) -> None:
    raise WireError(f"bad control message: {why}")


def _int(v: Any, what: str, lo: int = 0) -> int:
    if type(v) is not int or not lo <= v <= _MAX_INT:
        _fail(f"{what} must be an int >= {lo}, got {type(v).__name__}")
    return v


def _str(v: Any, what: str, limit: int = _MAX_NAME) -> str:
    if type(v) is not str or len(v) > limit:
        _fail(f"{what} must be a str of at most {limit} chars")
    return v


def _version(v: Any) -> Version:
    if v is None or type(v) is int:
        return v
    return _str(v, "version", 256)


def _meta(item: Any) -> TensorMeta:
    if type(item) is not list or len(item) != 7:
        _fail("tensor entry must be a list of 7 fields")
    name, shape, dtype, offset, nbytes, chunk_offset, total = item
    _str(name, "tensor name")
    if type(shape) is not list or len(shape) > _MAX_DIMS:
        _fail(f"shape of {name!r} must be a list of at most {_MAX_DIMS} ints")
    for d in shape:
        _int(d, "shape dim")
    if dtype not in DTYPES:
        _fail(f"dtype {dtype!r} of {name!r} is not on the whitelist")
    for v, what in ((offset, "offset"), (nbytes, "nbytes"), (chunk_offset, "chunk_offset"),
                    (total, "total_nbytes")):
        _int(v, what)
    if chunk_offset + nbytes > total:
        _fail(f"chunk of {name!r} runs past the tensor end")
    if total != math.prod(shape) * _ITEMSIZE[dtype]:
        _fail(f"total_nbytes of {name!r} does not match its shape and dtype")
    return TensorMeta(name, tuple(shape), dtype, offset, nbytes, chunk_offset, total)


def _regions(v: Any) -> tuple:
    if type(v) is not list or len(v) > 65536:
        _fail("regions must be a list of at most 65536 entries")
    out = []
    for item in v:
        if type(item) is not list or len(item) != 4:
            _fail("a region must be [name, address, nbytes, device]")
        out.append((_str(item[0], "region name", 255), _int(item[1], "region address"),
                    _int(item[2], "region nbytes"), _int(item[3], "region device")))
    return tuple(out)


def _tensor_spec(name: Any, shape: Any, dtype: Any) -> tuple[int, ...]:
    """Check a tensor's name, shape (a list of ints) and dtype (whitelisted); its dims."""
    _str(name, "tensor name")
    if type(shape) is not list or len(shape) > _MAX_DIMS:
        _fail(f"shape of {name!r} must be a list of at most {_MAX_DIMS} ints")
    dims = tuple(_int(d, "shape dim") for d in shape)
    if dtype not in DTYPES:
        _fail(f"dtype {dtype!r} of {name!r} is not on the whitelist")
    return dims


def _held(v: Any) -> tuple:
    if type(v) is not list or len(v) > 1 << 20:
        _fail("held must be a list of at most 2**20 entries")
    out = []
    for item in v:
        if type(item) is not list or len(item) not in (7, 8):
            _fail("a held entry must be [name, shape, dtype, start, stop, region, offset] "
                  "and optionally a box")
        name, shape, dtype, start, stop, region, offset, *box = item
        dims = _tensor_spec(name, shape, dtype)
        if not _int(start, "start") <= _int(stop, "stop") <= math.prod(dims):
            _fail(f"held elements of {name!r} run outside its shape")
        entry = (name, dims, dtype, start, stop, _str(region, "region", 255),
                 _int(offset, "offset"))
        if box:
            box = box[0]
            if type(box) is not list or len(box) != len(dims) or not all(
                    type(p) is list and len(p) == 2 for p in box):
                _fail(f"the box of {name!r} must hold a [start, stop] pair per dim")
            pairs = tuple((_int(a, "box start"), _int(b, "box stop")) for a, b in box)
            if any(not 0 <= a <= b <= n for (a, b), n in zip(pairs, dims)) or \
                    stop - start != math.prod(b - a for a, b in pairs):
                _fail(f"the box of {name!r} runs outside its shape or disagrees with its size")
            entry += (pairs,)
        out.append(entry)
    return tuple(out)


def _wants(v: Any) -> tuple:
    if type(v) is not list or len(v) > 1 << 20:
        _fail("wants must be a list of at most 2**20 entries")
    out = []
    for item in v:
        if type(item) is not list or len(item) != 2 or type(item[1]) is not list \
                or len(item[1]) > 4096:
            _fail("a wants entry must be [name, [box, ...]] with at most 4096 boxes")
        name = _str(item[0], "tensor name")
        if not name:
            _fail("a wants entry names no tensor")
        boxes = []
        for box in item[1]:
            if type(box) is not list or len(box) > _MAX_DIMS or not all(
                    type(p) is list and len(p) == 2 for p in box):
                _fail(f"a box of {name!r} must hold a [start, stop] pair per dim")
            pairs = tuple((_int(a, "box start"), _int(b, "box stop")) for a, b in box)
            if any(a > b for a, b in pairs) or len({len(pairs)} | {len(b) for b in boxes}) > 1:
                _fail(f"the boxes of {name!r} run backwards or differ in rank")
            boxes.append(pairs)
        out.append((name, tuple(boxes)))
    return tuple(out)


def _landings(v: Any) -> tuple:
    if type(v) is not list or len(v) > 1 << 20:
        _fail("landings must be a list of at most 2**20 entries")
    out = []
    for item in v:
        if type(item) is not list or len(item) != 7:
            _fail("a landing must be [name, shape, dtype, fd, inode, storage nbytes, offset]")
        name, shape, dtype, *ref = item
        dims = _tensor_spec(name, shape, dtype)
        fd, inode, size, offset = (_int(x, "landing") for x in ref)
        if offset + math.prod(dims) * _ITEMSIZE[dtype] > size:
            _fail(f"the landing of {name!r} runs past its storage")
        out.append((name, dims, dtype, fd, inode, size, offset))
    return tuple(out)


def _check_field(cls: type[Message], name: str, v: Any) -> Any:
    if name == "version":
        return _version(v)
    if name in ("seq", "stream", "index", "slot", "nbytes", "num_buckets", "num_tensors",
                "rank", "bucket_size", "num_slots"):
        return _int(v, name)
    if name == "checksum":
        return None if v is None else _int(v, name)
    if name == "shared":
        if v is None:
            return None
        if type(v) is not list or len(v) != 4:
            _fail("shared must be [fd, inode, storage nbytes, offset] or null")
        return tuple(_int(x, "shared") for x in v)
    if name == "entries":
        if v is None:
            return None
        if type(v) is not list:
            _fail("entries must be a list or null")
        return tuple(_meta(item) for item in v)
    if name in ("final", "staged", "ready"):
        if type(v) is not bool:
            _fail(f"{name} must be a bool")
        return v
    if name == "blocks":
        if type(v) is not list or len(v) > 65536:
            _fail("blocks must be a list of at most 65536 region names")
        if not all(type(n) is str and n for n in v):
            _fail("blocks must be non-empty region names")
        return tuple(_str(n, "block", 255) for n in v)
    if name == "segments":
        if type(v) is not list or len(v) > 1024:
            _fail("segments must be a list of at most 1024 names")
        return tuple(_str(n, "segment", 255) for n in v)
    if name == "handles":
        if type(v) is not list or len(v) > 1024:
            _fail("handles must be a list of at most 1024 descriptors")
        return tuple(_str(n, "handle", 32768) for n in v)
    if name == "metadata":
        return _str(v, name, 1 << 20)
    if name == "mem":
        if v not in ("DRAM", "VRAM"):
            _fail(f"mem must be DRAM or VRAM, got {v!r}")
        return v
    if name == "regions":
        return _regions(v)
    if name == "held":
        return _held(v)
    if name == "wants":
        return _wants(v)
    if name == "landings":
        return None if v is None else _landings(v)
    if name == "names":
        if v is None:
            return None
        if type(v) is not list:
            _fail("names must be a list or null")
        return tuple(_str(n, "name") for n in v)
    if name == "error":
        if type(v) is not str or v not in _ERROR_NAMES:   # a list/dict is unhashable
            _fail(f"unknown error type {v!r}")
        return v
    if name == "message":
        return _str(v, name, 65536)
    if name == "origin":
        return None if v is None else _str(v, name, 1024)
    return _str(v, name, 1024)


def decode(data: bytes | bytearray | memoryview | str, *, max_bytes: int = MAX_MESSAGE_BYTES) -> Message:
    """Parse and validate one control message; anything off raises ``WireError``."""
    if isinstance(data, str):
        data = data.encode("utf-8", "surrogatepass")
    if not isinstance(data, (bytes, bytearray, memoryview)):
        _fail(f"expected bytes, got {type(data).__name__}")
    if len(data) > max_bytes:
        _fail(f"{len(data)} bytes exceeds the limit of {max_bytes}")
    try:
        body = json.loads(bytes(data))
    except (ValueError, RecursionError) as exc:
        raise WireError(f"bad control message: not JSON ({type(exc).__name__})") from None
    if type(body) is not dict:
        _fail("top level must be an object")
    if body.get("wsv") != WIRE_VERSION:
        _fail(f"wire version {body.get('wsv')!r} is not {WIRE_VERSION}")
    cls = _KINDS.get(body.get("kind")) if type(body.get("kind")) is str else None
    if cls is None:
        _fail(f"unknown kind {body.get('kind')!r}")
    names = {f.name for f in fields(cls)}
    extra = set(body) - names - {"wsv", "kind"}
    if extra:
        _fail(f"unknown fields {sorted(extra)[:5]} for kind {cls.kind!r}")
    kwargs = {}
    for f in fields(cls):
        if f.name not in body:
            if f.name in _OPTIONAL:
                kwargs[f.name] = _OPTIONAL[f.name]
                continue
            _fail(f"missing field {f.name!r} for kind {cls.kind!r}")
        kwargs[f.name] = _check_field(cls, f.name, body[f.name])
    return cls(**kwargs)


def as_dict(msg: Message) -> dict[str, Any]:
    """Plain dict view (for logs and tests)."""
    return {"kind": msg.kind, **asdict(msg)}
