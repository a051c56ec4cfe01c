"""The inference side of ``weightsync-<backend>``: a vLLM ``WeightTransferEngine``.

vLLM creates one per worker (``Worker.load_model``, from ``WeightTransferConfig.backend``)
and calls it from its worker methods, which the offline ``LLM`` and the HTTP endpoints
reach through ``collective_rpc``:

* ``init_transfer_engine(WeightsyncInitInfo)``: join the trainer's weightsync group with
  :func:`weightsync.connect` (role ``rollout``, this worker's rank across data parallel).
  The new group replaces the old one only once it is joined, so a failed init (wrong token,
  no trainer) leaves the previous connection as it was.
* ``start_weight_update``: opens a session (nothing of the model is touched).
* ``update_weights({"phase": "check", ...})``: validation before bytes. The weight set
  (names, shapes, wire dtypes) is checked against the checkpoint the model was started
  from (its safetensors headers; :func:`weightsync.rollout.vllm.checks.check_offered`, the
  check of :class:`~weightsync.rollout.vllm.VLLMRolloutReplica`): a full set, shapes equal,
  dtypes castable. A mismatch raises with the offending names; nothing was received.
* ``update_weights({"phase": "receive", "version": v})``: all or nothing. The whole version
  is received (each tensor checked against the accepted description and the checkpoint as
  it arrives, owned copies), checked complete, and only then handed to vLLM's loader in one
  layerwise-reload session (:func:`weightsync.rollout.vllm.apply.apply_weights`, with its
  completeness checks before the commit). A transport failure, a wrong tensor or a missing
  one raises before the model changes, and the old weights keep serving.
* ``finish_weight_update``: closes the session. The weight version is vLLM's own
  (``finish_weight_update(weight_version=...)`` sets it on the engine core), and the prefix
  cache is reset by the engine core right after (:mod:`.plugin`).

**Digests** (opt-in per update: ``digests=True`` in the check chunk; the server replica
:class:`~weightsync.rollout.vllm.server_replica.VLLMServerReplica` sets it): every tensor
is hashed as it arrives (cast to the dtype vLLM holds it in, as ``verify``'s trainer side
hashes), and :meth:`WeightsyncWeightTransferEngine.report` gives the digests of the last
complete version, plus live digests of the parameters that can be read back exactly
(embeddings, norms), as :class:`~weightsync.rollout.vllm.VLLMRolloutReplica` does. A
version received without digests drops the old ones.

**Errors** leave every entry point with weightsync's error marker appended to their text
(:func:`weightsync.rollout.vllm.serve.mark_error`: type, HTTP status, peer, phase,
version), since vLLM's RPC keeps only the text; the plugin's API-server side answers HTTP
requests with that status (:mod:`.plugin`), and clients rebuild the error from it. Calls
out of order raise :class:`SessionStateError` (HTTP 409).

**LoRA adapters** (``kind="adapter"`` in the check chunk, with ``adapter={"name",
"config"}``; vLLM started with ``--enable-lora``): the tensors are checked against the
checkpoint (``lora_A [r, in]`` / ``lora_B [out, r]`` of a 2-D weight, ``r`` within
``max_lora_rank``) and the config against vLLM's rules (``PEFTHelper.validate_legal``)
before a byte moves; the whole adapter is received, then held in this worker's memory
under its name and version (:func:`weightsync.rollout.vllm.lora.register`); the model's
weights are not touched and no file is written. The trainer then loads it through vLLM's
own LoRA API with the memory path the engine reports
(``weightsync-mem:<name>@<version>``): ``/v1/load_lora_adapter`` of ``vllm serve`` or
``add_lora`` offline (:meth:`~.trainer.WeightsyncTrainerEngine.send_adapter` does it all).
A failed adapter sync leaves the previous adapter loaded and serving.

Not covered: a failure *inside* vLLM's loader after the whole version passed every check
(never seen; it would leave layers of two versions, and this engine has no way to stop
vLLM from generating, so it logs an error and reports the model torn in ``state()``).
The loader's encoder and multimodal caches are not reset (vLLM's own engines do not
either); vLLM's worker drops loaded LoRA adapters after every update, and reloads them
from their path (a folder, or weightsync's memory) when a request names them.
"""

from __future__ import annotations

import collections
import functools
import logging
import os
import time
from typing import Any, Callable, Iterator, Optional

import torch
from vllm.distributed.weight_transfer.base import WeightTransferEngine

from weightsync.core.aio import AsyncRunner
from weightsync.core.errors import PlanMismatch
from weightsync.core.plan import dtype_name
from weightsync.integrations.vllm_native.info import (WeightsyncInitInfo, WeightsyncUpdateInfo,
                                                      weightsync_backend)
from weightsync.rollout.vllm.apply import (CheckedStream, apply_weights, checkpoint_header,
                                           pick_loader)
from weightsync.rollout.vllm.checks import calibrate_live, check_offered, live_digests
from weightsync.rollout.vllm.serve import mark_error
from weightsync.transport.rendezvous import TAKEN_OVER, connect, group_id

__all__ = ["WeightsyncWeightTransferEngine", "WorkerView", "SessionStateError"]

logger = logging.getLogger(__name__)


class SessionStateError(RuntimeError):
    """A weight-transfer call out of order (init during an update, update without a
    joined trainer, ...): HTTP 409 over the server."""


def _marked(fn: Callable) -> Callable:
    """Raise whatever ``fn`` raises with weightsync's error marker in its text."""
    @functools.wraps(fn)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(self, *args, **kwargs)
        except Exception as exc:
            raise mark_error(exc)
    return wrapper


class WorkerView:
    """The few attributes of a vLLM worker that :func:`apply_weights` reads, from what a
    weight-transfer engine is given (its model and configs; it never sees the worker)."""

    class _Runner:
        def __init__(self, model: torch.nn.Module) -> None:
            self._model = model

        def get_model(self) -> torch.nn.Module:
            return self._model

        def reset_lora_state(self) -> None:     # vLLM's own engines keep these as they are
            pass

        reset_encoder_cache = reset_mm_cache = reset_lora_state

    def __init__(self, engine: WeightTransferEngine) -> None:
        self.vllm_config, self.model_config = engine.vllm_config, engine.model_config
        self.device = engine.device
        self.model_runner = self._Runner(engine.model)


class _Session:
    def __init__(self) -> None:
        self.version: Any = None
        self.offer: Optional[dict[str, tuple[tuple[int, ...], str]]] = None
        self.digests = False
        self.adapter: Optional[dict] = None     # {"name", "config"} of an adapter sync
        self.applied: Any = None


class WeightsyncWeightTransferEngine(WeightTransferEngine[WeightsyncInitInfo,
                                                         WeightsyncUpdateInfo]):
    """See the module docstring."""

    init_info_cls = WeightsyncInitInfo
    update_info_cls = WeightsyncUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config: Any, vllm_config: Any, device: Any, model: Any) -> None:
        super().__init__(config, vllm_config, device, model)
        self.backend = weightsync_backend(config.backend)
        self.transport: Any = None
        self.group: Optional[str] = None     # group_id of the group joined
        self.runner = AsyncRunner("weightsync-vllm-native")
        self.session: Optional[_Session] = None
        self.version: Any = None
        self.torn: Optional[str] = None
        self.stats: dict = {}
        self.digests: Optional[dict] = None   # of the last complete version (see report)
        self._header: Any = False       # False: not read yet; None: no safetensors folder

    # -- identity -----------------------------------------------------------------------
    @property
    def rank(self) -> int:
        """This worker's rank among all vLLM workers (across data parallel)."""
        p = self.parallel_config
        return int(p.data_parallel_index) * int(p.world_size) + int(p.rank)

    @property
    def world_size(self) -> int:
        p = self.parallel_config
        return int(p.world_size) * int(p.data_parallel_size)

    @property
    def peer(self) -> str:
        return f"vllm worker {self.rank} (pid {os.getpid()})"

    def header(self) -> Optional[dict]:
        """``{name: (shape, safetensors dtype)}`` of the checkpoint the model started from."""
        if self._header is False:
            self._header = checkpoint_header(self.model_config.model)
        return self._header

    def state(self) -> dict:
        return {"backend": self.backend, "rank": self.rank, "connected": self.transport is not None,
                "version": self.version, "torn": self.torn, "stats": dict(self.stats)}

    def report(self) -> dict:
        """:meth:`state`, plus ``updating`` (a session is open) and ``digests``: None, or
        ``{"version", "digests", "dtypes", "live"}`` of the last complete version received
        with digests on (``live``: digests of the live parameters that read back exactly,
        hashed now)."""
        out = {**self.state(), "updating": self.session is not None, "digests": None}
        d = self.digests
        if d is not None and self.torn is None:
            header = self.header() or {}
            manifest = {n: shape for n, (shape, _) in header.items()}
            live = live_digests(self.model, d["live"], manifest, d["dtypes"]) if manifest else {}
            out["digests"] = {"version": d["version"], "digests": dict(d["digests"]),
                              "dtypes": dict(d["dtypes"]), "live": live}
        return out

    # -- lifecycle ----------------------------------------------------------------------
    @_marked
    def parse_init_info(self, init_dict: dict[str, Any]) -> WeightsyncInitInfo:
        return super().parse_init_info(init_dict)

    @_marked
    def init_transfer_engine(self, init_info: WeightsyncInitInfo) -> None:
        if weightsync_backend(init_info.backend) != self.backend:
            raise ValueError(f"the trainer asked for {init_info.backend!r}, but this vLLM "
                             f"runs weight_transfer_config backend {self.config.backend!r}")
        if init_info.rollout_world_size != self.world_size:
            raise ValueError(f"rollout_world_size is {init_info.rollout_world_size}, but this "
                             f"vLLM has {self.world_size} workers (see /get_world_size)")
        if self.session is not None:
            raise SessionStateError("init_weight_transfer_engine during a weight update")
        options = dict(init_info.engine)
        options.setdefault("device", str(self.device))
        joined = connect(self.backend, role="rollout", rank=self.rank,
                         trainer_world_size=init_info.trainer_world_size,
                         rollout_world_size=init_info.rollout_world_size,
                         address=init_info.address, token=init_info.token, **options)
        self._release()
        self.transport = joined
        self.group = group_id(init_info.token)
        logger.info("weightsync: %s joined the %s group of %s", self.peer, self.backend,
                    init_info.address)

    @_marked
    def start_weight_update(self) -> None:
        if self.transport is None:
            raise SessionStateError("weightsync: init_weight_transfer_engine first (no "
                                    "trainer group joined)")
        self.session = _Session()

    @_marked
    def update_weights(self, update_info: dict) -> None:
        # vLLM's base synchronizes torch.accelerator, which raises on CPU
        try:
            self.receive_weights(self.parse_update_info(update_info))
        except BaseException:
            self.session = None       # as vLLM's worker: a failed chunk ends the update
            raise
        if torch.accelerator.is_available():
            torch.accelerator.synchronize()

    def receive_weights(self, update_info: WeightsyncUpdateInfo) -> None:
        session = self.session
        if session is None or self.transport is None:
            raise SessionStateError("weightsync: update_weights without start_weight_update")
        if update_info.phase == "check":
            self._check(session, update_info)
        else:
            self._receive(session, update_info)

    @_marked
    def finish_weight_update(self) -> None:
        session, self.session = self.session, None
        if session is None or session.applied is None:
            logger.warning("weightsync: finish_weight_update without a version received in "
                           "this update; the model is unchanged")
            return
        self.version = session.applied

    @_marked
    def shutdown(self) -> None:
        if self.session is not None:
            raise SessionStateError("weightsync: shutdown during a weight update")
        self._release()

    def _release(self) -> None:
        transport, self.transport = self.transport, None
        if transport is not None:
            transport.finalize()

    # -- check --------------------------------------------------------------------------
    def _check(self, session: _Session, info: WeightsyncUpdateInfo) -> None:
        """Validation before bytes: the described set against the checkpoint."""
        if info.group is not None and info.group != self.group:
            raise SessionStateError(
                f"weightsync: {TAKEN_OVER} (/init_weight_transfer_engine) after yours "
                "joined, so its engine is in that client's group now; initialize again "
                "to take it back")
        offered = info.offered()
        seen: set = set()
        dupes = sorted({n for n, _, _ in offered if n in seen or seen.add(n)})
        if dupes:
            raise ValueError(f"weightsync: names described twice: {dupes[:8]}")
        max_rank = None
        if info.kind == "adapter":
            max_rank = self._check_adapter(info)
        header = self.header()
        if header is None:
            logger.warning("weightsync: %s was not started from a local safetensors folder; "
                           "the weight set is checked by vLLM's loader only",
                           self.model_config.model)
            problems: list = []
        else:
            problems = check_offered(header, offered, info.kind, self.model_config.dtype,
                                     max_rank)
        if problems:
            session.offer = None
            raise PlanMismatch(f"the weight set of version {info.version!r} does not fit the "
                               f"model ({len(problems)} problems, nothing was sent): "
                               f"{problems[:8]}", peer=self.peer, phase="validate",
                               version=info.version)
        session.version = info.version
        session.offer = {n: (tuple(s), d) for n, s, d in offered}
        session.digests = bool(info.digests)
        session.adapter = dict(info.adapter) if info.kind == "adapter" else None

    def _check_adapter(self, info: WeightsyncUpdateInfo) -> int:
        """vLLM runs LoRA and the adapter's config passes vLLM's rules; its max rank."""
        lora = self.vllm_config.lora_config
        if lora is None:
            raise PlanMismatch(f"an adapter sync of version {info.version!r} needs vLLM "
                               "started with LoRA (--enable-lora --max-lora-rank <r>); nothing "
                               "was sent", peer=self.peer, phase="validate",
                               version=info.version)
        from vllm.lora.peft_helper import PEFTHelper

        try:
            PEFTHelper.from_dict(dict(info.adapter["config"])).validate_legal(lora)
        except (ValueError, TypeError) as exc:
            raise PlanMismatch(f"the adapter config of version {info.version!r} does not fit "
                               f"this vLLM: {exc}; nothing was sent", peer=self.peer,
                               phase="validate", version=info.version) from None
        return int(lora.max_lora_rank)

    # -- receive + apply ----------------------------------------------------------------
    def _receive(self, session: _Session, info: WeightsyncUpdateInfo) -> None:
        version = info.version
        if session.offer is None or session.version != version:
            raise ValueError(f"weightsync: phase 'receive' of version {version!r} needs a "
                             "successful phase 'check' of that version in this update first "
                             "(validation before bytes)")
        if session.applied is not None:
            raise ValueError(f"weightsync: version {session.applied!r} was already received "
                             "in this update; finish_weight_update first")
        start = time.perf_counter()
        timeout = 2 * self.transport.config.timeout + 30
        items = self.runner.run(self._collect(version, session.offer), timeout=timeout,
                                phase="receive", version=version, peer=self.peer)
        header = None if session.adapter is not None else self.header()
        manifest = None if header is None else {n: s for n, (s, _) in header.items()}
        checked = CheckedStream(items, manifest, version=version, peer=self.peer, copy=False,
                                digest_dtype=self.model_config.dtype if session.digests else None)
        staged = collections.deque(checked)
        missing = sorted(set(session.offer) - checked.seen) or checked.missing()
        if missing:
            raise PlanMismatch(f"version {version!r} arrived without {len(missing)} tensors: "
                               f"{missing[:8]}; the model is unchanged", peer=self.peer,
                               phase="receive", version=version)
        received = time.perf_counter()
        if session.adapter is not None:
            self._hold_adapter(session, staged, version, checked, received - start)
            return
        try:
            info_ = apply_weights(WorkerView(self), _drain(staged), loader=pick_loader("auto"),
                                  version=version, peer=self.peer)
        except BaseException as exc:
            self.torn = f"vLLM's loader failed on version {version!r}: {exc}"
            self.digests = None
            logger.error("weightsync: %s; the model may hold layers of two versions",
                         self.torn)
            raise
        self.torn = None
        session.applied = version
        self.digests = None if not session.digests else {
            "version": version, "digests": checked.digests, "dtypes": checked.dtypes,
            "live": calibrate_live(self.model, checked.digests, manifest, checked.dtypes)}
        done = time.perf_counter()
        self.stats = {"version": version, "tensors": checked.count, "bytes": checked.nbytes,
                      "transport_seconds": received - start, "load_seconds": done - received,
                      **info_}

    def _hold_adapter(self, session: _Session, staged: Any, version: Any, checked: Any,
                      seconds: float) -> None:
        """Keep the complete adapter in this worker's memory (no file, the model as is)."""
        from weightsync.rollout.vllm import lora

        keep = max(lora.KEEP, 2 * int(getattr(self.vllm_config.lora_config, "max_cpu_loras",
                                              0) or 0))
        path = lora.register(session.adapter["name"], version, dict(staged),
                             session.adapter["config"], keep=keep)
        session.applied = version
        self.stats = {"version": version, "kind": "adapter", "tensors": checked.count,
                      "bytes": checked.nbytes, "transport_seconds": seconds,
                      "adapter_path": path}

    async def _collect(self, version: Any, offer: dict) -> list:
        """Every tensor of ``version`` as an owned copy, each checked against ``offer``."""
        out = []
        stream = self.transport.receive_weights(version)
        try:
            async for name, tensor in stream:
                want = offer.get(name)
                if want is None:
                    raise PlanMismatch(f"{name} arrived but was not in the described weight "
                                       "set", peer=self.peer, phase="receive", version=version)
                if tuple(tensor.shape) != want[0] or dtype_name(tensor.dtype) != want[1]:
                    raise PlanMismatch(f"{name}: {tuple(tensor.shape)} {tensor.dtype} arrived, "
                                       f"{want[0]} {want[1]} was described", peer=self.peer,
                                       phase="receive", version=version)
                out.append((name, tensor.clone(memory_format=torch.contiguous_format)))
        finally:
            await stream.aclose()       # on a failure this tells the senders at once
        return out


def _drain(queue: "collections.deque") -> Iterator:
    """Hand each staged tensor over and drop our reference (the loader keeps its own)."""
    while queue:
        yield queue.popleft()
