"""Ready-made workers for the demo and the tests (plain classes: wrap with ``ray.remote``
or use in-process).

:class:`ToyTrainerWorker`: one trainer rank; builds a causal LM from a config, optionally
wrapped with PEFT LoRA and sharded with FSDP2 (``fully_shard`` per decoder layer, gloo on
CPU), trains it with SGD on random tokens, and computes the reference a rollout must
match. :class:`HFRolloutWorker`: one :class:`~weightsync.rollout.hf.HFRolloutReplica`.
"""

from __future__ import annotations

import datetime
from typing import Any, Optional

import torch
import torch.distributed as dist

from weightsync.trainer.export import export_weights
from weightsync.integrations.ray.mixins import RolloutWorkerMixin, TrainerWorkerMixin

__all__ = ["ToyTrainerWorker", "HFRolloutWorker"]


class ToyTrainerWorker(TrainerWorkerMixin):
    def __init__(self, rank: int = 0, world: int = 1, *, threads: int = 1) -> None:
        torch.set_num_threads(threads)
        self.rank, self.world = rank, world
        self.model: Any = None
        self.optimizer: Any = None
        self._store: Any = None
        self._ref: Any = None
        self.log: list[str] = []

    # -- process group ----------------------------------------------------------------
    def dist_master(self) -> int:
        """Rank 0: host the TCPStore of the training group; returns its port."""
        self._store = dist.TCPStore("127.0.0.1", 0, self.world, True,
                                    timeout=datetime.timedelta(seconds=120),
                                    wait_for_workers=False)
        return self._store.port

    def dist_init(self, port: int, timeout: float = 120.0) -> None:
        if self._store is None:
            self._store = dist.TCPStore("127.0.0.1", port, self.world, False,
                                        timeout=datetime.timedelta(seconds=timeout))
        dist.init_process_group("gloo", store=self._store, rank=self.rank,
                                world_size=self.world, timeout=datetime.timedelta(seconds=timeout))

    # -- model ------------------------------------------------------------------------
    def build(self, config: dict, *, seed: int = 0, fsdp: bool = False,
              lora: Optional[dict] = None, lr: float = 0.05) -> dict:
        from weightsync.rollout.hf import build_causal_lm

        self.config, self.lr, self._ref = dict(config), lr, None
        model = build_causal_lm(config, seed=seed).train()
        if lora is not None:
            import peft

            torch.manual_seed(seed + 1)
            model = peft.get_peft_model(model, peft.LoraConfig(**lora))
        if fsdp:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh("cpu", (self.world,))
            inner = model.get_base_model() if lora is not None else model
            for layer in inner.model.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
        self.model, self.fsdp, self.lora = model, fsdp, lora
        params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.SGD(params, lr=lr)
        total = sum(p.numel() * p.element_size() for p in model.parameters())
        return {"bytes": total, "trainable": sum(p.numel() for p in params)}

    def weightsync_model(self) -> Any:
        return self.model

    def weightsync_offload(self) -> None:
        self.log.append("offload")
        self.optimizer.zero_grad(set_to_none=True)

    def weightsync_reload(self) -> None:
        self.log.append("reload")

    def call_log(self) -> list:
        return list(self.log)

    def train_step(self, step: int) -> float:
        from weightsync.testing.toymodel import random_batch

        self.model.train()
        ids = random_batch(step, self.rank, vocab_size=self.config["vocab_size"])
        loss = self.model(input_ids=ids, labels=ids).loss
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.log.append(f"train:{step}")
        return float(loss.detach())

    # -- reference --------------------------------------------------------------------
    def reference(self, prompts: list, max_new_tokens: int, *, lora_mode: str = "merged",
                  dtype: Optional[torch.dtype] = None, source: str = "export") -> Optional[dict]:
        """Greedy tokens and logits the rollout must reproduce (returned by rank 0).

        ``source="model"``: this (unsharded) model itself. ``source="export"``: a fresh HF
        model (and PEFT wrapper for ``lora_mode="adapter"``) loaded with PyTorch's and
        PEFT's own loaders from the gathered trainer weights, cast to ``dtype``; every rank
        must call it. For FSDP2 the sharded model's own forward is compared too
        (``trainer_max_abs_diff``).
        """
        from weightsync.rollout.hf import greedy_generate

        if source == "model":
            if self.fsdp:
                raise ValueError("source='model' needs an unsharded trainer model")
            tokens, logits, _ = greedy_generate(self.model.eval(), prompts, max_new_tokens)
            return {"tokens": tokens, "logits": logits}
        if source != "export":
            raise ValueError(f"source must be 'export' or 'model', got {source!r}")
        peft_on = self.lora is not None and lora_mode == "adapter"
        base_kind = "base" if peft_on else "full"
        base = dict(export_weights(self.model, kind=base_kind, dtype=dtype, owner=0))
        adapter = dict(export_weights(self.model, kind="adapter", dtype=dtype, owner=0)) \
            if peft_on else None
        sharded = self._sharded_logits(prompts) if self.fsdp else None
        if self.rank != 0:
            return None
        ref = self._reference_model(base, adapter, dtype)
        tokens, logits, _ = greedy_generate(ref, prompts, max_new_tokens)
        out = {"tokens": tokens, "logits": logits}
        if sharded is not None:
            with torch.no_grad():
                mine = ref(input_ids=torch.tensor(prompts)).logits.float()
            out["trainer_max_abs_diff"] = float((mine - sharded).abs().max())
        return out

    def _sharded_logits(self, prompts: list) -> torch.Tensor:
        """The FSDP2 model's own forward on the prompts (a collective: every rank)."""
        with torch.no_grad():
            logits = self.model.eval()(input_ids=torch.tensor(prompts)).logits.float()
        self.model.train()
        return logits

    def _reference_model(self, base: dict, adapter: Optional[dict], dtype) -> Any:
        from weightsync.rollout.hf import build_causal_lm, lora_config_from_dict

        ref = build_causal_lm(self.config, dtype=dtype or torch.float32)
        ref.load_state_dict(base, strict=True)
        if adapter is None:
            return ref
        import peft
        from peft import set_peft_model_state_dict

        from weightsync.trainer.lora import lora_config_dict

        cfg = lora_config_from_dict(lora_config_dict(self.model))
        wrapped = peft.get_peft_model(ref, cfg).eval()
        result = set_peft_model_state_dict(wrapped, adapter)
        if getattr(result, "unexpected_keys", None):
            raise RuntimeError(f"adapter keys PEFT did not expect: {result.unexpected_keys[:5]}")
        return wrapped


class HFRolloutWorker(RolloutWorkerMixin):
    def __init__(self, config: dict, *, dtype: Optional[torch.dtype] = None, seed: int = 1234,
                 name: str = "hf", threads: int = 1, timeout: float = 120.0,
                 share_memory: bool = False) -> None:
        from weightsync.rollout.hf import HFRolloutReplica

        torch.set_num_threads(threads)
        self._args = dict(dtype=dtype or torch.float32, name=name, timeout=timeout,
                          share_memory=share_memory)
        self.rollout = HFRolloutReplica(config=config, seed=seed, **self._args)

    def reset(self, config: dict, *, seed: int = 1234,
              share_memory: Optional[bool] = None) -> None:
        """A fresh replica (new random weights, no adapter, awake, no version);
        ``share_memory``: its weights in shared memory or not (None: as before)."""
        from weightsync.rollout.hf import HFRolloutReplica

        if share_memory is not None:
            self._args["share_memory"] = share_memory
        old, self.rollout = self.rollout, HFRolloutReplica(config=config, seed=seed, **self._args)
        old.close()
