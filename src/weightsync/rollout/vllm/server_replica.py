"""A ``vllm serve`` process as a rollout replica of the manager, driven over HTTP only.

:class:`VLLMServerReplica` owns a ``vllm serve`` process (started on a free loopback port,
:class:`~weightsync.rollout.vllm.serve.VLLMServer`) or attaches to one at a base URL, and
implements the rollout adapter protocol (:mod:`weightsync.rollout.protocol`) over the
server's HTTP API, so :class:`~weightsync.orchestration.manager.CheckpointEngineManager`
syncs, isolates, fences and verifies it as it does a
:class:`~weightsync.rollout.vllm.VLLMRolloutReplica`. Nothing of vLLM is imported here.

**Where the bytes go.** The server runs weightsync's vLLM weight-transfer backend
(``--weight-transfer-config '{"backend": "weightsync-<backend>"}'``, registered by the
``vllm.general_plugins`` entry point of :mod:`weightsync.integrations.vllm_native`): every
vLLM worker of the server hosts a receiving engine of the manager's group, and the bytes go
from the trainer's ordinary weightsync engine into the workers and vLLM's loader; they never
pass through this process or the HTTP API.

**The calls** (each bounded by a timeout; see ``VLLMServerOptions``):

* group: ``engine_prepare`` hosts a :class:`~weightsync.transport.rendezvous.RolloutRelay`
  (a token-checked store) and posts ``/init_weight_transfer_engine`` with its address, so
  each worker runs ``weightsync.connect(role="rollout")`` against it: the relay hands the
  workers' ``prepare()`` results to the manager (its ``build_topology``), and
  ``engine_init`` hands back each worker's ``init_process_group`` keywords; the init call
  returns once the workers have joined the manager's group. ``engine_finalize`` posts
  ``/shutdown_weight_transfer_engine``;
* validation before bytes: ``check_weights`` runs the vLLM replica's own check in every
  worker (``/collective_rpc`` ``weightsync_check``: the checkpoint's safetensors headers;
  names, shapes, castable dtypes, a full set) and keeps the description;
* a sync (``engine_receive``): ``/start_weight_update``, ``/update_weights`` with
  ``phase="check"`` (that description again, checked by the backend itself before a byte
  moves; ``digests`` on), ``/update_weights`` with ``phase="receive"`` while the trainer
  sends, ``/finish_weight_update`` with the version (the backend resets the prefix cache
  right after), then ``/weight_info`` must report the version. The backend receives the
  whole version before vLLM's loader sees a tensor, so a failed transfer leaves the old
  weights serving in the server;
* generation control: ``pause`` stops this replica's own generations (``/abort_requests``
  for theirs when ``abort``), then posts ``/pause`` (``mode=abort`` or ``wait``: every other
  client's requests too); ``resume`` posts ``/resume``; ``reset_caches`` posts
  ``/reset_prefix_cache``; ``sleep``/``wake_up``: ``/sleep``/``/wake_up`` where the server
  has sleep mode, else (vLLM on CPU) generation is refused and the prefix cache dropped, no
  memory freed (``capabilities()`` says so);
* fencing: the protocol's :class:`~weightsync.rollout.protocol.SyncFence` (``begin_sync`` to
  the end of the version; a failed sync fences until one completes), which ``generate``
  obeys; the server itself is not fenced for other clients (they see the old version
  until the new one is complete);
* versions: the manager's version becomes vLLM's weight version (``finish_weight_update``);
  each output carries the version the server reported (``/weight_info``) before and after
  its request, which must agree;
* ``verify``: ``weight_digests`` reads (``/collective_rpc`` ``weightsync_transfer_state``)
  the digests the backend took of the last complete version as it arrived, plus live
  digests of embeddings and norms, as the in-process vLLM replica does;
* generation: greedy ``/v1/completions`` on token ids (``return_token_ids``), raw logits of
  the whole vocabulary from ``logprobs`` (the server runs ``--logprobs-mode raw_logits
  --max-logprobs -1``);
* LoRA (a server with ``--enable-lora``, runtime adapter loading on:
  ``VLLMServerOptions(lora_rank=r)`` starts one so): an adapter sync sends the adapter's
  tensors and PEFT config through the backend, which checks them against the checkpoint
  and vLLM's rules before a byte moves and holds the received adapter in the workers'
  memory; ``/v1/load_lora_adapter`` then builds it from that memory (no file) in place of
  the replica's adapter (:data:`LORA_NAME`, which its generation requests name), and only
  then does ``/finish_weight_update`` move the version label. A failed adapter sync leaves
  the old adapter serving. ``base`` syncs load the weights under the adapter; a ``full``
  sync (merged weights) unloads it.

The server must run in dev mode (``VLLM_SERVER_DEV_MODE=1``: the RL endpoints and
``/collective_rpc``) with weightsync's worker extension (``--worker-extension-cls``
:data:`~weightsync.rollout.vllm.util.EXTENSION`); an owned server is started so, an
attached one is checked at attach.

**Failures.** A server that died (connection refused, or its process exited) is a
``PeerFailed``, one that does not answer in time a ``SyncTimeout``; both say which replica
(its name, URL and pid in the message), the phase and the version, and no call waits past
its bound. The replica's own failures carry no ``peer`` (the manager's isolation reads an
error naming no peer as the replica's own); an error of the server's workers that names a
peer of the transport (``trainer rank 0``, ``rollout rank 3``) keeps it, so a replica that
was merely told of a trainer's failure is not blamed.

**Not over this API** (raise, with the reason): ``execute_checkpoint_engine`` (vLLM's API
exposes no call into the backend's engines), adapter and ``"base"`` syncs into a server
without LoRA, atomic syncs (the backend applies a version inside its own receive: no
separate commit).
"""

from __future__ import annotations

import collections
import http.client
import itertools
import logging
import math
import os
import threading
import time
import urllib.parse
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch

from weightsync.core import errors as _errors
from weightsync.core.errors import PeerFailed, SyncTimeout, WeightSyncError
from weightsync.rollout.protocol import (SLEEP_LEVELS, WEIGHT_KINDS, Generation,
                                         GenerationGate, ReplicaControls, SyncFence,
                                         check_tags)
from weightsync.rollout.vllm.serve import (HTTPWeightSyncClient, VLLMServer, VLLMServerError,
                                           error_fields)
from weightsync.rollout.vllm.checks import adapter_digests, merge_problems, normalize_offered
from weightsync.rollout.vllm.lora import memory_path
from weightsync.rollout.vllm.util import (EXTENSION, check_may_generate, check_prompts,
                                          max_positions)
from weightsync.transport.rendezvous import TAKEN_OVER, RolloutRelay, group_id

__all__ = ["VLLMServerReplica", "VLLMServerOptions", "PREFIX", "BACKENDS", "LORA_NAME"]

logger = logging.getLogger(__name__)

#: vLLM's name of a weightsync weight-transfer backend is ``PREFIX + backend``
#: (:mod:`weightsync.integrations.vllm_native.info`).
PREFIX = "weightsync-"
#: transports that can be a vLLM weight-transfer backend.
BACKENDS = ("shm", "collective", "nixl", "cuda_ipc")
#: engine options the backend's ``init_info["engine"]`` takes (the rest stay here).
_ENGINE_OPTIONS = ("bucket_size", "timeout", "num_slots", "checksum", "host")
_RELAYED = ("trainer rank", "rollout rank")     # peers of the transport: keep them
_ABORTED = ("abort",)
#: The name the replica loads its adapter under (what its generation requests name).
LORA_NAME = "weightsync"


def _positive(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name} must be a positive number, got {value!r}")


@dataclass(kw_only=True)
class VLLMServerOptions:
    """How a :class:`VLLMServerReplica` runs (or reaches) its ``vllm serve``.

    ``backend``: the weightsync transport of the server's weight-transfer config (the
    manager's backend must be the same). ``dtype``, ``kv_cache_bytes``, ``max_model_len``
    (capped at the model's ``max_position_embeddings``),
    ``max_num_seqs``, ``extra_args`` (more ``vllm serve`` arguments), ``env``, ``log_path``:
    an owned server's start (``start_timeout``, ``stop_timeout`` bound its start and stop).
    ``lora_rank``: an owned server runs LoRA adapters up to this rank (``--enable-lora
    --max-lora-rank``, runtime adapter loading on), so adapter-only syncs can land in it.
    ``timeout``: seconds any HTTP call other than a sync's receive may take (a receive
    gets twice the engine timeout plus 30 s). ``digests``: the backend hashes every received
    tensor for ``verify`` (one pass over the weights per sync; off: ``verify`` reports an
    error). ``store_host``: the interface the replica's rendezvous relay binds, which the
    server's workers must reach (loopback by default).
    """

    backend: str = "shm"
    dtype: str = "float32"
    kv_cache_bytes: int = 64 << 20
    max_model_len: int = 512
    max_num_seqs: int = 4
    digests: bool = True
    timeout: float = 300.0
    start_timeout: float = 300.0
    stop_timeout: float = 30.0
    store_host: str = "127.0.0.1"
    log_path: Optional[str] = None
    extra_args: tuple = ()
    env: dict = field(default_factory=dict)
    lora_rank: Optional[int] = None

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS} (vLLM's weightsync-<backend>),"
                             f" got {self.backend!r}")
        self.dtype = str(self.dtype).replace("torch.", "")
        if self.dtype not in ("float32", "bfloat16", "float16", "auto"):
            raise ValueError(f"dtype must be float32, bfloat16, float16 or auto, got "
                             f"{self.dtype!r}")
        for name in ("kv_cache_bytes", "max_model_len", "max_num_seqs"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        for name in ("timeout", "start_timeout", "stop_timeout"):
            _positive(name, getattr(self, name))
        if self.lora_rank is not None and (isinstance(self.lora_rank, bool) or not isinstance(
                self.lora_rank, int) or self.lora_rank < 1):
            raise ValueError(f"lora_rank must be None or an int >= 1, got {self.lora_rank!r}")
        if not isinstance(self.digests, bool):
            raise ValueError(f"digests must be a bool, got {self.digests!r}")
        if not isinstance(self.store_host, str) or not self.store_host:
            raise ValueError(f"store_host must be a host name or address, got "
                             f"{self.store_host!r}")
        if isinstance(self.extra_args, str) or not all(isinstance(a, str)
                                                       for a in self.extra_args):
            raise ValueError(f"extra_args must be a sequence of str, got {self.extra_args!r}")
        self.extra_args = tuple(self.extra_args)
        if not isinstance(self.env, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                     for k, v in self.env.items()):
            raise ValueError(f"env must be a dict of str to str, got {self.env!r:.200}")


def _nbytes(shapes: list, dtypes: list) -> int:
    """Bytes of a described weight set (what a complete receive of it moved)."""
    from weightsync.core.plan import dtype_from_name

    total = 0
    for shape, dtype in zip(shapes, dtypes):
        total += math.prod(shape) * dtype_from_name(dtype).itemsize
    return total


class _Background:
    """One blocking call in a helper thread: ``done`` once it ended, then ``box`` holds
    its ``value`` or its ``error``."""

    def __init__(self, fn: Callable[[], Any], name: str) -> None:
        self.box: dict = {}
        self.done = threading.Event()
        threading.Thread(target=self._run, args=(fn,), daemon=True, name=name).start()

    def _run(self, fn: Callable[[], Any]) -> None:
        try:
            self.box["value"] = fn()
        except BaseException as exc:  # the caller re-raises it
            self.box["error"] = exc
        finally:
            self.done.set()


class VLLMServerReplica(ReplicaControls):
    """One ``vllm serve`` process as a rollout replica (see the module docstring).

    Pass ``model`` (a local HF model folder: the replica starts and owns a server on it) or
    ``url`` (a running server, started in dev mode with weightsync's backend and worker
    extension, see the module docstring). ``options``: :class:`VLLMServerOptions`.
    """

    def __init__(self, model: Optional[str] = None, *, url: Optional[str] = None,
                 name: str = "vllm-server", options: Optional[VLLMServerOptions] = None) -> None:
        if (model is None) == (url is None):
            raise ValueError("pass exactly one of model= (a local HF folder: start a server) "
                             "or url= (a running server)")
        self.options = options if options is not None else VLLMServerOptions()
        if not isinstance(self.options, VLLMServerOptions):
            raise ValueError(f"options must be a VLLMServerOptions, got "
                             f"{type(self.options).__name__}")
        if not isinstance(name, str) or not name:
            raise ValueError(f"name must be a non-empty str, got {name!r}")
        self.name = name
        self.gate = GenerationGate(self.options.timeout)
        self._log: collections.deque = collections.deque(maxlen=2000)
        self._fence = SyncFence()
        self._version: Any = None
        self._versions: dict[str, Any] = {}
        self._offered: dict[str, list] = {}      # per kind: the set the last check accepted
        self._base_version: Any = None            # of the weights under the adapter
        self._adapter: Optional[dict] = None      # {"path", "config"} of the active adapter
        self._adapter_cfg: Optional[dict] = None  # the PEFT config of the last adapter
        self._pending: Optional[tuple] = None     # (relay, init call, timeout) of a join
        self._joined: Optional[str] = None        # backend of the group the workers joined
        self._group: Optional[str] = None         # its group_id (each check names it)
        self._dead: Optional[str] = None
        self._asleep = {"weights": False, "kv_cache": False}
        self._ids = itertools.count()
        self._sync_timeout = 2 * self.options.timeout + 45
        self.server: Optional[VLLMServer] = None
        if model is not None:
            self.server = self._start(model)
            self.url = self.server.url
        else:
            self.url = str(url).rstrip("/")
        self.client = HTTPWeightSyncClient(self.url, timeout=self.options.timeout)
        try:
            self._read_server()
        except BaseException:
            self.close()
            raise

    # -- start / attach ---------------------------------------------------------------
    def _start(self, model: str) -> VLLMServer:
        if not isinstance(model, str) or not os.path.isdir(model):
            raise ValueError(f"model must be a local HF model folder, got {model!r}")
        o = self.options
        extra = ["--logprobs-mode", "raw_logits", "--max-logprobs", "-1",
                 "--worker-extension-cls", EXTENSION, *o.extra_args]
        env = dict(o.env)
        if o.lora_rank is not None:
            extra += ["--enable-lora", "--max-lora-rank", str(o.lora_rank)]
            env.setdefault("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "1")   # /v1/load_lora_adapter
        max_len = min(o.max_model_len, max_positions(model) or o.max_model_len)
        server = VLLMServer(model, backend=PREFIX + o.backend, dtype=o.dtype,
                            kv_cache_bytes=o.kv_cache_bytes, max_model_len=max_len,
                            max_num_seqs=o.max_num_seqs, extra=extra,
                            start_timeout=o.start_timeout, stop_timeout=o.stop_timeout,
                            log_path=o.log_path, env=env, client_timeout=o.timeout)
        return server.start()

    def _read_server(self) -> None:
        """What the replica needs of the server, checked: weightsync's backend (the one
        of the options), the worker extension, one state per worker, the model id."""
        try:
            states = self._rpc("weightsync_transfer_state", phase="start")
        except (WeightSyncError, ValueError) as exc:
            raise ValueError(f"{self.name}: {self.url} cannot serve as a weightsync replica: "
                             f"{getattr(exc, 'detail', exc)}. Start it with "
                             f"VLLM_SERVER_DEV_MODE=1, "
                             f"--weight-transfer-config '{{\"backend\": \""
                             f"{PREFIX}{self.options.backend}\"}}' and --worker-extension-cls "
                             f"{EXTENSION}") from None
        config = states[0]["config"]
        if config["backend"] != PREFIX + self.options.backend:
            raise ValueError(f"{self.name}: the server's weight-transfer backend is "
                             f"{config['backend']!r}, the options say "
                             f"{PREFIX + self.options.backend!r}")
        self.world_size = len(states)
        self.config = dict(config)
        self.vocab_size = int(config["vocab_size"])
        self.max_model_len = int(config["max_model_len"])
        self.sleep_mode = bool(config["enable_sleep_mode"])
        self.max_lora_rank = config.get("max_lora_rank")      # None: no LoRA
        self.raw_logits = config["logprobs_mode"] == "raw_logits" and (
            config["max_logprobs"] == -1 or config["max_logprobs"] >= self.vocab_size)
        self.model_id = self._http(lambda: self.client.model_id(), "/v1/models", "start")
        served = self._served_version("start")
        self._version = self._base_version = None if served == "default" else served

    @property
    def pid(self) -> Optional[int]:
        """The owned server's pid (None when attached)."""
        return None if self.server is None else self.server.pid

    def _who(self) -> str:
        pid = f", pid {self.server.pid}" if self.server is not None and self.server.pid else ""
        return f"{self.name} (vllm serve at {self.url}{pid})"

    # -- HTTP, bounded, with weightsync's errors ----------------------------------------
    def _http(self, fn: Callable[[], Any], what: str, phase: str, version: Any = None) -> Any:
        if self._dead:
            raise PeerFailed(f"{self._who()} is dead ({self._dead}); {what} not sent",
                             phase=phase, version=version)
        try:
            return fn()
        except VLLMServerError as exc:
            raise self._server_error(exc, what, phase, version) from None
        except (OSError, http.client.HTTPException) as exc:   # URLError is an OSError
            raise self._unreachable(exc, what, phase, version) from None

    def _exit_code(self) -> Optional[int]:
        return None if self.server is None else self.server.exit_code()

    def _unreachable(self, exc: BaseException, what: str, phase: str,
                     version: Any) -> WeightSyncError:
        code = self._exit_code()
        if code is not None:
            self._dead = f"the vllm serve process exited with code {code}"
            return PeerFailed(f"{self._who()}: {self._dead} (seen during {what})",
                              phase=phase, version=version)
        reason = getattr(exc, "reason", exc)
        if isinstance(reason, TimeoutError) or isinstance(exc, TimeoutError):
            return SyncTimeout(f"{self._who()} did not answer {what} in time ({reason})",
                               phase=phase, version=version)
        if isinstance(reason, ConnectionRefusedError) and self.server is None:
            self._dead = f"connection refused ({reason})"
        return PeerFailed(f"{self._who()} unreachable during {what}: "
                          f"{type(reason).__name__}: {reason}", phase=phase, version=version)

    def _server_error(self, exc: VLLMServerError, what: str, phase: str,
                      version: Any) -> BaseException:
        """The error a server answer stands for: the backend's own type where its marker
        says (peers of the transport kept, the replica's own failures without a peer),
        ``ValueError`` for bad input, else ``PeerFailed``."""
        fields = exc.error or error_fields(exc.message)
        if fields is None:
            text = f"{self._who()}: {what} answered HTTP {exc.status}: {exc.message}"
            if 400 <= exc.status < 500:
                return ValueError(text)
            return PeerFailed(text, phase=phase, version=version)
        name, message = fields["type"], fields.get("message") or exc.message
        phase = fields.get("phase") or phase
        version = fields.get("version", version)
        source = fields.get("origin") or fields.get("peer")
        relayed = isinstance(source, str) and source.startswith(_RELAYED)
        cls = getattr(_errors, name, None) if name in _errors.__all__ else None
        if cls is not None and relayed:
            return cls(message, peer=fields.get("peer"), phase=phase, version=version,
                       origin=fields.get("origin"))
        where = f" ({source})" if source else ""
        text = f"{self._who()}{where}: {message}"
        if cls is not None:
            return cls(text, phase=phase, version=version)
        if name in ("ValueError", "TypeError") or 400 <= exc.status < 500:
            return ValueError(f"{text} (HTTP {exc.status})")
        return PeerFailed(f"{self._who()}{where}: {name}: {message}", phase=phase,
                          version=version)

    def _rpc(self, method: str, *args: Any, phase: str, version: Any = None,
             timeout: Optional[float] = None) -> list:
        """A method of weightsync's worker extension in every worker of the server; one
        value per worker (a worker's error re-raised as the replica's own)."""
        replies = self._http(lambda: self.client.collective_rpc(method, args, timeout=timeout),
                             f"/collective_rpc {method}", phase, version)
        out = []
        for rank, reply in enumerate(replies):
            if not isinstance(reply, dict) or "ok" not in reply:
                raise PeerFailed(f"{self._who()}: vLLM worker {rank} answered {method} with "
                                 f"{reply!r:.200} (is weightsync's worker extension "
                                 f"{EXTENSION} loaded?)", phase=phase, version=version)
            if not reply["ok"]:
                err = reply.get("error") or {}
                cls = getattr(_errors, str(err.get("type")), None) \
                    if err.get("type") in _errors.__all__ else None
                text = f"{self._who()} worker {rank}: {err.get('message')}"
                if cls is not None:
                    raise cls(text, phase=err.get("phase") or phase,
                              version=err.get("version", version))
                if err.get("type") == "ValueError":
                    raise ValueError(text)
                raise PeerFailed(f"{self._who()} worker {rank}: {err.get('type')}: "
                                 f"{err.get('message')}", phase=phase, version=version)
            out.append(reply["value"])
        if not out:
            raise PeerFailed(f"{self._who()}: /collective_rpc {method} reached no vLLM worker",
                             phase=phase, version=version)
        return out

    def _served_version(self, phase: str, version: Any = None) -> str:
        return self._http(lambda: self.client.weight_version(), "/weight_info", phase, version)

    # -- engine lifecycle ---------------------------------------------------------------
    def _backend(self, backend: Any) -> str:
        if backend != self.options.backend:
            raise ValueError(f"{self.name} serves weightsync backend "
                             f"{self.options.backend!r} (vLLM's {PREFIX}{self.options.backend}"
                             f"), not {backend!r}: its vllm serve process receives with that "
                             "one only")
        return backend

    def _drop_pending(self) -> None:
        """End a join that never completed: close its relay (the workers still waiting in
        it fail at once) and wait, bounded, for its init call to end."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        relay, call, timeout = pending
        relay.close()
        if not call.done.wait(timeout + 30.0):
            logger.warning("weightsync: %s: an abandoned /init_weight_transfer_engine did not "
                           "end within %.0f s", self._who(), timeout + 30.0)

    @staticmethod
    def _raise_if_failed(call: _Background) -> None:
        if call.done.is_set() and "error" in call.box:
            raise call.box["error"]

    def engine_prepare(self, backend: str, engine_kwargs: dict) -> list:
        """Host a relay and make every worker of the server join through it; their
        ``prepare()`` results (one per worker)."""
        self._record("engine_prepare")
        backend = self._backend(backend)
        if self._dead:
            raise PeerFailed(f"{self._who()} is dead ({self._dead})", phase="prepare")
        self._drop_pending()
        kwargs = {k: v for k, v in dict(engine_kwargs).items()
                  if k in _ENGINE_OPTIONS and v is not None}
        timeout = float(kwargs.get("timeout", self.options.timeout))
        self._sync_timeout = 2 * timeout + 45   # past the backend's own bound, inside the manager's
        relay = RolloutRelay(backend, self.world_size, timeout=timeout,
                             host=self.options.store_host)
        info = {"backend": PREFIX + backend, "address": relay.address, "token": relay.token,
                "rollout_world_size": self.world_size,
                "trainer_world_size": 1,   # read by the group's builder only: the manager here
                "engine": kwargs}
        call = _Background(lambda: self._http(
            lambda: self.client.init_weight_transfer_engine(info, timeout=2 * timeout + 30),
            "/init_weight_transfer_engine", "init"), f"weightsync-{self.name}-init")
        self._pending = (relay, call, timeout)
        self._joined = None
        try:
            return relay.metas(timeout, abort=lambda: self._raise_if_failed(call))
        except BaseException as exc:
            self._drop_pending()
            if isinstance(exc, SyncTimeout) and exc.phase == "rendezvous":
                raise SyncTimeout(f"{self._who()}: its workers did not report their engines "
                                  f"within {timeout:.0f} s ({exc.detail})",
                                  phase="prepare") from None
            raise

    def engine_init(self, kwargs_list: list) -> None:
        """Hand each worker its ``init_process_group`` keywords; returns once every worker
        joined the group (``/init_weight_transfer_engine`` returned)."""
        self._record("engine_init")
        if self._pending is None:
            raise RuntimeError(f"{self.name}: engine_init before engine_prepare")
        if not isinstance(kwargs_list, (list, tuple)) or len(kwargs_list) != self.world_size:
            raise ValueError(f"{self.name} hosts {self.world_size} receiving rank(s) (one per "
                             f"vLLM worker of its server), got {kwargs_list!r:.200}")
        relay, call, timeout = self._pending
        try:
            relay.publish([dict(k) for k in kwargs_list], timeout,
                          abort=lambda: self._raise_if_failed(call))
            if not call.done.wait(2 * timeout + 35):
                raise SyncTimeout(f"{self._who()}: /init_weight_transfer_engine did not return "
                                  f"within {2 * timeout + 35:.0f} s", phase="init")
            self._raise_if_failed(call)
        finally:
            self._pending = None
            relay.close()
        self._joined, self._group = self.options.backend, group_id(relay.token)

    def engine_finalize(self) -> None:
        """Release the workers' engines (``/shutdown_weight_transfer_engine``); nothing to
        release on a dead server."""
        self._record("engine_finalize")
        self._drop_pending()
        joined, self._joined = self._joined, None
        if joined is None or self._dead:
            return
        self._http(lambda: self.client.shutdown_weight_transfer_engine(),
                   "/shutdown_weight_transfer_engine", "finalize")

    def execute_checkpoint_engine(self, method: str, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            f"{self.name}: the receiving engines live in the vllm serve process behind vLLM's "
            f"weight-transfer API, which has no call into them (wanted {method!r})")

    # -- validation before bytes --------------------------------------------------------
    def check_weights(self, offered: list, *, kind: str = "full",
                      adapter_config: Optional[dict] = None) -> list[list[str]]:
        """Problems (``[name, why]``) of loading ``offered`` ([name, shape, dtype] per
        tensor), checked in every worker of the server; nothing is changed. The accepted
        description is what the next sync's check phase sends."""
        self._check_kind(kind, adapter_config)
        offered = normalize_offered(offered)
        problems = merge_problems(self._rpc("weightsync_check", offered, kind, phase="validate"))
        if problems:
            self._offered.pop(kind, None)
        else:
            self._offered[kind] = offered
        return problems

    def _check_kind(self, kind: str, adapter_config: Optional[dict]) -> None:
        if kind not in WEIGHT_KINDS:
            raise ValueError(f"kind must be one of {WEIGHT_KINDS}, got {kind!r}")
        if kind != "full" and self.max_lora_rank is None:
            raise ValueError(f"{self.name}: only full syncs: {self._reasons()['lora']}")
        if kind == "adapter" and self._adapter_config_for(adapter_config) is None:
            raise ValueError(f"{self.name}: an adapter sync needs the PEFT config first")

    def _adapter_config_for(self, config: Optional[dict]) -> Optional[dict]:
        return dict(config) if isinstance(config, dict) else self._adapter_cfg

    # -- a sync -------------------------------------------------------------------------
    def engine_receive(self, version: Any, *, kind: str = "full",
                       adapter_config: Optional[dict] = None) -> dict:
        """Receive ``version`` in the server (start, check, receive, finish; see the module
        docstring); fenced from here until it is complete."""
        self._check_kind(kind, adapter_config)
        if self._dead:
            raise PeerFailed(f"{self._who()} is dead ({self._dead})", phase="receive",
                             version=version)
        if self._joined is None:
            raise RuntimeError(f"{self.name}: engine_receive before engine_init")
        offered = self._offered.get(kind)
        if offered is None:
            raise ValueError(f"{self.name}: check_weights(offered, kind={kind!r}) first: "
                             "vLLM's weight-transfer API checks the weight set before any "
                             "byte moves, and the replica sends the description its check "
                             "accepted")
        if self.sleep_mode and self._asleep["weights"]:
            raise WeightSyncError(f"{self.name}: wake_up(['weights']) before loading weights",
                                  phase="receive", version=version)
        self._record(f"load:{kind}:{version}")
        names, shapes, dtypes = (list(x) for x in zip(*offered)) if offered else ([], [], [])
        check = {"phase": "check", "version": version, "names": names, "shapes": shapes,
                 "dtypes": dtypes, "digests": self.options.digests, "group": self._group}
        config = self._adapter_config_for(adapter_config)
        if kind == "adapter":     # held in the workers' memory, then loaded by vLLM's API
            check.update(kind="adapter", adapter={"name": LORA_NAME, "config": config},
                         digests=False)    # verify reads the held adapter's own digests
        paused_here = not self.gate.paused
        if paused_here:
            self.gate.pause(abort=False)
        self._fence.start_round(version, kind)
        times: dict[str, float] = {}
        start = time.perf_counter()
        try:
            self._start_update(version)
            times["start"] = time.perf_counter() - start
            self._http(lambda: self.client.update_weights(check), "/update_weights (check)",
                       "validate", version)
            times["check"] = time.perf_counter() - start - times["start"]
            t = time.perf_counter()
            self._http(lambda: self.client.update_weights(
                {"phase": "receive", "version": version}, timeout=self._sync_timeout),
                "/update_weights (receive)", "receive", version)
            times["receive"] = time.perf_counter() - t
            if kind == "adapter":    # live before the version label moves to it
                t = time.perf_counter()
                self._load_adapter(memory_path(LORA_NAME, version), version)
                times["adapter"] = time.perf_counter() - t
            t = time.perf_counter()
            self._http(lambda: self.client.finish_weight_update(str(version)),
                       "/finish_weight_update", "receive", version)
            served = self._served_version("receive", version)
            times["finish"] = time.perf_counter() - t
            if served != str(version):
                raise PeerFailed(f"{self._who()} reports weight version {served!r} after "
                                 f"finishing {version!r}", phase="receive", version=version)
        except BaseException as exc:
            if TAKEN_OVER in str(exc):   # not ours to shut down at engine_finalize
                self._joined = self._group = None
            self._after_failure(version)
            raise
        finally:
            if paused_here:
                self.gate.resume()
        self._version = version
        self._versions[str(version)] = version
        if kind == "adapter":
            self._adapter = {"path": memory_path(LORA_NAME, version), "config": config}
            self._adapter_cfg = config
        else:
            self._base_version = version
            if kind == "full" and self._adapter is not None:   # merged weights, no adapter
                self._drop_adapter(version)
        self._fence.applied(version, kind)
        stats = {"kind": kind, "version": version, "workers": self.world_size,
                 "tensors": len(names), "bytes": _nbytes(shapes, dtypes),
                 "seconds": time.perf_counter() - start,
                 **{f"{k}_seconds": v for k, v in times.items()}}
        logger.debug("weightsync: %s received version %r: %s", self.name, version, stats)
        return stats

    def _load_adapter(self, path: str, version: Any) -> None:
        """vLLM builds the adapter the workers hold under ``path`` in place of the one
        named :data:`LORA_NAME` (the old one serves until then); a refusal closes the open
        update without a version, so the server's label stays on the old adapter."""
        try:
            self._http(lambda: self.client.request(
                "POST", "/v1/load_lora_adapter", {"lora_name": LORA_NAME, "lora_path": path,
                                                  "load_inplace": True}),
                "/v1/load_lora_adapter", "load", version)
        except BaseException:
            try:
                self._http(lambda: self.client.finish_weight_update(None),
                           "/finish_weight_update", "load", version)
            except (ValueError, WeightSyncError) as exc:
                logger.info("weightsync: %s: closing the update after a refused adapter: %s",
                            self._who(), exc)
            raise

    def _drop_adapter(self, version: Any) -> None:
        """After merged weights: generation names the base model again; vLLM's copy of the
        adapter is unloaded (best effort: nothing of ours uses it any more)."""
        self._adapter = None
        try:
            self._http(lambda: self.client.request("POST", "/v1/unload_lora_adapter",
                                                   {"lora_name": LORA_NAME}),
                       "/v1/unload_lora_adapter", "load", version)
        except (ValueError, WeightSyncError) as exc:
            logger.info("weightsync: %s: unloading the adapter after merged weights: %s",
                        self._who(), exc)

    def has_adapter(self) -> bool:
        """Whether generation runs with a LoRA adapter this replica loaded."""
        return self._adapter is not None

    def _start_update(self, version: Any) -> None:
        """``/start_weight_update``; one a timed-out call of ours left open is closed first
        (without a version: the next receive replaces whatever it loaded)."""
        try:
            self._http(lambda: self.client.start_weight_update(), "/start_weight_update",
                       "receive", version)
        except ValueError as exc:
            if "already active" not in str(exc):
                raise
            logger.warning("weightsync: %s: an earlier weight update was still open; "
                           "closing it", self._who())
            try:
                self._http(lambda: self.client.finish_weight_update(None),
                           "/finish_weight_update", "receive", version)
            except (ValueError, WeightSyncError):
                pass
            self._http(lambda: self.client.start_weight_update(), "/start_weight_update",
                       "receive", version)

    def _after_failure(self, version: Any) -> None:
        """A failed round: fenced (the protocol's rule); torn where a worker reports that
        vLLM's loader failed half way (the old weights are intact otherwise)."""
        if self._dead:
            return
        try:
            states = self._rpc("weightsync_transfer_state", phase="receive", version=version,
                               timeout=min(60.0, self.options.timeout))
            torn = [s["torn"] for s in states if s.get("torn")]
        except Exception as exc:     # cannot tell: keep the fence as the round left it
            logger.info("weightsync: %s: state after a failed sync unknown: %s",
                        self._who(), exc)
            return
        if torn:
            self._fence.tear(torn[0])

    # -- generation control -------------------------------------------------------------
    def pause(self, *, abort: bool = True, timeout: Optional[float] = None) -> None:
        """Stop this replica's generations (aborted when ``abort``), then pause the server
        (``/pause``: every client's requests aborted, or waited for)."""
        self._record("pause")
        self.gate.pause(abort=abort, timeout=timeout)
        mode = "abort" if abort else "wait"
        self._http(lambda: self.client.pause(mode, timeout=timeout), f"/pause?mode={mode}",
                   "pause")

    def resume(self) -> None:
        """Resume the server (``/resume``) and this replica's generations. A join left
        half done (the manager's group build failed after ``engine_prepare``) is dropped
        first: its workers would otherwise hold the engine core until their timeout."""
        self._record("resume")
        try:
            self._drop_pending()
            if not self._dead:
                self._http(lambda: self.client.resume(), "/resume", "resume")
        finally:
            self.gate.resume()

    def sleep(self, level: int = 1) -> None:
        """vLLM's sleep where the server has sleep mode; else (CPU) generation is refused
        and the prefix cache dropped, no memory is freed."""
        if level not in SLEEP_LEVELS:
            raise ValueError(f"sleep level must be one of {SLEEP_LEVELS}, got {level!r}")
        self._record(f"sleep:{level}")
        if self.sleep_mode:
            self._http(lambda: self.client.request("POST", f"/sleep?level={level}&mode=abort"),
                       "/sleep", "sleep")
        else:
            self._reset_prefix_cache("sleep")
        self._asleep = {"weights": True, "kv_cache": True}

    def wake_up(self, tags: Optional[Sequence[str]] = None) -> None:
        tags = check_tags(tags)
        self._record("wake_up:" + ",".join(tags))
        if self.sleep_mode and any(self._asleep[t] for t in tags):
            query = "&".join(f"tags={urllib.parse.quote(t)}" for t in tags)
            self._http(lambda: self.client.request("POST", f"/wake_up?{query}"), "/wake_up",
                       "wake_up")
        for t in tags:
            self._asleep[t] = False

    def is_sleeping(self) -> dict:
        return dict(self._asleep)

    def reset_caches(self) -> None:
        self._record("reset_caches")
        self._reset_prefix_cache("reset_caches")

    def _reset_prefix_cache(self, phase: str) -> None:
        def reset(running: bool) -> bool:
            path = "/reset_prefix_cache" + ("?reset_running_requests=true" if running else "")
            out = self._http(lambda: self.client.request("POST", path), path, phase)
            return bool((out or {}).get("success"))

        if not (reset(False) or reset(True)):
            raise WeightSyncError(f"{self._who()} did not reset its prefix cache", phase=phase,
                                  version=self._version)

    # -- state --------------------------------------------------------------------------
    def current_version(self) -> Any:
        return self._version

    def served_version(self) -> Any:
        """The weight version the server reports now (``/weight_info``), as the manager's
        version where it is one of ours."""
        served = self._served_version("state")
        return self._versions.get(served, served)

    def _reasons(self) -> dict:
        out = {"atomic": "weightsync's vLLM backend applies a version at the end of its own "
                         "/update_weights receive, so there is no separate commit that could "
                         "wait for the other replicas"}
        if not self.sleep_mode:
            out["sleep"] = ("the server has no sleep mode (vLLM on CPU has none): sleep() "
                            "refuses generation and drops the prefix cache but frees no memory")
        if self.max_lora_rank is None:
            out["lora"] = ("the server runs without LoRA, so adapter-only and base syncs "
                           "cannot land in it: start it with --enable-lora --max-lora-rank "
                           "<r> and VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 "
                           "(VLLMServerOptions(lora_rank=r) for an owned server), or sync "
                           "merged weights (merge_and_sync=True)")
        return out

    def capabilities(self) -> dict:
        return {"name": "vllm-server", "url": self.url, "backend": PREFIX + self.options.backend,
                "sleep_levels": list(SLEEP_LEVELS), "sleep_frees_memory": self.sleep_mode,
                "lora": self.max_lora_rank is not None,
                "kinds": list(WEIGHT_KINDS) if self.max_lora_rank is not None else ["full"],
                "staged_kinds": [],
                # a sleeping server's weights under the native path are untested here: the
                # manager caps level 2 at 1 for a server with sleep mode
                "full_sync_restores_discarded": not self.sleep_mode,
                "workers": self.world_size, "digests": self.options.digests,
                "reasons": self._reasons()}

    def worker_states(self) -> list[dict]:
        """Per vLLM worker of the server: the backend's state (version, torn, digests)."""
        return self._rpc("weightsync_transfer_state", phase="state")

    def weight_digests(self, kind: str = "full") -> dict:
        """``{"digests", "dtypes", "version", "live"}``: what the server's backend received
        in the last complete sync of the weights (hashed as it arrived, as the in-process
        vLLM replica does), with live digests of the parameters that read back exactly; for
        ``kind="adapter"``, of the adapter the workers hold in memory."""
        if kind not in WEIGHT_KINDS:
            raise ValueError(f"kind must be one of {WEIGHT_KINDS}, got {kind!r}")
        version = self.current_version()
        if self._fence.blocked:
            raise WeightSyncError(f"{self.name} holds no complete version: "
                                  f"{self._fence.blocked}", phase="verify", version=version)
        if kind == "adapter":
            return self._adapter_digests(version)
        weights = self._base_version
        states = self._rpc("weightsync_transfer_state", phase="verify", version=version)
        digests: dict[str, str] = {}
        for rank, s in enumerate(states):
            d = s.get("digests")
            if d is None:
                raise WeightSyncError(f"{self._who()} worker {rank} has no digests (no sync "
                                      "with digests completed since the server started, or "
                                      "VLLMServerOptions(digests=False))", phase="verify",
                                      version=version)
            if str(d["version"]) != str(weights):
                raise WeightSyncError(f"{self._who()} worker {rank}: digests of version "
                                      f"{d['version']!r}, the replica loaded {weights!r}",
                                      phase="verify", version=version)
            for name, value in {**d["digests"], **d["live"]}.items():
                if digests.setdefault(name, value) != value:
                    digests[name] = "workers-disagree"
        live = sorted(set.intersection(*(set(s["digests"]["live"]) for s in states)))
        return {"digests": digests, "dtypes": dict(states[0]["digests"]["dtypes"]),
                "version": version, "live": live}

    def _adapter_digests(self, version: Any) -> dict:
        if self._adapter is None:
            raise WeightSyncError(f"{self.name} has no LoRA adapter to verify",
                                  phase="verify", version=version)
        path = self._adapter["path"]
        replies = self._rpc("weightsync_adapter_digests", path, phase="verify",
                            version=version)
        return adapter_digests(replies, self._who(), path, version)

    # -- generation ---------------------------------------------------------------------
    def _check_prompts(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list:
        out = check_prompts(prompts, max_new_tokens, vocab_size=self.vocab_size,
                            max_model_len=self.max_model_len)
        if not out:
            raise ValueError("no prompts")
        return out

    def _check_ready(self) -> None:
        if self._dead:
            raise PeerFailed(f"{self._who()} is dead ({self._dead})", phase="generate",
                             version=self._version)
        check_may_generate(self.name, self._asleep, self._fence, self._version)

    def generate(self, prompts: Sequence[Sequence[int]], *, max_new_tokens: int = 16,
                 return_logits: bool = False, timeout: Optional[float] = None
                 ) -> list[Generation]:
        """Greedy continuations (token ids in, token ids out) through the server's
        ``/v1/completions``, each tagged with the version the server holds;
        ``return_logits``: raw logits [steps, vocab]."""
        prompts = self._check_prompts(prompts, max_new_tokens)
        if return_logits and not self.raw_logits:
            raise ValueError(f"{self.name}: return_logits needs a server started with "
                             "--logprobs-mode raw_logits --max-logprobs -1 (an owned server "
                             "is)")
        self.gate.enter(timeout)
        try:
            self._check_ready()
            before = self._served_version("generate", self._version)
            choices, aborted = self._complete(prompts, max_new_tokens, return_logits,
                                              timeout or self.options.timeout)
            after = self._served_version("generate", self._version)
            if before != after:
                raise WeightSyncError(f"{self.name}: the server's weight version changed from "
                                      f"{before!r} to {after!r} during one generation",
                                      phase="generate", version=self._version)
        finally:
            self.gate.exit()
        version = self._versions.get(before, None if before == "default" else before)
        return [self._to_generation(p, c, version, aborted, return_logits)
                for p, c in zip(prompts, choices)]

    def _complete(self, prompts: list, max_new_tokens: int, return_logits: bool,
                  timeout: float) -> tuple[list, bool]:
        """One ``/v1/completions`` request for all prompts, in a helper thread; a pause
        that aborts makes it abort its requests (``/abort_requests``) and return."""
        rid = f"ws-{self.name}-{next(self._ids)}"
        model = LORA_NAME if self._adapter is not None else self.model_id
        body: dict[str, Any] = {"model": model, "prompt": prompts,
                                "max_tokens": max_new_tokens, "temperature": 0.0,
                                "ignore_eos": True, "return_token_ids": True, "request_id": rid}
        if return_logits:
            body.update(logprobs=self.vocab_size, return_tokens_as_token_ids=True)
        call = _Background(lambda: self._http(
            lambda: self.client.request("POST", "/v1/completions", body, timeout=timeout),
            "/v1/completions", "generate", self._version), f"weightsync-{self.name}-generate")
        deadline = time.monotonic() + timeout + 5.0
        aborting = False
        while not call.done.wait(0.02):
            if self.gate.abort.is_set() and not call.done.is_set():
                aborting = True
                ids = [f"cmpl-{rid}-{i}" for i in range(len(prompts))]
                try:
                    self._http(lambda: self.client.request(
                        "POST", "/abort_requests", {"request_ids": ids}, timeout=10.0),
                        "/abort_requests", "generate", self._version)
                except WeightSyncError as exc:
                    logger.info("weightsync: %s: abort of a generation failed: %s",
                                self._who(), exc)
                call.done.wait(0.25)
            if time.monotonic() > deadline:
                raise SyncTimeout(f"{self._who()}: a generation did not return within "
                                  f"{timeout:.0f} s", phase="generate", version=self._version)
        if "error" in call.box:
            raise call.box["error"]
        choices = sorted(call.box["value"]["choices"], key=lambda c: c["index"])
        if len(choices) != len(prompts):
            raise PeerFailed(f"{self._who()}: {len(prompts)} prompts, {len(choices)} "
                             "completions", phase="generate", version=self._version)
        return choices, aborting

    def _to_generation(self, prompt: list, choice: dict, version: Any, aborted: bool,
                       return_logits: bool) -> Generation:
        tokens = [int(t) for t in (choice.get("token_ids") or [])]
        logits = None
        if return_logits:
            steps = (choice.get("logprobs") or {}).get("top_logprobs") or []
            logits = torch.full((len(steps), self.vocab_size), math.nan)
            for row, entry in enumerate(steps):
                for key, value in (entry or {}).items():
                    tid = int(str(key).rpartition(":")[2])
                    if 0 <= tid < self.vocab_size:
                        logits[row, tid] = float(value)
        return Generation(prompt=prompt, tokens=tokens, version=version, logits=logits,
                          aborted=aborted or choice.get("finish_reason") in _ABORTED)

    # -- lifecycle ----------------------------------------------------------------------
    def close(self) -> None:
        """Release the workers' engines and stop an owned server (idempotent, bounded)."""
        try:
            self._drop_pending()
            if self._joined is not None and not self._dead:
                self.engine_finalize()
        except Exception as exc:
            logger.warning("weightsync: %s: finalize failed: %s", self._who(), exc)
        server, self.server = self.server, None
        if server is not None:
            server.stop()
            self._dead = self._dead or "stopped by close()"
