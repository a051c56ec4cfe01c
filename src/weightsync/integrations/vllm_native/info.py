"""The typed init/update infos of the ``weightsync-<backend>`` vLLM weight-transfer engines.

What travels between the trainer and the vLLM workers (as the JSON bodies of vLLM's
``/init_weight_transfer_engine`` and ``/update_weights``, or the dicts of ``LLM``'s
methods), and the trainer-side init infos that select a backend in vLLM's
``WeightTransferTrainerFactory`` (one class per backend: vLLM dispatches on the class's
``backend``). Every field is checked when the dataclass is built, so malformed input is a
``ValueError`` naming the field, before anything is connected or received.

* :class:`WeightsyncInitInfo` (worker side): where trainer rank 0's rendezvous store
  listens (``address``), the job token, the world sizes and the engine options.
* :class:`WeightsyncUpdateInfo`: one ``update_weights`` chunk. ``phase="check"``
  describes the weight set (names, shapes, wire dtypes; no bytes) and is validated
  against the checkpoint (``digests=True``: also hash every tensor of the version as it
  arrives, for ``verify``); ``phase="receive"`` then moves the bytes of that version.
  ``kind="adapter"`` (with ``adapter={"name", "config"}``) describes a LoRA adapter
  instead, held in memory once received (see :mod:`.engine`). ``group`` (optional,
  :func:`~weightsync.transport.rendezvous.group_id` of the init's token): the check is
  refused if the workers joined another group since.
* :class:`WeightsyncTrainerInitInfo` and its per-backend subclasses (trainer side).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional

from vllm.distributed.weight_transfer.base import (TrainerInitInfo, WeightTransferInitInfo,
                                                   WeightTransferUpdateInfo)

__all__ = ["PREFIX", "BACKENDS", "KINDS", "ENGINE_OPTIONS", "WeightsyncInitInfo",
           "WeightsyncUpdateInfo",
           "WeightsyncTrainerInitInfo", "ShmTrainerInitInfo", "CollectiveTrainerInitInfo",
           "NixlTrainerInitInfo", "CudaIpcTrainerInitInfo", "trainer_init_info",
           "weightsync_backend", "check_version"]

PREFIX = "weightsync-"
#: weightsync transports that can be a vLLM backend (``inproc`` cannot: vLLM's workers
#: are other processes than the trainer's, or run their own loop in it).
BACKENDS = ("shm", "collective", "nixl", "cuda_ipc")
#: engine options the trainer may pass on to the workers' engines, with their types.
ENGINE_OPTIONS: dict[str, tuple] = {"bucket_size": (int,), "timeout": (int, float),
                                    "num_slots": (int,), "checksum": (bool,), "host": (str,)}
PHASES = ("check", "receive")
#: What a check chunk describes: the model's weights, or a LoRA adapter (held in memory
#: and loaded through vLLM's LoRA manager, :mod:`weightsync.rollout.vllm.lora`).
KINDS = ("full", "adapter")
_MAX_NAMES = 1 << 20


def weightsync_backend(vllm_backend: Any) -> str:
    """``"weightsync-shm"`` -> ``"shm"``; ``ValueError`` naming the known ones otherwise."""
    if isinstance(vllm_backend, str) and vllm_backend.startswith(PREFIX):
        name = vllm_backend[len(PREFIX):]
        if name in BACKENDS:
            return name
    raise ValueError(f"unknown weightsync backend {vllm_backend!r}; known: "
                     f"{[PREFIX + b for b in BACKENDS]}")


def check_version(version: Any) -> Any:
    """A weight version is an int or a non-empty str (vLLM shows it as a str)."""
    if isinstance(version, bool) or not isinstance(version, (int, str)) or version == "":
        raise ValueError(f"version must be an int or a non-empty str, got {version!r:.80}")
    return version


def _int(name: str, value: Any, low: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r:.80}")
    return value


def _engine_options(options: Any) -> dict:
    if not isinstance(options, dict):
        raise ValueError(f"engine must be a dict of engine options, got {options!r:.80}")
    for key, value in options.items():
        types = ENGINE_OPTIONS.get(key)
        if types is None:
            raise ValueError(f"unknown engine option {key!r}; known: {sorted(ENGINE_OPTIONS)}")
        if not isinstance(value, types) or (bool not in types and isinstance(value, bool)):
            raise ValueError(f"engine option {key} must be {'/'.join(t.__name__ for t in types)}"
                             f", got {value!r:.80}")
    return options


def _adapter(adapter: Any) -> dict:
    """``{"name": str, "config": PEFT's LoraConfig as a dict}`` of an adapter sync."""
    if not isinstance(adapter, dict) or set(adapter) != {"name", "config"}:
        raise ValueError(f"kind 'adapter' needs adapter={{'name': ..., 'config': {{...}}}}, "
                         f"got {adapter!r:.120}")
    name, config = adapter["name"], adapter["config"]
    if not isinstance(name, str) or not name or "@" in name:
        raise ValueError(f"adapter name must be a non-empty str without '@', got {name!r:.80}")
    if not isinstance(config, dict) or not isinstance(config.get("r"), int) \
            or isinstance(config.get("r"), bool) or config["r"] < 1:
        raise ValueError(f"adapter config must be PEFT's LoraConfig as a dict (with an int "
                         f"'r' >= 1), got {config!r:.120}")
    return adapter


def _address(address: Any) -> str:
    host, sep, port = address.rpartition(":") if isinstance(address, str) else ("", "", "")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"address must look like 'host:port', got {address!r:.80}")
    return address


@dataclass
class WeightsyncInitInfo(WeightTransferInitInfo):
    """What each vLLM worker needs to join the trainer's weightsync group."""

    backend: str
    address: str
    token: str
    rollout_world_size: int
    trainer_world_size: int = 1
    engine: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        weightsync_backend(self.backend)
        _address(self.address)
        if not isinstance(self.token, str) or not self.token:
            raise ValueError("token must be the job's token (a non-empty str)")
        _int("rollout_world_size", self.rollout_world_size)
        _int("trainer_world_size", self.trainer_world_size)
        _engine_options(self.engine)


@dataclass
class WeightsyncUpdateInfo(WeightTransferUpdateInfo):
    """One ``update_weights`` chunk: ``check`` a weight set, then ``receive`` it."""

    phase: str
    version: Any
    names: Optional[list] = None
    shapes: Optional[list] = None
    dtypes: Optional[list] = None
    digests: bool = False
    kind: str = "full"
    adapter: Optional[dict] = None
    group: Optional[str] = None

    def __post_init__(self) -> None:
        if self.phase not in PHASES:
            raise ValueError(f"phase must be one of {PHASES}, got {self.phase!r:.80}")
        check_version(self.version)
        if not isinstance(self.digests, bool):
            raise ValueError(f"digests must be a bool, got {self.digests!r:.80}")
        if self.phase == "receive":
            if any(v is not None for v in (self.names, self.shapes, self.dtypes,
                                           self.adapter)) or self.digests \
                    or self.kind != "full":
                raise ValueError("phase 'receive' takes only the version (the weight set "
                                 "was described by phase 'check')")
            return
        if self.group is not None and not (isinstance(self.group, str) and self.group):
            raise ValueError(f"group must be a non-empty str, got {self.group!r:.80}")
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {self.kind!r:.80}")
        if self.kind == "adapter":
            _adapter(self.adapter)
            if self.digests:
                raise ValueError("digests are taken of full weight sets only")
        elif self.adapter is not None:
            raise ValueError("adapter (name and PEFT config) goes with kind 'adapter' only")
        for key in ("names", "shapes", "dtypes"):
            value = getattr(self, key)
            if not isinstance(value, list) or len(value) > _MAX_NAMES:
                raise ValueError(f"phase 'check' needs {key} as a list, got {value!r:.80}")
        if not len(self.names) == len(self.shapes) == len(self.dtypes):
            raise ValueError(f"names, shapes and dtypes differ in length: {len(self.names)}, "
                             f"{len(self.shapes)}, {len(self.dtypes)}")
        for name, shape, dtype in zip(self.names, self.shapes, self.dtypes):
            if not isinstance(name, str) or not isinstance(dtype, str):
                raise ValueError(f"bad entry {name!r:.80} / {dtype!r:.40}: names and dtypes "
                                 "are strings")
            if not isinstance(shape, list) or any(isinstance(d, bool) or not isinstance(d, int)
                                                   or d < 0 for d in shape):
                raise ValueError(f"{name}: shape must be a list of ints >= 0, got {shape!r:.80}")

    def offered(self) -> list[list]:
        """``[name, shape, dtype]`` per tensor (weightsync's weight-set description)."""
        return [[n, list(s), d] for n, s, d in zip(self.names or [], self.shapes or [],
                                                   self.dtypes or [])]


@dataclass
class WeightsyncTrainerInitInfo(TrainerInitInfo):
    """Trainer-side init info; use a per-backend subclass (or :func:`trainer_init_info`).

    ``rank``: this trainer process (rank 0 sends and drives the workers; other ranks only
    walk their source, as with vLLM's own backends). ``rollout_world_size``: vLLM workers
    across data parallel (``/get_world_size``). ``address``: ``host:port`` where rank 0's
    rendezvous store listens (default: loopback, a free port); ``token``: the job token
    (default: a random one, sent to the workers in the init info). ``bucket_size``,
    ``timeout``, ``num_slots``, ``checksum``: engine options of both sides; ``dtype``: cast
    floating tensors on send (e.g. ``"bfloat16"``); ``host`` / ``worker_host``: the
    interface the trainer's / the workers' engines bind (loopback by default).
    """

    backend: ClassVar[str] = PREFIX + "base"

    rollout_world_size: int = 1
    address: Optional[str] = None
    token: Optional[str] = None
    bucket_size: Optional[int] = None
    timeout: Optional[float] = None
    num_slots: Optional[int] = None
    checksum: Optional[bool] = None
    dtype: Optional[str] = None
    host: Optional[str] = None
    worker_host: Optional[str] = None

    def __post_init__(self) -> None:
        weightsync_backend(self.backend)
        _int("rank", self.rank, 0)
        _int("rollout_world_size", self.rollout_world_size)
        if self.address is not None:
            _address(self.address)
        if self.token is not None and (not isinstance(self.token, str) or not self.token):
            raise ValueError("token must be a non-empty str (or None for a random one)")
        _engine_options(self.shared_options())
        for key in ("host", "worker_host", "dtype"):
            if getattr(self, key) is not None and not isinstance(getattr(self, key), str):
                raise ValueError(f"{key} must be a str, got {getattr(self, key)!r:.80}")

    def shared_options(self) -> dict:
        """Engine options both sides get."""
        keys = ("bucket_size", "timeout", "num_slots", "checksum")
        return {k: getattr(self, k) for k in keys if getattr(self, k) is not None}


@dataclass
class ShmTrainerInitInfo(WeightsyncTrainerInitInfo):
    """``weightsync-shm``: trainer and vLLM workers on one host (shared memory)."""
    backend: ClassVar[str] = PREFIX + "shm"


@dataclass
class CollectiveTrainerInitInfo(WeightsyncTrainerInitInfo):
    """``weightsync-collective``: any hosts (gloo on CPU, NCCL with CUDA)."""
    backend: ClassVar[str] = PREFIX + "collective"


@dataclass
class NixlTrainerInitInfo(WeightsyncTrainerInitInfo):
    """``weightsync-nixl``: receivers pull over NIXL (needs ``nixl``)."""
    backend: ClassVar[str] = PREFIX + "nixl"


@dataclass
class CudaIpcTrainerInitInfo(WeightsyncTrainerInitInfo):
    """``weightsync-cuda_ipc``: processes sharing one GPU (needs CUDA)."""
    backend: ClassVar[str] = PREFIX + "cuda_ipc"


_TRAINER_INFOS = {cls.backend: cls for cls in (ShmTrainerInitInfo, CollectiveTrainerInitInfo,
                                               NixlTrainerInitInfo, CudaIpcTrainerInitInfo)}


def trainer_init_info(backend: str, **fields: Any) -> WeightsyncTrainerInitInfo:
    """The trainer init info of ``backend`` (``"weightsync-shm"`` or ``"shm"``)."""
    name = backend if str(backend).startswith(PREFIX) else PREFIX + str(backend)
    weightsync_backend(name)
    return _TRAINER_INFOS[name](**fields)
