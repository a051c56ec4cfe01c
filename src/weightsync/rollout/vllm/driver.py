"""Driver side of the vLLM replica: starting ``vllm.LLM``, bounded calls into it, the
JSON RPC to the worker extension, and greedy generation with versions read from vLLM's
outputs. :class:`~weightsync.rollout.vllm.VLLMRolloutReplica` builds on :class:`VLLMDriver`.

Whether the replica may generate is decided here, by one
:class:`~weightsync.rollout.protocol.SyncFence` (``_fence``); the workers' own flag
(:mod:`weightsync.rollout.vllm.extension`) only reports a torn model back to it.
"""

from __future__ import annotations

import collections
import itertools
import json
import logging
import os
import threading
import time
from typing import Any, Optional, Sequence

import torch

from weightsync.core.errors import PeerFailed, SyncTimeout, WeightSyncError
from weightsync.rollout.vllm.util import (EXTENSION, VLLMOptions, check_prompts, env_set, error_from_reply, host_process_kept,
                         max_positions)
from weightsync.rollout.protocol import Generation, GenerationGate, ReplicaControls, SyncFence

__all__ = ["VLLMDriver"]

logger = logging.getLogger(__name__)


class VLLMDriver(ReplicaControls):
    """Starts the LLM, talks to the worker extension, generates (see :mod:`.replica`)."""

    def __init__(self, model: Optional[str] = None, *, llm: Any = None, dtype: Any = "float32",
                 seed: int = 0, name: str = "vllm", options: Optional[VLLMOptions] = None,
                 **llm_kwargs: Any) -> None:
        if (model is None) == (llm is None):
            raise ValueError("pass exactly one of model= (a local HF folder) or llm=")
        self.name = name
        self.options = options if options is not None else VLLMOptions()
        if not isinstance(self.options, VLLMOptions):
            raise ValueError(f"options must be a VLLMOptions, got {type(self.options).__name__}")
        self.gate = GenerationGate(self.options.timeout)
        self._lock = threading.RLock()
        self._log: collections.deque = collections.deque(maxlen=2000)
        self._ids = itertools.count()
        self._stash: dict[str, list] = {}
        self._live: set[str] = set()
        self._version: Any = None
        self._versions: dict[str, Any] = {}
        self._fence = SyncFence()               # the one "may it generate" (see the doc)
        self._base_version: Any = None          # of the last full/base load
        self._asleep = {"weights": False, "kv_cache": False}
        self._discarded = False
        self._lora_request: Any = None
        self._adapter_cfg: Optional[dict] = None
        self._sync_timeout = 2 * self.options.timeout + 60
        self._dead: Optional[str] = None
        self.multiprocess = self.options.multiprocess if llm is None else None
        self.llm = llm if llm is not None else self._start(model, dtype, seed, llm_kwargs)
        self._read_engine()

    # -- start ------------------------------------------------------------------------
    def _start(self, model: str, dtype: Any, seed: int, llm_kwargs: dict) -> Any:
        if not isinstance(model, str) or not os.path.isdir(model):
            raise ValueError(f"model must be a local HF model folder, got {model!r}")

        o = self.options
        dtype = str(dtype).replace("torch.", "")
        has_tok = any(os.path.exists(os.path.join(model, f))
                      for f in ("tokenizer.json", "tokenizer_config.json", "vocab.json"))
        max_len = min(o.max_model_len, max_positions(model) or o.max_model_len)
        kwargs: dict[str, Any] = dict(
            model=model, dtype=dtype, seed=seed, enforce_eager=o.enforce_eager,
            max_model_len=max_len, max_num_seqs=o.max_num_seqs, max_num_batched_tokens=max_len, kv_cache_memory_bytes=o.kv_cache_bytes,
            skip_tokenizer_init=not has_tok, logprobs_mode="raw_logits", max_logprobs=-1,
            worker_extension_cls=EXTENSION)
        if o.enable_lora:
            kwargs.update(enable_lora=True, max_lora_rank=o.max_lora_rank, max_loras=1)
        kwargs.update(llm_kwargs)
        with env_set("VLLM_ENABLE_V1_MULTIPROCESSING", "1" if o.multiprocess else "0"), \
                host_process_kept(not o.multiprocess):
            import vllm.envs
            from vllm import LLM

            vllm.envs.disable_envs_cache()   # a previous in-process engine froze the env
            return LLM(**kwargs)

    def _read_engine(self) -> None:
        from vllm.platforms import current_platform

        config = self.llm.llm_engine.vllm_config
        self.platform = str(current_platform.device_type or "unknown")
        self.sleep_mode = bool(config.model_config.enable_sleep_mode)
        self.lora_enabled = config.lora_config is not None
        self.vocab_size = int(config.model_config.get_vocab_size())
        self.max_model_len = int(config.model_config.max_model_len)
        if current_platform.is_sleep_mode_available():
            why = "the LLM was started without enable_sleep_mode=True"
        else:
            why = f"vLLM has no sleep mode on the {self.platform} platform"
        self._sleep_reason = (f"{why}: sleep() pauses generation and drops the prefix cache "
                              "but frees no memory")
        self.world_size = len(self._rpc("weightsync_state", phase="start"))

    def _lora_unsupported(self) -> Optional[str]:
        if self.lora_enabled:
            return None
        return (f"{self.name}: vLLM was started without LoRA support (enable_lora, i.e. "
                "VLLMOptions(enable_lora=True)), so an adapter-only sync cannot be applied; "
                "start it with LoRA or sync merged weights (merge_and_sync=True)")

    # -- RPC --------------------------------------------------------------------------
    def _rpc(self, method: str, *args: Any, phase: str, version: Any = None,
             timeout: Optional[float] = None) -> list:
        """``collective_rpc`` with JSON arguments; one value per worker, or the first
        worker error re-raised as the matching exception."""
        try:
            json.dumps(args)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{method}: vLLM worker RPC arguments must be JSON-able "
                             f"(never tensors): {exc}") from None
        limit = timeout or self.options.timeout
        replies = self._bounded(lambda: self.llm.collective_rpc(method, timeout=limit, args=args),
                                f"collective_rpc({method})", limit, phase, version)
        out = []
        for rank, reply in enumerate(replies):
            if not isinstance(reply, dict) or "ok" not in reply:
                raise PeerFailed(f"vLLM worker {rank} answered {method} with {reply!r:.200} "
                                 "(was the LLM started with the weightsync worker extension?)",
                                 peer=self.name, phase=phase, version=version)
            if not reply["ok"]:
                raise error_from_reply(reply["error"], phase=phase, version=version,
                                       peer=f"{self.name} worker {rank}")
            out.append(reply["value"])
        return out

    def _bounded(self, fn: Any, what: str, timeout: float, phase: str, version: Any) -> Any:
        """Run one call into vLLM, bounded: vLLM's client waits without a limit for a
        dead engine core, so the call runs in a helper thread and a dead or silent engine
        becomes ``PeerFailed``/``SyncTimeout`` (and the replica is marked dead)."""
        if self._dead:
            raise PeerFailed(f"{self.name} is dead: {self._dead}", peer=self.name,
                             phase=phase, version=version)
        box: dict = {}
        done = threading.Event()

        def run() -> None:
            try:
                box["value"] = fn()
            except BaseException as exc:  # re-raised in the caller
                box["error"] = exc
            finally:
                done.set()

        with self._lock:
            threading.Thread(target=run, daemon=True, name=f"weightsync-{self.name}-call").start()
            deadline = time.monotonic() + timeout + 5.0
            while not done.wait(0.2):
                if self._engine_dead():
                    self._dead = "the vLLM engine core died"
                    raise PeerFailed(f"{what}: {self._dead}", peer=self.name, phase=phase,
                                     version=version)
                if time.monotonic() > deadline:
                    self._dead = f"vLLM did not answer {what} within {timeout:.0f} s"
                    raise SyncTimeout(self._dead, peer=self.name, phase=phase, version=version)
        if "error" in box:
            exc = box["error"]
            if self._engine_dead():
                self._dead = "the vLLM engine core died"
            if isinstance(exc, WeightSyncError):
                raise exc
            raise PeerFailed(f"{what} failed: {type(exc).__name__}: {exc}", peer=self.name,
                             phase=phase, version=version) from exc
        return box["value"]

    def _call(self, fn: Any, what: str, phase: str, version: Any = None) -> Any:
        return self._bounded(fn, what, self.options.timeout, phase, version)

    def _engine_dead(self) -> bool:
        client = getattr(getattr(self.llm, "llm_engine", None), "engine_core", None)
        return bool(getattr(getattr(client, "resources", None), "engine_dead", False))

    # -- state ------------------------------------------------------------------------
    def current_version(self) -> Any:
        return self._version

    def _committed(self, version: Any) -> None:
        self._version = version
        self._versions[str(version)] = version
        self._call(lambda: self.llm.llm_engine.set_weight_version(str(version)),
                   "set_weight_version", "load", version)

    def close(self) -> None:
        """Finalize the hosted engines and shut vLLM down (idempotent)."""
        if self.llm is None:
            return
        try:
            self._rpc("weightsync_finalize", phase="finalize", timeout=60.0)
        except Exception as exc:
            logger.warning("weightsync: finalize in the vLLM workers failed: %s", exc)
        llm, self.llm = self.llm, None
        try:
            llm.llm_engine.engine_core.shutdown()
        except Exception as exc:  # pragma: no cover - shutdown is best effort
            logger.warning("weightsync: vLLM shutdown failed: %s", exc)

    # -- generation -------------------------------------------------------------------
    def _check_prompts(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list:
        out = check_prompts(prompts, max_new_tokens, vocab_size=self.vocab_size,
                            max_model_len=self.max_model_len)
        return out

    def _generate(self, prompts: list, max_new_tokens: int, return_logits: bool) -> list:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens, ignore_eos=True,
                                detokenize=False, logprobs=-1 if return_logits else None,
                                output_kind=RequestOutputKind.DELTA)
        engine = self.llm.llm_engine
        ids, acc = [], {}
        with self._lock:
            for p in prompts:
                rid = f"ws-{self.name}-{next(self._ids)}"
                engine.add_request(rid, self._engine_input(p), params,
                                   lora_request=self._lora_request)
                ids.append(rid)
                acc[rid] = {"tokens": [], "logprobs": [], "spans": None, "done": False}
                self._live.add(rid)
        aborted = False
        try:
            aborted = self._drive(ids, acc)
        finally:
            with self._lock:
                self._live.difference_update(ids)
                for rid in ids:
                    self._stash.pop(rid, None)
        return [self._to_generation(p, acc[rid], aborted, return_logits)
                for p, rid in zip(prompts, ids)]

    def _engine_input(self, prompt: list) -> Any:
        raw = {"prompt_token_ids": prompt}
        render = getattr(self.llm, "_preprocess_cmpl_one", None)   # vLLM >= 0.32 renders
        return render(raw) if render is not None else raw

    def _drive(self, ids: list, acc: dict) -> bool:
        """Step the engine until our requests finish (True if aborted by ``pause``)."""
        engine = self.llm.llm_engine
        while True:
            with self._lock:
                for rid in ids:
                    for out in self._stash.pop(rid, []):
                        self._accumulate(acc[rid], out)
                if all(acc[rid]["done"] for rid in ids):
                    return False
                if self.gate.abort.is_set():
                    engine.abort_request([rid for rid in ids if not acc[rid]["done"]])
                    return True
                if not engine.has_unfinished_requests():
                    raise WeightSyncError(f"{self.name}: vLLM dropped requests {ids}",
                                          phase="generate", version=self._version)
                for out in engine.step():
                    if out.request_id in self._live:
                        self._stash.setdefault(out.request_id, []).append(out)

    @staticmethod
    def _accumulate(state: dict, out: Any) -> None:
        comp = out.outputs[0]
        state["tokens"].extend(comp.token_ids)
        if comp.logprobs:
            state["logprobs"].extend(comp.logprobs)
        if out.finished:
            state["done"] = True
            state["spans"] = comp.weight_versions

    def _to_generation(self, prompt: list, state: dict, aborted: bool,
                       return_logits: bool) -> Generation:
        spans = state["spans"] or []
        names = {s.version for s in spans}
        if len(names) > 1:
            raise WeightSyncError(f"{self.name}: one generation mixed weight versions "
                                  f"{sorted(names)}", phase="generate", version=self._version)
        version = self._versions.get(names.pop(), None) if names else self._version
        logits = None
        if return_logits:
            logits = torch.full((len(state["logprobs"]), self.vocab_size), float("nan"))
            for row, entry in enumerate(state["logprobs"]):
                ids = torch.tensor(list(entry.keys()), dtype=torch.long)
                vals = torch.tensor([lp.logprob for lp in entry.values()], dtype=torch.float32)
                keep = ids < self.vocab_size
                logits[row, ids[keep]] = vals[keep]
        return Generation(prompt=prompt, tokens=list(state["tokens"]), version=version,
                          aborted=aborted or not state["done"], logits=logits)
