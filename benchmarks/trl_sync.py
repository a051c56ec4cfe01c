"""TRL's per-step weight sync through weightsync into a real ``vllm serve`` (CPU), one run.

For each model (``benchmarks/vllm_sync.py``'s ``demo`` and ``0.5b``: the Qwen2.5-0.5B
shapes, untied; random weights, ``--dtype``) this starts one ``vllm serve`` with
``weightsync-shm`` and times, ``--repeats`` syncs each (the first one cold, left out of
the medians), every tensor changed before each sync (``neg_()``):

* ``grpo``: ``GRPOTrainer(use_vllm=True, vllm_mode="server")`` after
  ``weightsync.integrations.trl.patch_vllm_client()``; the time of
  ``trainer.vllm_generation.sync_weights()``, what GRPOTrainer runs (and profiles as
  ``sync_weights``) before each step's generation: TRL's parameter walk, weightsync's
  sync, TRL's ``/reset_prefix_cache``;
* ``async_grpo``: TRL's ``AsyncGRPOTrainer(weight_transfer=WeightsyncWeightTransfer(config))``,
  the time of its ``_sync_weight()`` (TRL's ``perf/weight_sync_s``: ``/pause``, the sync,
  ``/resume``);
* ``native``: weightsync's vLLM trainer engine alone (``send_weights`` over HTTP, no TRL);
* ``copy``: one copy of every tensor of the model into preallocated buffers in this
  process (a floor: the bytes read and written once).

The methods run one after the other (a vLLM server holds one trainer connection at a
time). TRL's default, an NCCL group, cannot run on CPU: ``VLLMClient.init_communicator``
raises ``NotImplementedError`` off CUDA; the script records TRL's message. TRL 1.16's
``AsyncGRPOTrainer`` asks ``torch.cuda`` for the device name when it is built; that one
call is stubbed here (its MFU metric is off on an unknown device anyway).

    export "$(scripts/vllm_env.sh)"; export WEIGHTSYNC_LIBIOMP5="$(scripts/vllm_env.sh --path)"
    .venv/bin/python benchmarks/trl_sync.py --models demo,0.5b --repeats 6 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from unittest import mock

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from vllm_sync import MODELS, _config  # noqa: E402

# vllm_sync puts src/ first on sys.path; the vLLM server inherits it, and a stale
# src/weightsync.egg-info there would hide the installed entry points (the plugin)
SRC = os.path.realpath(os.path.join(HERE, "..", "src"))
sys.path[:] = [p for p in sys.path if os.path.realpath(p or ".") != SRC] + [SRC]


def flip(model) -> None:
    import torch

    with torch.no_grad():
        for p in model.parameters():
            p.neg_()


def timed(fn, model, repeats: int, gap: float) -> list[float]:
    out = []
    for _ in range(repeats):
        flip(model)
        time.sleep(gap)          # vLLM's RPC readers spin for a second after each message
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out


def dataset():
    from datasets import Dataset

    return Dataset.from_dict({"prompt": [f"w{i} w{i + 1} w{i + 2}" for i in range(2, 10)]})


def reward(completions, **kwargs):
    return [0.0 for _ in completions]


def run_model(name: str, args, root: str) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from weightsync.rollout.hf import build_causal_lm
    from weightsync.rollout.vllm.serve import VLLMServer
    from weightsync.testing.toymodel import word_tokenizer

    folder = os.path.join(root, name)
    cfg = _config(name)
    model = build_causal_lm(cfg, seed=1).to(getattr(torch, args.dtype))
    model.save_pretrained(folder)
    tok = word_tokenizer(folder, vocab_size=1000)
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    del model
    out: dict = {"model": name, "mib": round(nbytes / 2**20, 1), "dtype": args.dtype}
    server = VLLMServer(folder, backend="weightsync-shm", dtype=args.dtype,
                        start_timeout=600.0, log_path=os.path.join(root, f"{name}.log"),
                        env={"VLLM_PLUGINS": "weightsync"})
    start = time.perf_counter()
    server.start()
    out["server_start_s"] = round(time.perf_counter() - start, 1)
    try:
        dtype = getattr(torch, args.dtype)
        # -- GRPOTrainer --------------------------------------------------------------
        from trl import GRPOConfig, GRPOTrainer

        from weightsync.integrations.trl import patch_vllm_client, unpatch_vllm_client

        patch_vllm_client(bucket_size=args.bucket_mib << 20, weight_sync_timeout=600)
        try:
            config = GRPOConfig(output_dir=os.path.join(root, "grpo"), use_vllm=True,
                                vllm_mode="server", vllm_server_base_url=server.url,
                                per_device_train_batch_size=2, num_generations=2,
                                max_completion_length=4, max_steps=1, use_cpu=True,
                                bf16=False, report_to=[], save_strategy="no")
            model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
            trainer = GRPOTrainer(model=model, reward_funcs=reward, args=config,
                                  train_dataset=dataset(), processing_class=tok)
            gen = trainer.vllm_generation
            out["grpo"] = timed(gen.sync_weights, trainer.model, args.repeats, args.gap)
            gen.vllm_client.close_communicator()
            del trainer, model, gen
        finally:
            unpatch_vllm_client()
        # -- AsyncGRPOTrainer ---------------------------------------------------------
        import queue

        from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer

        from weightsync.integrations.trl import WeightsyncWeightTransfer

        class NoRollouts:
            rollout_buffer = queue.Queue()

            def start(self): pass

            def stop(self): pass

            def update_model_version(self, version): pass

            def check_health(self, stale_after_s): pass

        config = AsyncGRPOConfig(output_dir=os.path.join(root, "async"),
                                 vllm_server_base_url=server.url, use_cpu=True, bf16=False,
                                 report_to=[], dtype=args.dtype, weight_sync_timeout=600,
                                 max_steps=1, save_strategy="no")
        transfer = WeightsyncWeightTransfer(config, bucket_size=args.bucket_mib << 20)
        with mock.patch("trl.experimental.async_grpo.async_grpo_trainer."
                        "get_peak_flops_per_device", lambda *a: None):
            trainer = AsyncGRPOTrainer(folder, reward_funcs=reward, args=config,
                                       train_dataset=dataset(), processing_class=tok,
                                       rollout_worker=NoRollouts(), weight_transfer=transfer)
        transfer.init_weight_transfer()
        out["async_grpo"] = timed(trainer._sync_weight, trainer.model, args.repeats, args.gap)
        transfer.destroy()
        del trainer
        # -- weightsync's trainer engine alone ---------------------------------------
        from vllm.distributed.weight_transfer import WeightTransferTrainerFactory
        from vllm.distributed.weight_transfer.base import ModuleSource

        from weightsync.integrations.vllm_native import trainer_init_info

        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
        engine = WeightTransferTrainerFactory.trainer_init(
            trainer_init_info("shm", rank=0, bucket_size=args.bucket_mib << 20, timeout=600),
            client=server.client, source=ModuleSource(model))
        out["native"] = timed(engine.send_weights, model, args.repeats, args.gap)
        engine.shutdown()
        # -- one copy of the bytes ----------------------------------------------------
        params = [p.detach() for p in model.parameters()]
        dst = [torch.empty_like(p) for p in params]

        def copy():
            for d, p in zip(dst, params):
                d.copy_(p)

        out["copy"] = timed(copy, model, args.repeats, 0.0)
    finally:
        server.stop()
    for key in ("grpo", "async_grpo", "native", "copy"):
        warm = out[key][1:] or out[key]
        out[key] = {"median_s": round(statistics.median(warm), 4),
                    "min_s": round(min(warm), 4), "all_s": [round(x, 4) for x in out[key]]}
    return out


def trl_default_on_cpu() -> str:
    """TRL's own client on a CPU device: what it says."""
    from trl.generation.vllm_client import VLLMClient

    client = VLLMClient.__new__(VLLMClient)       # no server needed for the device check
    client.base_url, client.group_port = "http://127.0.0.1:1", 51216
    client.get_server_info = lambda: {"weight_transfer_config": {"backend": "nccl"}}
    client.get_world_size = lambda: 1
    try:
        client.init_communicator(device="cpu")
    except NotImplementedError as exc:
        return f"NotImplementedError: {exc}"
    except Exception as exc:  # pragma: no cover - another TRL
        return f"{type(exc).__name__}: {exc}"
    return "ran"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="demo,0.5b")
    p.add_argument("--repeats", type=int, default=6)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--bucket-mib", type=int, default=64)
    p.add_argument("--gap", type=float, default=1.5)
    p.add_argument("--json", default=None, help="write the results here too")
    args = p.parse_args()
    root = tempfile.mkdtemp(prefix="wstrl-bench-")
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    results = {"trl_default_on_cpu": trl_default_on_cpu(), "models": []}
    try:
        for name in args.models.split(","):
            if name not in MODELS:
                raise SystemExit(f"unknown model {name!r}; known: {sorted(MODELS)}")
            results["models"].append(run_model(name, args, root))
            print(json.dumps(results["models"][-1]), flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(json.dumps(results, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
