"""The checkpoint-engine contract.

Lifecycle, the same on both sides (trainer workers send, rollout workers receive)::

    engine = CheckpointEngineRegistry.new(name, bucket_size=..., timeout=..., role=...)
    meta = engine.prepare()                     # every worker; returns a small dict
    trainer_kw, rollout_kw = Engine.build_topology(A, R, [meta of trainer ranks..., meta
                                                          of rollout ranks...])
    # trainer_kw = {"rank": [0, 1, ...], "token": [...], ...}: one list entry per worker
    engine.init_process_group(**worker_kwargs(trainer_kw, i))   # every worker, concurrently
    await engine.send_weights(named_tensors, version)        # trainer ranks
    async for name, t in engine.receive_weights(version):    # rollout ranks
        ...
    engine.finalize()                           # releases buffers, sockets, groups

Backend options (``ShmOptions``, ``CollectiveOptions``, ``CudaIpcOptions``,
``NixlOptions``; ``CodecOptions`` for the codec names) are keyword arguments of the same
call (``new("shm", direct=False)``) or one object (``new("shm", options=ShmOptions(...))``);
keywords given beside ``options=`` override its fields.

``init_process_group`` is done once; ``send_weights``/``receive_weights`` run as many
syncs as wanted on the same engines; ``finalize`` ends it (``prepare`` may start again).

Rules every backend keeps (the conformance suite checks them):

* Trainer ranks each pass an iterable (or async iterable) of ``(name, tensor)``. A name
  yielded by several ranks is delivered once; ownership is spread over the ranks. Every
  rank must walk its iterable to the end (producing a tensor may be a collective).
* Tensors handed to ``send_weights`` may be views valid only until the next item.
* Every rollout rank receives the union of the names, each exactly once, bit-exact after
  the optional ``dtype`` cast. A tensor yielded by ``receive_weights`` may be a view into
  the engine's buffer: it is valid until the iterator is advanced; copy it to keep it.
* ``version`` travels with the data. A receiver that expects another version raises
  :class:`~weightsync.core.errors.VersionMismatch` instead of yielding weights.
* Every wait is bounded by ``timeout``; failures raise a
  :class:`~weightsync.core.errors.WeightSyncError` naming peer, phase and version.
"""

from __future__ import annotations

import abc
from typing import Any, AsyncIterator, ClassVar, Iterable, Mapping, Optional, Union

import torch

from weightsync.core.config import EngineConfig, build_options, option_names
from weightsync.core.errors import TopologyError

__all__ = ["CheckpointEngine", "CONFIG_KEYS", "NamedTensors", "check_topology", "worker_kwargs",
           "per_worker", "validate_topology"]

#: Keyword arguments every engine takes (:class:`~weightsync.core.config.EngineConfig`).
CONFIG_KEYS = ("bucket_size", "timeout", "device", "dtype", "num_slots", "checksum", "role",
               "host")

NamedTensors = Union[Iterable[tuple[str, torch.Tensor]], Any]  # or an async iterable


class CheckpointEngine(abc.ABC):
    """Abstract transport backend. Subclasses register with ``CheckpointEngineRegistry``.

    ``capabilities`` says what a backend can do: ``"cpu"``/``"cuda"`` (tensor devices),
    ``"same_process"``, ``"same_host"``, ``"multi_host"``.
    """

    backend_name: ClassVar[str] = ""
    capabilities: ClassVar[frozenset[str]] = frozenset()
    #: The backend's options dataclass (``None``: only :class:`EngineConfig`'s settings).
    #: Its fields are keyword arguments of the engine; ``options=`` takes a whole instance.
    options_cls: ClassVar[Optional[type]] = None

    def __init__(self, *, options: Any = None, **kwargs: Any) -> None:
        own = option_names(type(self).options_cls)
        known = set(CONFIG_KEYS) | set(own)
        unknown = set(kwargs) - known
        name = type(self).backend_name or type(self).__name__
        if unknown:
            raise ValueError(
                f"unknown option(s) {sorted(unknown)} for backend {name!r}; known: "
                f"{sorted(known) + (['options'] if own else [])}")
        self.config = EngineConfig(**{k: v for k, v in kwargs.items()
                                      if v is not None and k in CONFIG_KEYS})
        #: this backend's options (an instance of ``options_cls``), or ``None``
        self.options = build_options(type(self).options_cls, options,
                                     {k: v for k, v in kwargs.items() if k in own},
                                     owner=f"backend {name!r}")

    # -- lifecycle -----------------------------------------------------------------------

    @abc.abstractmethod
    def prepare(self) -> dict[str, Any]:
        """Set up what peers must know before the topology is built; return it (JSON-able)."""

    @classmethod
    @abc.abstractmethod
    def build_topology(
        cls, trainer_world_size: int, rollout_world_size: int, metadata: list[dict[str, Any]]
    ) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
        """From every worker's ``prepare()`` result (trainer ranks first, then rollout
        ranks), the keyword arguments of ``init_process_group``: one dict per side, mapping
        each keyword to a list with one value per worker of that side (verl's shape).
        :func:`worker_kwargs` picks one worker's entry."""

    @abc.abstractmethod
    def init_process_group(self, **kwargs: Any) -> None:
        """Join the group described by this worker's entry of ``build_topology``."""

    @abc.abstractmethod
    async def send_weights(self, named_tensors: NamedTensors, version: Any = None) -> dict[str, Any]:
        """Send one version of the weights; returns metrics (bytes, seconds, ...)."""

    @abc.abstractmethod
    def receive_weights(self, version: Any = None) -> AsyncIterator[tuple[str, torch.Tensor]]:
        """Async iterator over ``(name, tensor)`` of one version."""

    @abc.abstractmethod
    def finalize(self) -> None:
        """Release every buffer, segment, socket, thread and group. Idempotent."""

    async def receive_into(self, params: Mapping[str, torch.Tensor], version: Any = None
                           ) -> AsyncIterator[tuple[str, torch.Tensor]]:
        """Receive one version into the receiver's own tensors (e.g. its model's).

        Each received tensor whose name is in ``params`` is copied into ``params[name]``
        (``copy_`` semantics: dtype cast, any layout) and yielded as ``(name,
        params[name])``; other names are yielded as :meth:`receive_weights` yields them.
        Backends that can land bytes straight in those tensors override this (the bucketed
        backends do), so no copy is left to the caller.
        """
        async for name, tensor in self.receive_weights(version):
            dest = params.get(name)
            if dest is None:
                yield name, tensor
                continue
            if tuple(dest.shape) != tuple(tensor.shape):
                raise ValueError(f"receive_into: {name} has shape {tuple(tensor.shape)}, "
                                 f"params[{name!r}] has {tuple(dest.shape)}")
            dest.copy_(tensor)
            yield name, dest

    # -- helpers -------------------------------------------------------------------------

    def reset_plan(self) -> None:
        """Forget cached plans: the next sync re-sends its layout (weight set changed)."""

    def __enter__(self) -> "CheckpointEngine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.finalize()


def check_topology(
    backend: str, trainer_world_size: int, rollout_world_size: int, metadata: list,
) -> None:
    """Validate ``build_topology`` inputs with clear errors."""
    for name, value in (("trainer_world_size", trainer_world_size),
                        ("rollout_world_size", rollout_world_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{backend}: {name} must be an int >= 1, got {value!r}")
    if not isinstance(metadata, (list, tuple)):
        raise ValueError(f"{backend}: metadata must be a list of prepare() results")
    expected = trainer_world_size + rollout_world_size
    if len(metadata) != expected:
        raise TopologyError(
            f"{backend}: build_topology got {len(metadata)} prepare() results, expected "
            f"{trainer_world_size} trainer + {rollout_world_size} rollout = {expected}",
            phase="build_topology")


def version_matches(expected: Optional[Any], got: Any) -> bool:
    """``None`` expects any version."""
    return expected is None or expected == got


def per_worker(entries: list[dict[str, Any]]) -> dict[str, list[Any]]:
    """Turn a list of per-worker dicts into verl's dict of per-worker lists."""
    keys = entries[0].keys() if entries else ()
    return {k: [e[k] for e in entries] for k in keys}


def worker_kwargs(kwargs: dict[str, list[Any]], index: int) -> dict[str, Any]:
    """The ``init_process_group`` keywords of worker ``index`` of one side."""
    return {k: v[index] for k, v in kwargs.items()}


def validate_topology(backend: str, side: str, kwargs: Any, size: int) -> None:
    """Every value must be a list with one entry per worker (``TopologyError`` otherwise)."""
    if not isinstance(kwargs, dict):
        raise TopologyError(f"{backend}: build_topology must return dicts of lists, got "
                            f"{type(kwargs).__name__} for the {side} side", phase="build_topology")
    for key, value in kwargs.items():
        if not isinstance(value, (list, tuple)) or len(value) != size:
            got = len(value) if isinstance(value, (list, tuple)) else type(value).__name__
            raise TopologyError(
                f"{backend}: build_topology gave key {key!r} of the {side} side {got} "
                f"entries, but the {side} side has {size} workers", phase="build_topology")
