"""The bench's parent process: plans the cases, drives the worker pools, collects results.

For each receiver count R one pool of R + 1 processes is spawned (trainer = rank 0); each
workload is built once in that pool and every method runs on it in turn. A method that
fails (or hangs past the timeout) kills the pool, which is respawned for the next method;
the failure is recorded, never hidden. Cases that would not fit in the memory available
now are skipped with the reason.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass
from multiprocessing.connection import wait as mp_wait
from typing import Any, Callable, Optional

from weightsync.tools.bench.workloads import (GiB, MiB, Workload, hf_qwen2, parse_size, synthetic,
                                             tiny)
from weightsync.tools.bench.worker import worker_main
from weightsync.tools.bench.methods import DELTA_OVER

__all__ = ["BenchConfig", "run_bench", "ALL_METHODS", "DEFAULT_METHODS", "README",
           "base_method"]

logger = logging.getLogger(__name__)

#: ``<method>@readme``: the method consumed as the README shows (``receive_into``) with
#: torch's default thread count in every process, its paired limit too; beside the tuned
#: row (one torch thread per process, as R + 1 processes share the cores)
README = "@readme"
DEFAULT_METHODS = ("shm", "collective", "ray", "gloo-per-tensor", "safetensors-shm", "memcpy",
                   "gloo-flat", "memcpy-parallel", "shm" + README, "collective" + README,
                   "shm-shared", "shm-shared" + README, "shm-push", "shm-push" + README)
ALL_METHODS = DEFAULT_METHODS + ("shm-buckets", "shm-direct", "nixl", "nixl-raw", "cma-raw") + \
    tuple(f"delta+{b}" for b in DELTA_OVER)


def base_method(method: str) -> str:
    """The method a row runs (``shm@readme`` runs ``shm``)."""
    return method[:-len(README)] if method.endswith(README) else method


@dataclass(kw_only=True)
class BenchConfig:
    """What to run. Sizes are GiB numbers or strings with a unit ('16MiB')."""

    sizes: tuple = ("0.25", "1", "4")
    dtypes: tuple = ("bfloat16", "float32")
    receivers: tuple = (1, 2, 4)
    methods: tuple = DEFAULT_METHODS
    hf: bool = True
    warm: int = 5
    bucket_size: int = 64 * MiB
    timeout: float = 180.0
    threads: int = 1                    # torch threads per process (0: torch's default)
    memory_fraction: float = 0.75       # of MemAvailable a case may plan to use
    paired: bool = True                 # run each goal's limit right before each step
    consume: str = "into"               # receivers: "into" (receive_into, the tuned path) or
                                        # "copy" (README: async for + params[name].copy_)
    tiny: int = 0                       # > 0: also N tensors of 16 elements (us per tensor)
    changed: float = 0.0                # per sync, this fraction of every tensor's elements
                                        # changes (0: one element per tensor); for delta+*

    def __post_init__(self) -> None:
        bad = set(self.methods) - set(ALL_METHODS)
        if bad:
            raise ValueError(f"unknown methods {sorted(bad)}; known: {list(ALL_METHODS)}")
        if not self.methods:
            raise ValueError("at least one method is needed")
        if self.consume not in ("into", "copy"):
            raise ValueError(f"consume must be 'into' or 'copy', got {self.consume!r}")
        for r in self.receivers:
            if isinstance(r, bool) or not isinstance(r, int) or not 1 <= r <= 64:
                raise ValueError(f"receivers must be ints in [1, 64], got {r!r}")
        for d in self.dtypes:
            if d not in ("bfloat16", "float32", "float16"):
                raise ValueError(f"dtype must be bfloat16, float16 or float32, got {d!r}")
        if not isinstance(self.warm, int) or self.warm < 1:
            raise ValueError(f"warm must be an int >= 1, got {self.warm!r}")
        if not isinstance(self.bucket_size, int) or self.bucket_size < 4096 \
                or self.bucket_size % 256:
            raise ValueError(f"bucket_size must be a multiple of 256 bytes >= 4096, "
                             f"got {self.bucket_size!r}")
        if not self.timeout > 0:
            raise ValueError(f"timeout must be positive, got {self.timeout!r}")
        for s in self.sizes:
            parse_size(s)
        if isinstance(self.tiny, bool) or not isinstance(self.tiny, int) or self.tiny < 0:
            raise ValueError(f"tiny must be a tensor count >= 0, got {self.tiny!r}")
        if isinstance(self.changed, bool) or not isinstance(self.changed, (int, float)) \
                or not 0 <= self.changed <= 1:
            raise ValueError(f"changed must be a fraction in [0, 1], got {self.changed!r}")


def mem_available() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 * GiB


def method_memory(method: str, w: Workload, receivers: int, bucket: int) -> int:
    """Rough bytes a method needs beyond the models (for skipping what cannot fit)."""
    method = base_method(method)
    n, cap, big = w.nbytes, min(w.nbytes, GiB), w.largest
    if method.startswith("delta+"):      # the trainer's base copy + the inner backend's
        return n + method_memory(method[len("delta+"):], w, receivers, bucket)
    return {
        "shm": 2 * bucket + receivers * big + 2 * cap,
        "shm-buckets": 2 * bucket + receivers * big + 2 * cap,
        "shm-shared": n + 2 * bucket + receivers * big + 2 * cap,   # the trainer's shared copy
        "shm-push": (receivers + 1) * n + 2 * bucket + 2 * cap,     # receivers' shared copies
        "shm-direct": 2 * bucket + receivers * big + 2 * cap,
        "collective": (receivers + 1) * (2 * bucket + cap) + receivers * big,
        "ray": n + receivers * n + (receivers + 1) * 300 * MiB,
        "gloo-per-tensor": receivers * big,
        "safetensors-shm": 2 * n + receivers * n,
        "memcpy": 2 * cap,
        "gloo-flat": (receivers + 1) * cap,
        "memcpy-parallel": receivers * 2 * cap,
        "nixl": n + receivers * n,          # trainer staging + each receiver's landing buffer
        "nixl-raw": (receivers + 1) * cap,
        "cma-raw": (receivers + 1) * cap,
    }[method]


class MethodFailed(RuntimeError):
    pass


class Pool:
    """R + 1 worker processes and the parent's side of their pipes."""

    def __init__(self, receivers: int, cfg: BenchConfig) -> None:
        self.receivers, self.cfg = receivers, cfg
        ctx = mp.get_context("spawn")
        self.pipes, self.procs = [], []
        for rank in range(receivers + 1):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=worker_main, daemon=True, name=f"bench-{rank}",
                            args=(child, rank, receivers, cfg.timeout, cfg.threads))
            p.start()
            child.close()
            self.pipes.append(parent)
            self.procs.append(p)
        self.workload: Optional[Workload] = None

    def command(self, cmd: tuple, timeout: float) -> list[Any]:
        """Send ``cmd`` to every worker; serve their gathers; return their results."""
        for c in self.pipes:
            c.send(cmd)
        n, got = len(self.pipes), {}
        deadline = time.monotonic() + timeout
        while True:
            waiting = [c for i, c in enumerate(self.pipes) if i not in got]
            ready = mp_wait(waiting, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                self.kill()
                raise MethodFailed(f"no answer within {timeout:.0f}s from ranks "
                                   f"{[i for i in range(n) if i not in got]}")
            for c in ready:
                i = self.pipes.index(c)
                try:
                    got[i] = c.recv()
                except (EOFError, OSError):
                    got[i] = ("error", f"bench rank {i} died (exit code "
                                       f"{self.procs[i].exitcode})")
            errors = [f"rank {i}: {m[1]}" for i, m in sorted(got.items()) if m[0] == "error"]
            if errors:
                self.kill()
                raise MethodFailed(errors[0])
            if len(got) < n:
                continue
            kinds = {m[0] for m in got.values()}
            if kinds == {"done"}:
                return [got[i][1] for i in range(n)]
            if kinds != {"gather"}:
                self.kill()
                raise MethodFailed(f"workers out of step: {sorted(kinds)}")
            payload = [got[i][1] for i in range(n)]
            for c in self.pipes:
                c.send(("gathered", payload))
            got = {}

    def close(self) -> None:
        for c in self.pipes:
            try:
                c.send(("quit",))
            except (OSError, BrokenPipeError):
                pass
        for p in self.procs:
            p.join(timeout=10)
        self.kill()

    def kill(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        self.workload = None


def _workloads(cfg: BenchConfig, notes: list[str]) -> list[Workload]:
    out = []
    for size in cfg.sizes:
        for dtype in cfg.dtypes:
            out.append(synthetic(parse_size(size), dtype, bucket_size=cfg.bucket_size))
    if cfg.tiny:
        out += [tiny(cfg.tiny, dtype) for dtype in cfg.dtypes]
    if cfg.hf:
        for dtype in cfg.dtypes:
            w, why = hf_qwen2(dtype)
            if w is None:
                notes.append(why)
                break
            out.append(w)
    return out


def _durations(results: list[dict], key: str, part: str) -> list[float]:
    """Per step: from the trainer's start to the last participant's end."""
    rows = []
    for i in range(len(results[0][key])):
        active = [r for r in results if r[part]]
        start = results[0][key][i][0] if results[0][part] else \
            min(r[key][i][0] for r in active)
        rows.append(max(r[key][i][1] for r in active) - start)
    return rows


#: goals compare these pairs step by step (the limit runs right before each step)
PAIRS = {"shm": "memcpy", "shm-buckets": "memcpy", "shm-direct": "memcpy", "shm-shared": "memcpy",
         "shm-push": "memcpy",
         "collective": "gloo-flat", "nixl": "nixl-raw"}
# (delta+* are not paired: a dense sync of the same tensors in between would overwrite the
# receivers' bases, and every delta would go dense again: the codec checks each base)


def _summarize(w: Workload, method: str, receivers: int, results: list[dict],
               bucket: int, pair: Optional[str]) -> dict:
    trainer = results[0]
    rows = _durations(results, "times", "participates")
    paired = None
    if pair and trainer.get("paired_times"):
        lim = _durations(results, "paired_times", "paired_participates")
        paired = {"method": pair, "warm_s": lim[1:],
                  "warm_median_s": statistics.median(lim[1:]),
                  "ratio_median": statistics.median(l / t for l, t in zip(lim[1:], rows[1:]))}
    cold, warm = rows[0], rows[1:]
    med = statistics.median(warm)
    rss = [{"rank": r["rank"], "role": "trainer" if r["rank"] == 0 else "receiver",
            "base_bytes": r["rss_base"], "peak_bytes": r["rss_peak"],
            "extra_bytes": max(0, r["rss_peak"] - r["rss_base"])} for r in results]
    return {**w.summary(), "receivers": receivers, "method": method,
            "kind": _kind(method), "bucket_size": bucket, "ok": all(r["ok"] for r in results),
            "setup_s": max(r["setup_s"] for r in results), "cold_s": cold, "warm_s": warm,
            "torch_threads": trainer.get("threads"),
            "warm_median_s": med, "gbps": w.nbytes / med / 1e9 if med > 0 else None,
            "rss": rss, "max_extra_rss_bytes": max(x["extra_bytes"] for x in rss),
            "info": trainer.get("info") or {}, "status": "ok",
            "note": "receive_into, torch's default threads" if method.endswith(README) else "",
            "paired": paired}


def _kind(method: str) -> str:
    from weightsync.tools.bench.methods import method_table
    return method_table()[base_method(method)].kind


def _skip(w: Workload, method: str, receivers: int, why: str, status: str = "skipped") -> dict:
    return {**w.summary(), "receivers": receivers, "method": method, "kind": _kind(method),
            "status": status, "note": why, "cold_s": None, "warm_median_s": None,
            "gbps": None, "warm_s": [], "rss": [], "max_extra_rss_bytes": None, "ok": False,
            "paired": None}


def _start_ray(cfg: BenchConfig, works: list[Workload], notes: list[str]) -> tuple[Any, dict]:
    from weightsync.tools.bench.baselines import RayCluster, Unavailable
    if "ray" not in cfg.methods:
        return None, {}
    need = max(w.nbytes for w in works) * 2 + 512 * MiB
    store = int(min(need, mem_available() * 0.4))
    tmp = tempfile.mkdtemp(prefix="wsb-ray-", dir="/tmp")
    try:
        cluster = RayCluster(store, tmp)
    except Unavailable as exc:
        notes.append(str(exc))
        shutil.rmtree(tmp, ignore_errors=True)
        return None, {"ray_note": str(exc)}
    except Exception as exc:  # Ray failed to start: record it, run the rest
        notes.append(f"ray did not start: {type(exc).__name__}: {exc}")
        shutil.rmtree(tmp, ignore_errors=True)
        return None, {"ray_note": f"ray did not start: {exc}"}
    cluster.tmp = tmp
    return cluster, {"ray_address": cluster.address}


def run_bench(cfg: BenchConfig, *, progress: Optional[Callable[[str], None]] = None,
              total_cb: Optional[Callable[[int], None]] = None) -> dict:
    """Run every case; returns the JSON-able report (see :mod:`weightsync.tools.bench.report`)."""
    notes: list[str] = []
    works = _workloads(cfg, notes)
    if total_cb is not None:
        total_cb(len(works) * len(cfg.receivers) * len(cfg.methods))
    cluster, ray_opts = _start_ray(cfg, works, notes)
    results: list[dict] = []
    started = time.time()
    try:
        for receivers in cfg.receivers:
            _run_pool(cfg, receivers, works, ray_opts, results, progress)
    finally:
        if cluster is not None:
            cluster.shutdown()
            shutil.rmtree(cluster.tmp, ignore_errors=True)
    from weightsync.tools.bench.report import build_report
    return build_report(cfg, results, notes, seconds=time.time() - started)


def _run_pool(cfg: BenchConfig, receivers: int, works: list[Workload], ray_opts: dict,
              results: list[dict], progress) -> None:
    pool: Optional[Pool] = None
    try:
        for w in works:
            models = w.nbytes * (receivers + 1)
            for method in cfg.methods:
                tag = f"{w.name} {w.dtype} R={receivers} {method}"
                if progress is not None:
                    progress(tag)
                budget = mem_available() * cfg.memory_fraction
                held = pool.workload if pool is not None else None
                if held is not None and held is not w:  # freed before w is built
                    budget += held.nbytes * (receivers + 1)
                need = method_memory(method, w, receivers, cfg.bucket_size)
                need += 0 if held is w else models
                if need > budget:
                    results.append(_skip(w, method, receivers,
                                         f"needs ~{need / GiB:.1f} GiB more memory, "
                                         f"{budget / GiB:.1f} GiB may be used now"))
                    continue
                if pool is None:
                    pool = Pool(receivers, cfg)
                if pool.workload is not w:
                    pool.workload = None
                    pool.command(("workload", w), cfg.timeout * 2)
                    pool.workload = w
                base = base_method(method)
                pair = PAIRS.get(base) if cfg.paired and PAIRS.get(base) in cfg.methods \
                    else None
                opts = {"warm": cfg.warm, "bucket_size": cfg.bucket_size, "pair": pair,
                        "into": cfg.consume == "into", "changed": cfg.changed,
                        **ray_opts}
                if base != method:    # the README's consumer: receive_into, default threads
                    opts.update(into=True, threads=0)
                try:
                    res = pool.command(("run", base, opts), cfg.timeout * (cfg.warm + 3))
                    results.append(_summarize(w, method, receivers, res, cfg.bucket_size,
                                              pair))
                except MethodFailed as exc:
                    text = str(exc)
                    status = "unavailable" if "Unavailable" in text else "failed"
                    row = _skip(w, method, receivers, _last_line(text), status)
                    if status == "failed":
                        row["traceback"] = text[-4000:]
                    results.append(row)
                    if pool.workload is None:  # the pool was killed
                        pool = None
    finally:
        if pool is not None:
            pool.close()


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1][:300] if lines else text[:300]
