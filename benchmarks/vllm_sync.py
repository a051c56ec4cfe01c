"""Sync time into a vLLM replica, split into transport time and load time.

For each model (the demo's toy Qwen2 and a ~0.5B config-built Qwen2 with Qwen2.5-0.5B
shapes and an untied lm_head, random weights), this starts a
:class:`weightsync.rollout.vllm.VLLMRolloutReplica` (vLLM's default process model unless
``--inproc``), sends the weights from a checkpoint engine in this process ``--repeats``
times (every sync changes every tensor), and reports per sync:

* ``wall``: the driver's ``engine_receive`` call (RPC, receive, load, prefix-cache reset);
* ``transport``: time the vLLM worker waited for tensors from the engine (incl. the copy
  out of the engine's bucket);
* ``load``: the rest of the worker's time: vLLM's loader (layerwise reload: stacking
  q/k/v and gate/up, padding the vocab, repacking the CPU GEMM weights).

With ``--apply stream`` the two interleave (the loader pulls tensors as they arrive), with
``staged`` the whole version is received first, then loaded. The first sync is "cold"
(plans, buffers); the table shows it and the median of the others.

    .venv/bin/python benchmarks/vllm_sync.py --models demo,0.5b --dtype bfloat16
    .venv/bin/python benchmarks/vllm_sync.py --models 0.5b --apply staged --json out.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "src"))

MODELS = {
    # the demo's model (weightsync demo defaults: hidden 256, 4 layers, vocab 4096)
    "demo": dict(vocab_size=4096, hidden_size=256, layers=4, intermediate_size=704, heads=4,
                 kv_heads=2),
    # Qwen2.5-0.5B shapes, untied lm_head: ~630M parameters
    "0.5b": dict(vocab_size=151936, hidden_size=896, layers=24, intermediate_size=4864,
                 heads=14, kv_heads=2),
}


def _config(name: str) -> dict:
    from weightsync.testing.toymodel import tiny_qwen2_config

    cfg = tiny_qwen2_config(**MODELS[name])
    cfg["max_position_embeddings"] = 512
    return cfg


def _connect(sender, replica, backend: str, kwargs: dict) -> None:
    from weightsync.transport.base import worker_kwargs

    metas = [sender.prepare()] + replica.engine_prepare(backend, kwargs)
    tk, rk = type(sender).build_topology(1, 1, metas)
    t = threading.Thread(target=replica.engine_init, args=([worker_kwargs(rk, 0)],))
    t.start()
    sender.init_process_group(**worker_kwargs(tk, 0))
    t.join(kwargs["timeout"])


def _one_sync(sender, replica, tensors: dict, version: int, timeout: float) -> dict:
    out: dict = {}

    def receive() -> None:
        try:
            start = time.perf_counter()
            out["stats"] = replica.engine_receive(version)
            out["wall"] = time.perf_counter() - start
        except BaseException as exc:  # reported below
            out["error"] = exc

    t = threading.Thread(target=receive)
    t.start()
    sent = asyncio.run(sender.send_weights(list(tensors.items()), version=version))
    t.join(2 * timeout + 60)
    if "error" in out:
        raise out["error"]
    s = out["stats"]
    return {"version": version, "wall": out["wall"], "worker": s["seconds"],
            "transport": s["transport_seconds"], "load": s["load_seconds"],
            "bytes": s["bytes"], "tensors": s["tensors"], "send": sent.get("seconds")}


def run_model(name: str, args: argparse.Namespace) -> dict:
    import torch
    from safetensors.torch import load_file

    from weightsync.transport import CheckpointEngineRegistry
    from weightsync.rollout.vllm.replica import VLLMOptions, VLLMRolloutReplica, model_folder_from_config

    dtype = getattr(torch, args.dtype)
    folder = tempfile.mkdtemp(prefix="wsbench-vllm-", dir=args.tmp)
    replica = sender = None
    try:
        t0 = time.perf_counter()
        model_folder_from_config(_config(name), folder, dtype=dtype, seed=0)
        tensors = {}
        for f in sorted(os.listdir(folder)):
            if f.endswith(".safetensors"):
                tensors.update(load_file(os.path.join(folder, f)))
        build_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        replica = VLLMRolloutReplica(folder, dtype=args.dtype, options=VLLMOptions(
            apply=args.apply, multiprocess=not args.inproc, max_model_len=512,
            timeout=args.timeout))
        start_s = time.perf_counter() - t0
        kwargs = {"bucket_size": args.bucket_mb << 20, "timeout": args.timeout}
        sender = CheckpointEngineRegistry.new(args.backend, role="trainer", **kwargs)
        _connect(sender, replica, args.backend, kwargs)
        runs = []
        for v in range(1, args.repeats + 1):
            with torch.no_grad():
                for t in tensors.values():
                    t.mul_(1.0 + 2.0 ** -7 * (1 if v % 2 else -1))   # every tensor changes
            runs.append(_one_sync(sender, replica, tensors, v, args.timeout))
            print(f"  {name} sync {v}: " + ", ".join(
                f"{k} {runs[-1][k]:.3f}s" for k in ("wall", "transport", "load")), flush=True)
        params = sum(t.numel() for t in tensors.values())
        return {"model": name, "params": params, "dtype": args.dtype, "apply": args.apply,
                "backend": args.backend, "multiprocess": not args.inproc,
                "bytes": runs[0]["bytes"], "tensors": runs[0]["tensors"],
                "build_seconds": build_s, "vllm_start_seconds": start_s, "runs": runs}
    finally:
        if sender is not None:
            sender.finalize()
        if replica is not None:
            replica.close()
        shutil.rmtree(folder, ignore_errors=True)


def save_results(path, results: list) -> None:
    """Write this run's command-line arguments and ``results`` to ``path`` as JSON; no path,
    nothing written."""
    if path:
        with open(path, "w") as f:
            json.dump({"argv": sys.argv[1:], "results": results}, f, indent=1)


def _row(r: dict) -> str:
    cold, warm = r["runs"][0], r["runs"][1:] or r["runs"]

    def med(key: str) -> float:
        return statistics.median(x[key] for x in warm)

    return (f"{r['model']:>5} {r['params'] / 1e6:8.1f}M {r['dtype']:>9} {r['apply']:>7} "
            f"{r['bytes'] / 2**20:9.1f} {cold['wall']:8.3f} {med('wall'):8.3f} "
            f"{med('transport'):10.3f} {med('load'):8.3f} {r['vllm_start_seconds']:8.1f}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="demo,0.5b", help="comma list of " + ",".join(MODELS))
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32", "float16"))
    p.add_argument("--apply", default="stream", choices=("stream", "staged"))
    p.add_argument("--backend", default="shm")
    p.add_argument("--bucket-mb", type=int, default=64)
    p.add_argument("--repeats", type=int, default=4)
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--inproc", action="store_true",
                   help="VLLM_ENABLE_V1_MULTIPROCESSING=0 (the worker runs in this process)")
    p.add_argument("--tmp", default=None, help="where the model folder is written")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    models = [m for m in args.models.split(",") if m]
    bad = [m for m in models if m not in MODELS]
    if bad or args.repeats < 1:
        p.error(f"unknown model(s) {bad}" if bad else "--repeats must be >= 1")
    results = [run_model(m, args) for m in models]
    print(f"\n{'model':>5} {'params':>9} {'dtype':>9} {'apply':>7} {'MiB':>9} {'cold s':>8} "
          f"{'wall s':>8} {'transport':>10} {'load s':>8} {'start s':>8}")
    for r in results:
        print(_row(r))
    print("(wall/transport/load: median of the warm syncs; transport + load = the worker's "
          "time; wall adds the RPC and the prefix-cache reset)")
    save_results(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
