"""Bench worker processes: one trainer (rank 0) and R receivers, driven by the parent.

The parent sends commands through a pipe; a worker answers each with ``("done", result)``
or ``("error", traceback)``. Inside a method, workers exchange small objects through the
parent (:meth:`Ctx.gather`, an all-gather in rank order, also used as a barrier). Every
timed step starts after such a barrier; the worker records ``perf_counter()`` (the system
wide CLOCK_MONOTONIC on Linux) before and after, so the parent can measure from the
trainer's start to the last receiver's end. A sampler thread records resident memory.
"""

from __future__ import annotations

import gc
import os
import threading
import time
import traceback
from typing import Any, Optional

import torch

from weightsync.tools.bench.workloads import Workload, materialize, zeros_like_spec

__all__ = ["Ctx", "worker_main", "fingerprint"]

_PAGE = os.sysconf("SC_PAGE_SIZE")
try:  # psutil where installed (the bench extra); /proc otherwise
    import psutil as _psutil
except ImportError:  # pragma: no cover - depends on the environment
    _psutil = None
_PROC: Any = None


def rss_bytes() -> int:
    """Resident set size of this process (shared pages it touched included)."""
    global _PROC
    if _psutil is not None:
        if _PROC is None or _PROC.pid != os.getpid():
            _PROC = _psutil.Process()
        return int(_PROC.memory_info().rss)
    with open("/proc/self/statm", "rb") as f:
        return int(f.read().split()[1]) * _PAGE


class RssSampler:
    """Peak resident set size between ``start`` and ``stop`` (sampled every ``period`` s)."""

    def __init__(self, period: float = 0.002) -> None:
        self.period = period
        self.peak = 0
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def start(self) -> None:
        self.peak = rss_bytes()
        self._stop.clear()
        if os.environ.get("WSB_NO_SAMPLER"):
            return
        self._thread = threading.Thread(target=self._run, daemon=True, name="bench-rss")
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            self.peak = max(self.peak, rss_bytes())

    def stop(self) -> int:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self.peak = max(self.peak, rss_bytes())
        return self.peak


def fingerprint(params: dict[str, torch.Tensor]) -> list[int]:
    """Cheap position-sensitive digest of every tensor's bytes (compared across ranks)."""
    out = []
    for t in params.values():
        b = t.detach().reshape(-1).view(torch.uint8)
        n = b.numel()
        if n == 0:
            out.append(0)
            continue
        head = b[: min(n, 4096)].to(torch.int64)
        weights = torch.arange(1, head.numel() + 1, dtype=torch.int64)
        out.append(int(b.sum(dtype=torch.int64)) * 1_000_003 + int((head * weights).sum()))
    return out


class Ctx:
    """What a method sees of its worker: role, rank, tensors, and the parent channel."""

    def __init__(self, conn, rank: int, receivers: int, timeout: float) -> None:
        self.conn = conn
        self.rank = rank                  # 0: trainer, 1..R: receivers
        self.receivers = receivers
        self.timeout = timeout
        self.workload: Optional[Workload] = None
        self.params: dict[str, torch.Tensor] = {}
        self._marks = 1

    @property
    def is_trainer(self) -> bool:
        return self.rank == 0

    def gather(self, obj: Any) -> list[Any]:
        """All-gather through the parent, in rank order (trainer first)."""
        self.conn.send(("gather", obj))
        if not self.conn.poll(self.timeout):
            raise TimeoutError(f"bench rank {self.rank}: no gather reply in {self.timeout}s")
        kind, payload = self.conn.recv()
        if kind != "gathered":
            raise RuntimeError(f"bench rank {self.rank}: aborted by the parent ({payload})")
        return payload

    def mark_version(self, version: int, changed: float = 0.0) -> None:
        """Trainer: change a few bytes of every tensor so each sync carries new data;
        ``changed`` > 0: that fraction of each tensor's elements (a strided set that moves
        with the version, as a training step touches elements all over a tensor)."""
        if not self.is_trainer:
            return
        for i, t in enumerate(self.params.values()):
            if t.numel():
                t.view(-1)[0] = float((version * 31 + i) % 97) / 8.0
                if changed > 0:     # new positions and values at every call
                    stride = max(1, round(1 / changed))
                    t.view(-1)[(self._marks + i) % stride::stride] = float(self._marks % 251) / 64
        self._marks += 1


def _build(ctx: Ctx, w: Workload) -> dict:
    ctx.params = {}
    gc.collect()
    ctx.workload = w
    ctx.params = materialize(w) if ctx.is_trainer else zeros_like_spec(w)
    return {"rank": ctx.rank, "rss": rss_bytes()}


def _timed(ctx: Ctx, method, version: int, changed: float = 0.0) -> tuple[float, float]:
    ctx.mark_version(version, changed)
    method.before_step(version)
    ctx.gather(None)
    t0 = time.perf_counter()
    method.step(version)
    return t0, time.perf_counter()


_DEFAULT_THREADS = torch.get_num_threads()   # torch's own count, before the bench sets one


def _run_method(ctx: Ctx, name: str, opts: dict) -> dict:
    """:func:`_run_method_now` with ``opts["threads"]`` torch threads (0: torch's default)
    for this run only, when given."""
    if opts.get("threads") is None:
        return _run_method_now(ctx, name, opts)
    before = torch.get_num_threads()
    torch.set_num_threads(opts["threads"] or _DEFAULT_THREADS)
    try:
        return _run_method_now(ctx, name, opts)
    finally:
        torch.set_num_threads(before)


def _run_method_now(ctx: Ctx, name: str, opts: dict) -> dict:
    """Set up ``name``, run one cold and ``warm`` warm steps, verify, tear down.

    With ``opts["pair"]`` (a limit's name) that limit runs right before every step of the
    method, in the same processes, so the two can be compared step by step even when the
    machine's load changes during the run. Its buffers exist before the baseline RSS is
    taken, so they do not count as the method's memory.
    """
    from weightsync.tools.bench.methods import method_table
    table = method_table()
    paired = table[opts["pair"]](ctx, opts) if opts.get("pair") else None
    method = table[name](ctx, opts)
    times, paired_times, setup_s, peak, ok, info = [], [], 0.0, 0, False, {}
    sampler = RssSampler()
    try:
        if paired is not None:
            paired.setup()
        gc.collect()
        base = rss_bytes()
        sampler.start()
        t_setup = time.perf_counter()
        method.setup()
        setup_s = time.perf_counter() - t_setup
        for it in range(1 + int(opts["warm"])):
            if paired is not None:
                paired_times.append(_timed(ctx, paired, it + 1, opts.get("changed", 0.0)))
            times.append(_timed(ctx, method, it + 1, opts.get("changed", 0.0)))
        peak = sampler.stop()
        ok = True
        if method.verify:
            prints = ctx.gather(fingerprint(ctx.params) if method.participates() else None)
            ok = all(p == prints[0] for p in prints if p is not None)
        info = method.info()
    finally:
        sampler.stop()
        method.teardown()
        if paired is not None:
            paired.teardown()
    return {"rank": ctx.rank, "threads": torch.get_num_threads(), "times": times,
            "setup_s": setup_s, "rss_base": base,
            "rss_peak": peak, "ok": ok, "participates": method.participates(), "info": info,
            "paired_times": paired_times,
            "paired_participates": paired.participates() if paired is not None else None}


def worker_main(conn, rank: int, receivers: int, timeout: float, threads: int) -> None:
    """Process entry point: serve the parent's commands until ``quit``."""
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    if threads > 0:
        torch.set_num_threads(threads)
    ctx = Ctx(conn, rank, receivers, timeout)
    while True:
        try:
            cmd = conn.recv()
        except EOFError:
            return
        try:
            if cmd[0] == "quit":
                conn.send(("done", None))
                return
            if cmd[0] == "workload":
                conn.send(("done", _build(ctx, cmd[1])))
            elif cmd[0] == "run":
                conn.send(("done", _run_method(ctx, cmd[1], cmd[2])))
            else:
                conn.send(("error", f"unknown command {cmd[0]!r}"))
        except BaseException:
            conn.send(("error", traceback.format_exc()))
