"""``CodecEngine``: delta updates and FP8 on the fly as a layer above any transport.

A codec engine wraps an engine of another backend (``inner``) and keeps its contract:
the trainer's tensors are encoded into plain tensors that the inner engine moves as it
moves any (delta records are ``uint8`` tensors under the tensor's own name, FP8 weights
are float8_e4m3fn tensors plus their scales), and the receiver decodes them, applying
deltas in place. Nothing in the inner transports knows: ``inproc``, ``shm``,
``collective``, ``cuda_ipc`` and ``nixl`` all work, registered as ``delta+<backend>``,
``fp8+<backend>`` and ``delta+fp8+<backend>`` (:func:`register_wrapped`).

Lifecycle: ``prepare`` returns ``{"inner": the inner's metadata, "codec": ...}`` (trainers
start the codec's control store, :mod:`~weightsync.transport.codec.control`);
``build_topology`` runs the inner's and adds one key, ``codec_group``, to each side;
``init_process_group`` joins both; ``finalize`` releases the inner engine and the store,
but keeps the codec state (bases, held ids: they describe the model, not the group), so
the same engine re-joined to a new group goes on with deltas; :meth:`adopt_codec_state`
moves that state into a new engine, :meth:`drop_codec_state` frees it.

The inner engine's buckets are capped at :data:`DELTA_BUCKET` (a receiver applies one
bucket of records while the trainer encodes the next).

The sync itself: :mod:`~weightsync.transport.codec.sender` and
:mod:`~weightsync.transport.codec.receiver`; what each side keeps:
:mod:`~weightsync.transport.codec.state`.
"""

from __future__ import annotations

import asyncio
import secrets
from typing import Any, ClassVar, Optional

from weightsync.core.errors import BackendUnavailable, TopologyError
from weightsync.transport.base import CheckpointEngine, check_topology
from weightsync.transport.codec.control import CodecLink
from weightsync.transport.codec.fp8 import Quantizer
from weightsync.core.config import env_value, option_names
from weightsync.transport.codec.options import (CodecOptions, parse_delta, parse_quantize,
                                                split_options)
from weightsync.transport.codec.receiver import CodecReceiver
from weightsync.transport.codec.sender import CodecSender
from weightsync.transport.codec.state import ReceiverBases, SenderBases
from weightsync.transport.control.server import ControlClient
from weightsync.transport.control.store import (DRAIN_S, close_store, connect_store, host_store,
                                                new_token)
from weightsync.transport.protocol.receiver import patience
from weightsync.transport.protocol.sender import Worker
from weightsync.transport.registry import CheckpointEngineRegistry

__all__ = ["CodecEngine", "register_wrapped", "PREFIXES", "codec_backend_name",
           "resolve_backend", "split_backend_name", "codec_options", "carry_codec_state"]

#: name prefix -> (delta, quantize) defaults of the engines registered under it.
PREFIXES = {"delta": (True, None), "fp8": (False, "fp8-block"), "delta+fp8": (True, "fp8-block")}
_WRAPPED: dict[str, type] = {}
#: The inner engine's buckets are at most this big (a receiver applies one bucket of
#: records while the trainer encodes the next; more buckets cost the transports' per-bucket
#: handoffs, which on one GPU outweigh that overlap).
DELTA_BUCKET = 256 << 20


class CodecEngine(CodecSender, CodecReceiver, CheckpointEngine):
    """An engine of ``inner_cls`` with the codec on top (see the module doc)."""

    inner_cls: ClassVar[type] = CheckpointEngine
    default_delta: ClassVar[Any] = True
    default_quantize: ClassVar[Optional[str]] = None
    options_cls = CodecOptions
    options: CodecOptions

    def __init__(self, **kwargs: Any) -> None:
        """Keywords: :class:`~weightsync.core.config.EngineConfig`'s, :class:`CodecOptions`'
        and the inner backend's options (its ``options_cls`` fields); ``options=`` takes a
        :class:`CodecOptions`, the inner backend's options object, or a list of both."""
        opts, rest = split_options(kwargs, delta=self.default_delta,
                                   quantize=self.default_quantize)
        inner_names = set(option_names(self.inner_cls.options_cls)) | {"options"}
        inner_opts = {k: rest.pop(k) for k in list(rest) if k in inner_names}
        super().__init__(options=opts, **rest)
        networked = "multi_host" in self.inner_cls.capabilities
        self._delta_on = bool(opts.delta) and (opts.delta != "auto" or networked)
        inner_kw = {k: v for k, v in rest.items() if k != "dtype"}   # the codec casts
        # capped: receivers start on records sooner (every codec engine caps alike,
        # whatever its own delta option, so both sides' buckets agree)
        inner_kw["bucket_size"] = min(self.config.bucket_size, DELTA_BUCKET)
        self.inner = self.inner_cls(**inner_kw, **inner_opts)
        self._quantizer = Quantizer(opts.quantize, skip=opts.quantize_skip) \
            if opts.quantize else None
        self.bases = SenderBases(limit=opts.delta_max_bytes, auto=opts.delta == "auto")
        self.rx = ReceiverBases(keep=self._delta_on)
        self.last_receive: dict[str, Any] = {}
        self._server: Optional[ControlClient] = None
        self._auth = ""
        self._link: Optional[CodecLink] = None
        self._group: dict[str, Any] = {}
        self._seq = 0
        self._done_seq = 0         # the last sync this trainer completed (see finalize)

    # -- lifecycle ------------------------------------------------------------------------
    def prepare(self) -> dict[str, Any]:
        codec: dict[str, Any] = {"delta": self._delta_on, "quantize": self.options.quantize}
        if self.config.role == "trainer":
            if self._server is None:
                self._auth = new_token()
                self._server = host_store(self.config.host, self.config.timeout, self._auth)
            codec["store"] = [self.config.host, self._server.port, self._auth]
        return {"inner": self.inner.prepare(), "codec": codec}

    @classmethod
    def build_topology(cls, trainer_world_size: int, rollout_world_size: int,
                       metadata: list[dict[str, Any]]):
        name = cls.backend_name or cls.__name__
        check_topology(name, trainer_world_size, rollout_world_size, metadata)
        for i, meta in enumerate(metadata):
            if not (isinstance(meta, dict) and isinstance(meta.get("inner"), dict)
                    and isinstance(meta.get("codec"), dict)):
                raise TopologyError(f"{name}: worker {i} is not a codec engine; every worker "
                                    f"must use backend {name!r}", phase="build_topology")
        store = metadata[0]["codec"].get("store")
        if not (isinstance(store, list) and len(store) == 3):
            raise TopologyError(f"{name}: trainer rank 0 hosts no codec store; construct "
                                "trainer engines with role='trainer'", peer="trainer rank 0",
                                phase="build_topology")
        tk, rk = cls.inner_cls.build_topology(trainer_world_size, rollout_world_size,
                                              [m["inner"] for m in metadata])
        if not (isinstance(tk, dict) and isinstance(rk, dict)):
            raise TopologyError(f"{name}: the inner backend's topology is not a dict of "
                                "lists", phase="build_topology")
        common = {"store": store, "token": secrets.token_hex(16), "world": trainer_world_size,
                  "receivers": rollout_world_size}
        tk = dict(tk, codec_group=[dict(common, role="trainer", rank=i)
                                   for i in range(trainer_world_size)])
        rk = dict(rk, codec_group=[dict(common, role="rollout", rank=j)
                                   for j in range(rollout_world_size)])
        return tk, rk

    def init_process_group(self, **kwargs: Any) -> None:
        group = kwargs.pop("codec_group", None)
        if not isinstance(group, dict) or group.get("role") not in ("trainer", "rollout"):
            raise TopologyError(f"{self.backend_name}: no codec_group in the topology (built "
                                "by a backend without the codec?)", phase="init")
        self._leave()
        self.inner.init_process_group(**kwargs)
        role, rank = group["role"], int(group["rank"])
        if role == "trainer" and rank == 0:
            if self._server is None:
                raise TopologyError("init_process_group before prepare() on a trainer",
                                    phase="init")
            client = self._server
        else:
            host, port, auth = group["store"]
            client = connect_store(str(host), int(port), str(auth), self.config.timeout,
                                   peer="trainer rank 0", phase="init")
        self._link = CodecLink(client, token=str(group["token"]), role=role, rank=rank,
                               world=int(group["world"]), receivers=int(group["receivers"]))
        self.config.role = role
        self._group = group
        self._seq = self._done_seq = 0

    def _leave(self) -> None:
        if self._link is not None:
            self._link.close(owner=self._server)
            self._link = None
        self._group = {}

    def finalize(self) -> None:
        if self._link is not None and self._link.hosts and self._done_seq:
            # this process hosts the codec store: the others finish their last reads first
            self._link.drain(self._done_seq, min(self.config.timeout, DRAIN_S))
        try:
            self.inner.finalize()
        finally:
            self._leave()
            close_store(self._server)
            self._server = None
            self._stop_worker()

    def reset_plan(self) -> None:
        self.inner.reset_plan()

    # -- codec state ----------------------------------------------------------------------
    def adopt_codec_state(self, old: "CodecEngine") -> None:
        """Take ``old``'s bases and held ids (e.g. a new engine for a rebuilt group, in the
        same process, for the same model), so deltas go on where ``old`` left off."""
        if not isinstance(old, CodecEngine):
            raise TypeError(f"expected a CodecEngine, got {type(old).__name__}")
        self.bases, self.rx = old.bases, old.rx
        self.rx.keep = self._delta_on
        old.bases = SenderBases(limit=old.options.delta_max_bytes, auto=old.bases.auto)
        old.rx = ReceiverBases(keep=old._delta_on)

    def drop_codec_state(self) -> None:
        """Free the base copies; the next sync is dense."""
        self.bases.clear()
        self.rx.clear()

    def codec_memory(self) -> dict[str, int]:
        """Bytes this engine keeps between syncs: trainer bases, receiver base store."""
        return {"trainer_base_bytes": self.bases.nbytes, "receiver_store_bytes": self.rx.nbytes}

    # -- helpers for the two halves ------------------------------------------------------
    def _ready(self, role: str) -> None:
        if self._link is None or self.config.role != role:
            what = "send_weights" if role == "trainer" else "receive_weights"
            raise RuntimeError(f"{self.backend_name}: {what} needs a {role} engine after "
                               "init_process_group")

    async def _gather(self, seq: int, what: str, side: str, version: Any) -> list[dict]:
        t = self.config.timeout if self.config.role == "trainer" else patience(self.config.timeout)
        return await self._offload(self._link.gather, seq, what, side, t, version)

    async def _offload(self, fn: Any, *args: Any) -> Any:
        """Run ``fn`` (a bounded wait on peers, or an encode) off the caller's loop, in this
        engine's own thread (one step of a sync at a time): never in the loop's default
        executor, which the caller and the other engines on its loop may need."""
        worker = self.__dict__.get("_codec_worker")
        if worker is None:
            worker = self._codec_worker = Worker(f"weightsync-codec-{self.config.role}")
        return await asyncio.wrap_future(worker.submit(fn, *args))

    def _stop_worker(self) -> None:
        worker = self.__dict__.pop("_codec_worker", None)
        if worker is not None:
            worker.close(patience(self.config.timeout) + 5)


def codec_backend_name(backend: str, *, delta: Any = False, quantize: Optional[str] = None) -> str:
    """The registered name for ``backend`` with these options (``"shm"``, ``delta=True`` ->
    ``"delta+shm"``); ``backend`` itself when neither is on. ``"fp8-tensor"`` and
    ``delta="auto"`` are engine keywords on top of the name."""
    prefix = "+".join(p for p, on in (("delta", bool(delta)), ("fp8", bool(quantize))) if on)
    return f"{prefix}+{backend}" if prefix else backend


def carry_codec_state(old: Any, new: Any) -> bool:
    """When a worker replaces its engine (a rebuilt group) by one of the same codec
    backend, ``new`` takes ``old``'s bases and held ids, so deltas go on instead of one
    dense sync per rebuild (receivers still check every base by digest). True if taken."""
    if (isinstance(old, CodecEngine) and isinstance(new, CodecEngine)
            and type(old) is type(new) and old.config.role == new.config.role):
        new.adopt_codec_state(old)
        return True
    return False


def codec_options(engine_cls: type, kwargs: dict[str, Any]) -> Optional[CodecOptions]:
    """The options an engine of ``engine_cls`` built with ``kwargs`` will run with (the
    environment read now, as the engine reads it); ``None`` for a plain transport."""
    if not (isinstance(engine_cls, type) and issubclass(engine_cls, CodecEngine)):
        return None
    return split_options(dict(kwargs), delta=engine_cls.default_delta,
                         quantize=engine_cls.default_quantize)[0]


def split_backend_name(name: str) -> tuple[str, str]:
    """``(codec prefix or "", inner backend)`` of a registered name (``"delta+fp8+shm"`` ->
    ``("delta+fp8", "shm")``)."""
    for prefix in sorted(PREFIXES, key=len, reverse=True):
        if name.startswith(prefix + "+"):
            return prefix, name[len(prefix) + 1:]
    return "", name


def resolve_backend(backend: str, *, delta: Any = None, quantize: Any = "unset",
                    options: Any = None) -> tuple[str, dict[str, Any]]:
    """The backend name an entry point should build, and the codec keywords to give it.

    ``delta`` / ``quantize`` as the caller gave them (``None`` / ``"unset"``: not given,
    then those of a :class:`CodecOptions` in ``options`` (the engine's ``options=``), then
    ``WEIGHTSYNC_DELTA`` / ``WEIGHTSYNC_QUANTIZE``, read now). A plain transport name
    with delta or FP8 asked for becomes its codec name (``"shm"`` + ``delta=True`` ->
    ``"delta+shm"``); a codec name stays, with the given options as its keywords (they
    override the name's defaults). ``ValueError`` for a bad value."""
    objects = options if isinstance(options, (list, tuple)) else [options]
    codec = next((o for o in objects if isinstance(o, CodecOptions)), None)
    if codec is not None:
        delta = codec.delta if delta is None else delta
        quantize = codec.quantize if quantize == "unset" else quantize
    given: dict[str, Any] = {}
    if delta is not None:
        given["delta"] = parse_delta(delta)
    if quantize != "unset":
        given["quantize"] = parse_quantize(quantize)
    if split_backend_name(backend)[0]:
        return backend, given
    d = given.get("delta", env_value("DELTA", parse_delta, False))
    q = given["quantize"] if "quantize" in given else env_value("QUANTIZE", parse_quantize, None)
    if not d and not q:
        return backend, {}
    return codec_backend_name(backend, delta=d, quantize=q), {"delta": d, "quantize": q}


def register_wrapped(inner_name: str) -> list[str]:
    """Register ``delta+``, ``fp8+`` and ``delta+fp8+`` of ``inner_name``; the names.
    ``ImportError`` if the inner backend cannot be loaded (the registry keeps it)."""
    try:
        inner = CheckpointEngineRegistry.get(inner_name)
    except BackendUnavailable as exc:
        raise ImportError(str(exc)) from exc
    names = []
    for prefix, (d, q) in PREFIXES.items():
        name = f"{prefix}+{inner_name}"
        if name not in _WRAPPED:
            attrs = {"inner_cls": inner, "default_delta": d, "default_quantize": q,
                     # "codec": a layer over a transport; "lossy": FP8 changes the values
                     # and adds scale tensors (bit-exact checks compare with the quantizer)
                     "capabilities": (frozenset(inner.capabilities) - {"shards"})
                     | {"codec"} | ({"lossy"} if q else set()),
                     "__module__": __name__,
                     "__doc__": f"``{name}``: {inner_name} with the codec (delta={d}, "
                                f"quantize={q})."}
            cls = type(f"CodecEngine[{name}]", (CodecEngine,), attrs)
            _WRAPPED[name] = CheckpointEngineRegistry.register(name)(cls)
        names.append(name)
    return names
