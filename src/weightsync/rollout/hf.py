"""A real rollout replica on HF transformers: ``model.generate`` with versioned outputs.

:class:`HFRolloutReplica` receives weights through a checkpoint engine hosted in its own
process (see :class:`~weightsync.rollout.protocol.LocalEngineRollout`) and

* copies full/base weights into its model under HF names (a PEFT wrapper's
  ``base_layer`` names are mapped), checking that a full sync covered every tensor;
* hosts a LoRA adapter received as tensors plus its PEFT config (JSON): the model is
  wrapped with PEFT, the adapter's tensors are copied in, and generation runs through the
  PEFT model, so the adapter is really used; a later full (merged) sync removes it;
* tags every :class:`~weightsync.rollout.protocol.Generation` with the version it used;
  weights never change during a generation (loads pause generation first, and
  ``pause(abort=True)`` stops running generations at the next token), and it never
  generates with a partly applied version (:class:`~weightsync.rollout.protocol.SyncFence`);
* checks a weight set against its model before any byte moves (``check_weights``) and
  hashes its weights for ``CheckpointEngineManager.verify`` (``weight_digests``);
* sleeps at vLLM's levels (1: weights copied to host and freed, 2: discarded) and wakes
  per tag (``weights``, ``kv_cache``); generation needs both awake. HF's ``generate``
  builds its KV cache per call and keeps none, so ``kv_cache`` sleep only gates
  generation and ``reset_caches`` has nothing stale to drop;
* stages full syncs for atomic updates (``begin_sync(..., staged=True)``): it receives
  into a :class:`~weightsync.rollout.parking.WeightStaging` copy (one copy of the weights)
  and swaps it in on ``commit_sync``; ``abort_sync`` drops it or swaps the old weights
  back, ``release_sync`` frees the old copy. Its live weights and fence stay as they are
  until the commit. Adapter syncs are not staged (they build PEFT layers into the model).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any, AsyncIterator, Optional, Sequence

import torch

from weightsync.core.errors import PlanMismatch, WeightSyncError
from weightsync.core.digests import check_weight_set, tensor_digest
from weightsync.core.plan import dtype_name
from weightsync.trainer.lora import adapter_name, hf_name, is_lora_param
from weightsync.rollout.parking import StagedSync, WeightParking, WeightStaging
from weightsync.rollout.protocol import (SLEEP_LEVELS, WEIGHT_KINDS, Generation, GenerationGate, LocalEngineRollout,
                   check_tags)

__all__ = ["HFRolloutReplica", "build_causal_lm", "greedy_generate", "lora_config_from_dict"]


def build_causal_lm(config: Any, *, dtype: torch.dtype = torch.float32, seed: Optional[int] = None,
                    device: str = "cpu") -> torch.nn.Module:
    """A causal LM built from a config (an HF config object or its ``to_dict()``), no download."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if isinstance(config, dict):
        data = dict(config)
        model_type = data.pop("model_type", None)
        if not model_type:
            raise ValueError("config dict needs 'model_type' (use PretrainedConfig.to_dict())")
        config = AutoConfig.for_model(model_type, **data)
    if seed is not None:
        torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    return model.to(device=device, dtype=dtype).eval()


class _Abort:
    """A stopping criterion that ends generation when ``event`` is set."""

    def __init__(self, event: Any) -> None:
        self.event = event
        self.fired = False

    def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
        stop = self.event is not None and self.event.is_set()
        self.fired = self.fired or stop
        return torch.full((input_ids.shape[0],), stop, dtype=torch.bool, device=input_ids.device)


def greedy_generate(model: torch.nn.Module, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                    *, abort: Any = None) -> tuple[list[list[int]], list[torch.Tensor], bool]:
    """Greedy continuation of each prompt: (new tokens, raw logits [steps, vocab], aborted).

    Prompts of equal length run as one batch. The same function serves as the reference on
    the trainer side, so both sides run the very same computation.
    """
    from transformers import StoppingCriteriaList

    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    device = next(model.parameters()).device
    by_len: dict[int, list[int]] = {}
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise ValueError("prompts must not be empty")
        by_len.setdefault(len(p), []).append(i)
    tokens: list = [None] * len(prompts)
    logits: list = [None] * len(prompts)
    stop = _Abort(abort)
    with torch.no_grad():
        for length, idx in by_len.items():
            ids = torch.tensor([list(prompts[i]) for i in idx], dtype=torch.long, device=device)
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                 max_new_tokens=max_new_tokens, do_sample=False,
                                 output_logits=True, return_dict_in_generate=True,
                                 stopping_criteria=StoppingCriteriaList([stop]),
                                 pad_token_id=0)
            steps = torch.stack(list(out.logits), dim=1)  # [batch, steps, vocab]
            for row, i in enumerate(idx):
                tokens[i] = out.sequences[row, length:].tolist()
                logits[i] = steps[row].float().cpu() if steps.dtype != torch.float32 \
                    else steps[row].cpu()
    return tokens, logits, stop.fired


def lora_config_from_dict(data: dict) -> Any:
    import peft

    if not isinstance(data, dict):
        raise ValueError(f"adapter_config must be a dict (PEFT's JSON), got {type(data).__name__}")
    names = {f.name for f in dataclasses.fields(peft.LoraConfig) if f.init}
    kwargs = {k: v for k, v in data.items() if k in names}
    kwargs["inference_mode"] = True
    return peft.LoraConfig(**kwargs)


class HFRolloutReplica(StagedSync, LocalEngineRollout):
    """One HF transformers replica (see the module docstring)."""

    def __init__(self, model: Optional[torch.nn.Module] = None, *, config: Any = None,
                 dtype: torch.dtype = torch.float32, device: str = "cpu",
                 seed: Optional[int] = None, name: str = "hf", timeout: float = 120.0,
                 share_memory: bool = False) -> None:
        super().__init__(name=name, device=device)
        if not isinstance(share_memory, bool):
            raise ValueError(f"share_memory must be a bool, got {share_memory!r}")
        if share_memory and torch.device(device).type != "cpu":
            raise ValueError("share_memory=True is for a CPU replica (its weights in shared "
                             f"host memory), not device={device!r}")
        if (model is None) == (config is None):
            raise ValueError("pass exactly one of model= or config=")
        if not isinstance(timeout, (int, float)) or timeout <= 0:
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        self.model = model.eval() if model is not None else build_causal_lm(
            config, dtype=dtype, seed=seed, device=device)
        self._peft: Any = None
        self._adapter_config: Optional[dict] = None
        self._version: Any = None
        self._kv_asleep = False
        # weights in shared memory: a trainer on this host writes syncs straight into them
        # (shm pushes); staging copies and re-allocated weights are shared too
        self.share_memory = share_memory
        if share_memory:
            self.model.share_memory()
        self._parking = WeightParking(share=share_memory)
        self._staging: Optional[WeightStaging] = None     # the atomic sync in progress
        self._stage_lock = threading.Lock()
        self.gate = GenerationGate(timeout)

    # -- state --------------------------------------------------------------------------
    def current_version(self) -> Any:
        return self._version


    def has_adapter(self) -> bool:
        return self._peft is not None

    def capabilities(self) -> dict:
        return {"name": "hf", "sleep_levels": list(SLEEP_LEVELS), "lora": True,
                "kinds": ["full", "base", "adapter"], "full_sync_restores_discarded": True,
                "staged_kinds": ["full"], "staging": "one copy of the weights",
                "reasons": {"atomic": "adapter syncs build PEFT layers into the live model, "
                                      "which a staged sync cannot roll back"}}

    def _stage_refusal(self, kinds: list) -> Optional[str]:
        if any(k != "full" for k in kinds):
            return f"{kinds} syncs: {self.capabilities()['reasons']['atomic']}"
        if self._peft is not None:
            return "it holds a LoRA adapter, which a full sync removes for good"
        return None

    def _state(self) -> dict[str, torch.Tensor]:
        return self.model.state_dict(keep_vars=True)

    def _base_targets(self) -> dict[str, torch.Tensor]:
        return {hf_name(n): t for n, t in self._state().items() if not is_lora_param(n)}

    def _adapter_targets(self) -> dict[str, torch.Tensor]:
        return {adapter_name(n, "default"): p for n, p in self._peft.named_parameters()
                if is_lora_param(n)}

    # -- generation control -------------------------------------------------------------
    def sleep(self, level: int = 1) -> None:
        if level not in SLEEP_LEVELS:
            raise ValueError(f"sleep level must be one of {SLEEP_LEVELS}, got {level!r}")
        self._record(f"sleep:{level}")
        paused_here = not self.gate.paused
        if paused_here:      # never pull weights from under a running generation
            self.gate.pause(abort=False)
        try:
            self._parking.park(self._state(), level)
            self._kv_asleep = True
        finally:
            if paused_here:
                self.gate.resume()

    def wake_up(self, tags: Optional[Sequence[str]] = None) -> None:
        tags = check_tags(tags)
        self._record("wake_up:" + ",".join(tags))
        if "weights" in tags:
            self._parking.restore()
        if "kv_cache" in tags:
            self._kv_asleep = False

    def reset_caches(self) -> None:
        self._record("reset_caches")

    def is_sleeping(self) -> dict:
        return {"weights": self._parking.asleep, "kv_cache": self._kv_asleep}

    def _check_ready(self) -> None:
        if self._parking.asleep or self._kv_asleep:
            raise WeightSyncError(f"{self.name} is asleep ({self.is_sleeping()}); wake_up first",
                                  phase="generate", version=self._version)
        if self._fenced:
            raise WeightSyncError(f"{self.name} refuses to generate: {self._fenced}",
                                  phase="generate", version=self._version)
        lost = self._parking.unrestored(self._state())
        if lost:
            raise PlanMismatch(f"{len(lost)} weights discarded by sleep(level=2) were not "
                               f"restored by a sync: {lost[:5]}", phase="generate",
                               version=self._version)

    def generate(self, prompts: Sequence[Sequence[int]], *, max_new_tokens: int = 16,
                 return_logits: bool = False, timeout: Optional[float] = None) -> list[Generation]:
        """Greedy continuations, each tagged with the weight version that produced it."""
        self.gate.enter(timeout)
        try:
            self._check_ready()
            version = self._version
            model = self._peft if self._peft is not None else self.model
            tokens, logits, aborted = greedy_generate(model, prompts, max_new_tokens,
                                                      abort=self.gate.abort)
            if self._version != version or self._fenced:   # the gate makes this impossible
                raise WeightSyncError(f"{self.name}: weights changed during a generation",
                                      phase="generate", version=version)
        finally:
            self.gate.exit()
        return [Generation(prompt=list(p), tokens=t, version=version, aborted=aborted,
                           logits=lg if return_logits else None)
                for p, t, lg in zip(prompts, tokens, logits)]

    # -- checks -------------------------------------------------------------------------
    def _weight_targets(self, kind: str, adapter_config: Optional[dict] = None
                        ) -> Optional[dict[str, torch.Tensor]]:
        if kind not in WEIGHT_KINDS:
            raise ValueError(f"kind must be one of {WEIGHT_KINDS}, got {kind!r}")
        if kind != "adapter":
            return self._base_targets()
        if self._peft is not None and adapter_config in (None, self._adapter_config):
            return self._adapter_targets()
        return None          # the adapter's layers do not exist yet

    def check_weights(self, offered: list, *, kind: str = "full",
                      adapter_config: Optional[dict] = None) -> list[list[str]]:
        """Problems (``[name, why]`` per offending tensor) of loading ``offered`` ([name, shape, dtype]
        per tensor) as ``kind``; nothing is changed."""
        targets = self._weight_targets(kind, adapter_config)
        if targets is None:
            return self._check_new_adapter(offered)
        return check_weight_set(targets, offered, complete=True)

    def _check_new_adapter(self, offered: list) -> list[list[str]]:
        """LoRA tensors for an adapter not built yet: each must sit on a Linear of the
        model, lora_A [r, in_features] and lora_B [out_features, r], floating point."""
        problems = []
        for name, shape, dtype in offered:
            part = ".lora_A.weight" if name.endswith(".lora_A.weight") else (
                ".lora_B.weight" if name.endswith(".lora_B.weight") else None)
            path = name[len("base_model.model."):] if name.startswith("base_model.model.") \
                else name
            try:
                module = self.model.get_submodule(path[: -len(part)]) if part else None
            except AttributeError:
                module = None
            base = getattr(module, "base_layer", module)
            if not hasattr(base, "in_features"):
                problems.append([name, "not a LoRA tensor of a Linear layer of the model"])
                continue
            dim = base.in_features if part == ".lora_A.weight" else base.out_features
            axis = 1 if part == ".lora_A.weight" else 0
            if len(shape) != 2 or shape[axis] != dim:
                problems.append([name, f"shape {tuple(shape)} does not fit the layer "
                                       f"({base.in_features} -> {base.out_features})"])
            elif not dtype.startswith(("float", "bfloat")):
                problems.append([name, f"dtype {dtype} sent, LoRA tensors are floating point"])
        return problems

    def weight_digests(self, kind: str = "full") -> dict:
        """``{"digests": {name: xxh3}, "dtypes": {name: dtype}}`` of the weights of ``kind``
        (tied tensors once, under their first name, as the trainer exports them)."""
        if self._parking.asleep:
            raise WeightSyncError(f"{self.name} is asleep; wake_up before verify",
                                  phase="verify", version=self._version)
        targets = self._weight_targets(kind) or {}
        seen, digests, dtypes = set(), {}, {}
        with torch.no_grad():
            for name, t in targets.items():
                if id(t) in seen:
                    continue
                seen.add(id(t))
                digests[name] = tensor_digest(t)
                dtypes[name] = dtype_name(t.dtype)
        return {"digests": digests, "dtypes": dtypes, "version": self._version}

    # -- weights ------------------------------------------------------------------------
    async def load_weights(self, weights: AsyncIterator, *, version: Any, kind: str,
                           adapter_config: Optional[dict]) -> dict:
        if self._parking.asleep:
            raise WeightSyncError(f"{self.name}: wake_up(['weights']) before loading weights",
                                  phase="receive", version=version)
        paused_here = not self.gate.paused
        if paused_here:
            self.gate.pause(abort=False)
        start = time.perf_counter()
        self._fence.start_round(version, kind)   # also when called without engine_receive
        extra = {}
        try:
            staging = self._staging_of(version)
            if staging is not None:          # atomic: into the copy, the live weights stay
                count, nbytes = await self._copy_in(
                    weights, staging.targets(self._base_targets()), version)
                staging.missing.discard(kind)
                extra["staged_bytes"] = staging.nbytes
            else:
                if kind == "adapter":
                    targets = self._prepare_adapter(adapter_config, version)
                else:
                    if kind == "full" and self._peft is not None:
                        self._drop_adapter()
                    targets = self._base_targets()
                count, nbytes = await self._copy_in(weights, targets, version)
                self._version = version
            self._fence.round_done(version, kind)
        finally:
            if paused_here:
                self.gate.resume()
        return {"tensors": count, "bytes": nbytes, "seconds": time.perf_counter() - start,
                "version": version, "kind": kind, "adapter": self._peft is not None, **extra}

    async def _copy_in(self, weights: AsyncIterator, targets: dict[str, torch.Tensor],
                       version: Any) -> tuple[int, int]:
        got: set[int] = set()
        count = nbytes = 0
        land = getattr(weights, "land_in", None)
        landed: dict[str, torch.Tensor] = {}
        if land is not None:   # the engine writes straight into the weights (receive_into)
            landed = {name: t.detach() for name, t in targets.items()}
            land(landed)
        async for name, tensor in weights:
            dst = targets.get(name)
            if dst is None:
                raise PlanMismatch(f"{self.name} has no tensor named {name!r}",
                                   phase="receive", version=version)
            if tuple(dst.shape) != tuple(tensor.shape):
                raise PlanMismatch(f"{name}: shape {tuple(tensor.shape)} sent, the model has "
                                   f"{tuple(dst.shape)}", phase="receive", version=version)
            if tensor is not landed.get(name):   # else already in place
                with torch.no_grad():
                    dst.data.copy_(tensor)
            self._parking.loaded(dst)
            got.add(id(dst))
            count += 1
            nbytes += tensor.numel() * tensor.element_size()
        missing = sorted({n for n, t in targets.items() if id(t) not in got})
        if missing:
            raise PlanMismatch(f"the sync left {len(missing)} tensors of {self.name} unwritten: "
                               f"{missing[:8]}", phase="receive", version=version)
        return count, nbytes

    def _prepare_adapter(self, config: Optional[dict], version: Any) -> dict[str, torch.Tensor]:
        if config is None:
            if self._adapter_config is None:
                raise PlanMismatch(f"{self.name}: an adapter sync needs the PEFT config first",
                                   phase="receive", version=version)
            config = self._adapter_config
        if self._peft is not None and config != self._adapter_config:
            self._drop_adapter()
        if self._peft is None:
            import peft

            self._peft = peft.get_peft_model(self.model, lora_config_from_dict(config)).eval()
            self._adapter_config = dict(config)
        return self._adapter_targets()

    def _drop_adapter(self) -> None:
        """Remove the LoRA layers (unmerged: base weights stay as they are)."""
        self.model = self._peft.unload().eval()
        self._peft = None
        self._adapter_config = None
