"""Helpers to run real multi-process syncs (used by the conformance suite and the bench).

:func:`make_tensors` builds a deterministic tensor set that exercises every supported
dtype, 0-d, empty, non-contiguous, larger-than-a-bucket and many tiny tensors.
:func:`run_group` runs trainer and rollout workers as separate processes (or, for
backends with the ``same_process`` capability, as coroutines of one event loop), drives
them through the engine lifecycle, and returns what each rollout rank received, checked
byte for byte against the expected tensors. Every wait is bounded.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import importlib
import multiprocessing as mp
import os
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from weightsync.transport import CheckpointEngineRegistry
from weightsync.transport.base import worker_kwargs
from weightsync.transport.tensors import CASTABLE
from weightsync.core.plan import DTYPES

__all__ = ["make_tensors", "expected_tensors", "run_group", "GroupSpec", "same_bytes", "CONSUME"]


def _random(g: torch.Generator, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_complex:
        return torch.randn(shape, generator=g, dtype=dtype)
    if dtype.is_floating_point:
        base = torch.randn(shape, generator=g)
        if dtype.itemsize == 1:  # float8 kinds: keep inside their range
            base = base.clamp(-4, 4).abs() if "e8m0" in str(dtype) else base.clamp(-4, 4)
        return base.to(dtype)
    info_hi = 100 if dtype == torch.uint8 else 1000
    return torch.randint(0, info_hi, shape, generator=g, dtype=torch.int64).to(dtype)


def make_tensors(seed: int, *, bucket_size: int, tiny: int = 200) -> list[tuple[str, torch.Tensor]]:
    """A deterministic, varied tensor set; the same ``seed`` gives the same bytes anywhere."""
    g = torch.Generator().manual_seed(seed)
    out: list[tuple[str, torch.Tensor]] = []
    for i, (dname, dtype) in enumerate(sorted(DTYPES.items())):
        out.append((f"dtype.{dname}.mat", _random(g, (3 + i % 5, 17), dtype)))
        out.append((f"dtype.{dname}.scalar", _random(g, (), dtype)))
    out.append(("empty.f32", torch.empty(0, 7)))
    out.append(("empty.i64", torch.empty(0, dtype=torch.int64)))
    out.append(("noncontig.t", _random(g, (64, 33), torch.float32).t()))
    out.append(("noncontig.step", _random(g, (200,), torch.bfloat16)[::3]))
    big = (5 * bucket_size // 2) // 4 + 3  # > 2 buckets, not a multiple of anything
    out.append(("big.f32", _random(g, (big,), torch.float32)))
    out.append(("layer.0.weight", _random(g, (96, 64), torch.bfloat16)))
    for k in range(tiny):
        out.append((f"tiny.{k}", _random(g, (3,), torch.float32)))
    out.append(("big.noncontig", _random(g, (bucket_size // 8 + 5, 3), torch.float16).t()))
    return out


def expected_tensors(seed: int, *, bucket_size: int, tiny: int = 200,
                     dtype: Optional[torch.dtype] = None) -> dict[str, torch.Tensor]:
    """What a receiver must get for :func:`make_tensors` (after the optional cast)."""
    out = {}
    for name, t in make_tensors(seed, bucket_size=bucket_size, tiny=tiny):
        out[name] = t.to(dtype) if dtype is not None and t.dtype in CASTABLE else t
    return out


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-exact equality (dtype, shape and every byte)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.numel() == 0:
        return True
    return torch.equal(a.detach().cpu().contiguous().reshape(-1).view(torch.uint8),
                       b.detach().cpu().contiguous().reshape(-1).view(torch.uint8))


#: How receivers take the weights (``GroupSpec.consume``).
CONSUME = ("views", "into", "into-shared", "plain", "plain-dict")


@dataclass(kw_only=True)
class GroupSpec:
    """One multi-process sync scenario."""

    backend: str
    trainers: int = 1
    receivers: int = 1
    steps: int = 3
    pattern: str = "full"               # "full": every trainer yields all; "disjoint"
    engine_kwargs: dict = field(default_factory=dict)
    tiny: int = 200
    expect_version_offset: int = 0      # receivers expect step + offset (to provoke mismatch)
    timeout: float = 120.0
    hook: Optional[str] = None          # "module:function" called as f(engine, role, rank)
                                        # in each worker before init (fault injection)
    device: str = "cpu"                 # where trainers create their tensors ("cuda": GPU)
    gpus: Optional[tuple[int, ...]] = None  # the CUDA device of each worker, trainers
                                        # first (torch.cuda.set_device before the engine
                                        # is made); None: every worker on the current one
    hold: bool = False                  # workers stay up after their run until every
                                        # worker reported (as long-lived workers do)
    straggler_s: Optional[float] = None  # once some worker reported its result, the rest
                                        # count as hung when no report came for this long
                                        # (a fault that leaves a rank stuck); None: only
                                        # ``timeout`` bounds the wait
    consume: str = "views"              # "views": receive_weights; "into": receive_into
                                        # the receiver's own tensors; "into-shared": the
                                        # same tensors in shared memory (shm: pushes);
                                        # "plain": the blocking engine.send on trainers and
                                        # engine.receive(into=own tensors) on receivers;
                                        # "plain-dict": engine.send and engine.receive()

    def __post_init__(self) -> None:
        if self.consume not in CONSUME:
            raise ValueError(f"consume must be one of {CONSUME}, got {self.consume!r}")
        if self.pattern not in ("full", "disjoint"):
            raise ValueError(f"pattern must be 'full' or 'disjoint', got {self.pattern!r}")
        if self.straggler_s is not None and not self.straggler_s > 0:
            raise ValueError(f"straggler_s must be > 0 or None, got {self.straggler_s!r}")
        if self.gpus is not None:
            gpus = tuple(self.gpus)
            if len(gpus) != self.trainers + self.receivers or not all(
                    type(g) is int and g >= 0 for g in gpus):
                raise ValueError(f"gpus must hold one device index >= 0 per worker "
                                 f"({self.trainers + self.receivers}, trainers first), "
                                 f"got {self.gpus!r}")
            self.gpus = gpus


def _trainer_items(spec: GroupSpec, step: int, rank: int):
    bs = spec.engine_kwargs["bucket_size"]
    items = make_tensors(step, bucket_size=bs, tiny=spec.tiny)
    for i, (name, tensor) in enumerate(items):
        if spec.pattern == "full" or i % spec.trainers == rank:
            yield name, (tensor if spec.device == "cpu" else tensor.to(spec.device))


async def _receive_step(engine, spec: GroupSpec, step: int) -> dict[str, Any]:
    bs = spec.engine_kwargs["bucket_size"]
    expected = expected_tensors(step, bucket_size=bs, tiny=spec.tiny,
                                dtype=spec.engine_kwargs.get("dtype"))
    counts: dict[str, int] = {}
    bad = []
    version = step + spec.expect_version_offset
    params = None
    if spec.consume != "views":      # the receiver's own tensors, the same every step
        params = engine.__dict__.get("_harness_params")
        if params is None:
            params = {n: torch.empty(t.shape, dtype=t.dtype) for n, t in expected.items()}
            if spec.consume == "into-shared":
                for t in params.values():
                    t.share_memory_()
            engine.__dict__["_harness_params"] = params
        stream = engine.receive_into(params, version=version)
    else:
        stream = engine.receive_weights(version=version)
    async for name, tensor in stream:
        counts[name] = counts.get(name, 0) + 1
        if name not in expected or not same_bytes(tensor, expected[name]):
            bad.append(name)
    if params is not None:           # what landed in the receiver's own tensors
        bad += [n for n in counts if n in params and not same_bytes(params[n], expected[n])]
    return {"step": step, "missing": sorted(set(expected) - set(counts)),
            "dupes": sorted(n for n, c in counts.items() if c > 1), "bad": bad,
            "count": len(counts)}


def _receive_step_plain(engine, spec: GroupSpec, step: int) -> dict[str, Any]:
    """One step of the blocking API: ``receive(into=...)`` or ``receive()``."""
    expected = expected_tensors(step, bucket_size=spec.engine_kwargs["bucket_size"],
                                tiny=spec.tiny, dtype=spec.engine_kwargs.get("dtype"))
    version = step + spec.expect_version_offset
    if spec.consume == "plain":
        params = engine.__dict__.get("_harness_params")
        if params is None:
            params = {n: torch.empty(t.shape, dtype=t.dtype) for n, t in expected.items()}
            engine.__dict__["_harness_params"] = params
        stats = engine.receive(into=params, version=version)
        got = params
    else:
        got = engine.receive(version=version)
        stats = None
    bad = [n for n, t in got.items() if n not in expected or not same_bytes(t, expected[n])]
    out = {"step": step, "missing": sorted(set(expected) - set(got)), "dupes": [],
           "bad": bad, "count": len(got)}
    if stats is not None:
        out["stats"] = dataclasses.asdict(stats)
    return out


class _Steps:
    """One worker's record of its steps: results, errors and where they came from."""

    def __init__(self, role: str, rank: int) -> None:
        self.role, self.rank = role, rank
        self.steps: list = []
        self.errors: list[str] = []
        self.origins: list = []
        self.failed_after: Optional[float] = None

    def failed(self, exc: BaseException, started: float) -> None:
        self.errors.append(f"{type(exc).__name__}: {exc}")
        self.origins.append(getattr(exc, "origin", None) or getattr(exc, "peer", None))
        self.failed_after = time.monotonic() - started

    def result(self) -> dict[str, Any]:
        return {"role": self.role, "rank": self.rank, "steps": self.steps,
                "errors": self.errors, "origins": self.origins,
                "failed_after_s": self.failed_after}


async def _run_role(engine, spec: GroupSpec, role: str, rank: int) -> dict[str, Any]:
    rec = _Steps(role, rank)
    for step in range(spec.steps):
        started = time.monotonic()
        try:
            if role == "trainer":
                rec.steps.append(await engine.send_weights(_trainer_items(spec, step, rank),
                                                           version=step))
            else:
                rec.steps.append(await _receive_step(engine, spec, step))
        except Exception as exc:  # reported to the parent, which asserts on it
            rec.failed(exc, started)
            break
    return rec.result()


def _run_role_plain(engine, spec: GroupSpec, role: str, rank: int) -> dict[str, Any]:
    """:func:`_run_role` through the blocking ``send`` / ``receive``, called from a thread
    without an event loop as a plain program calls them (a trainer step's result is its
    ``SyncStats`` as a dict)."""
    rec = _Steps(role, rank)
    for step in range(spec.steps):
        started = time.monotonic()
        try:
            if role == "trainer":
                stats = engine.send(_trainer_items(spec, step, rank), version=step)
                rec.steps.append(dataclasses.asdict(stats))
            else:
                rec.steps.append(_receive_step_plain(engine, spec, step))
        except Exception as exc:  # reported to the parent, which asserts on it
            rec.failed(exc, started)
            break
    return rec.result()


def _plain(spec: GroupSpec) -> bool:
    return spec.consume.startswith("plain")


def _worker(spec: GroupSpec, role: str, rank: int, conn) -> None:
    try:
        if spec.gpus is not None:
            torch.cuda.set_device(spec.gpus[rank if role == "trainer" else spec.trainers + rank])
        engine = CheckpointEngineRegistry.new(spec.backend, role=role, **spec.engine_kwargs)
        if spec.hook:
            module, _, func = spec.hook.partition(":")
            getattr(importlib.import_module(module), func)(engine, role, rank)
        conn.send(engine.prepare())
        if not conn.poll(spec.timeout):
            raise TimeoutError("no topology from the parent")
        engine.init_process_group(**conn.recv())
        if _plain(spec):
            result = _run_role_plain(engine, spec, role, rank)
        else:
            result = asyncio.run(_run_role(engine, spec, role, rank))
        if spec.hold:  # report now; finalize and exit once the parent has every report
            conn.send(result)
            conn.poll(spec.timeout)
            engine.finalize()
            return
        engine.finalize()
        result["threads"] = [t.name for t in threading.enumerate() if "weightsync" in t.name]
        result["pid"] = os.getpid()
        conn.send(result)
    except BaseException:
        conn.send({"role": role, "rank": rank, "fatal": traceback.format_exc()})


def _run_inproc(spec: GroupSpec) -> list[dict[str, Any]]:
    cls = CheckpointEngineRegistry.get(spec.backend)
    trainers = [cls(role="trainer", **spec.engine_kwargs) for _ in range(spec.trainers)]
    rollouts = [cls(role="rollout", **spec.engine_kwargs) for _ in range(spec.receivers)]
    tk, rk = cls.build_topology(spec.trainers, spec.receivers,
                                [e.prepare() for e in trainers + rollouts])
    for i, e in enumerate(trainers):
        e.init_process_group(**worker_kwargs(tk, i))
    for j, e in enumerate(rollouts):
        e.init_process_group(**worker_kwargs(rk, j))

    async def main():
        jobs = [_run_role(e, spec, "trainer", i) for i, e in enumerate(trainers)]
        jobs += [_run_role(e, spec, "rollout", j) for j, e in enumerate(rollouts)]
        return await asyncio.wait_for(asyncio.gather(*jobs), spec.timeout)

    if _plain(spec):     # blocking calls: one thread per engine
        roles = [("trainer", i, e) for i, e in enumerate(trainers)] + \
                [("rollout", j, e) for j, e in enumerate(rollouts)]
        with concurrent.futures.ThreadPoolExecutor(len(roles)) as pool:
            futs = [pool.submit(_run_role_plain, e, spec, role, rank) for role, rank, e in roles]
            results = [f.result(spec.timeout) for f in futs]
    else:
        results = list(asyncio.run(main()))
    for e in trainers + rollouts:
        e.finalize()
    return results


def run_group(spec: GroupSpec) -> list[dict[str, Any]]:
    """Run the scenario; returns one result dict per worker (trainers first)."""
    cls = CheckpointEngineRegistry.get(spec.backend)
    if "same_process" in cls.capabilities:
        return _run_inproc(spec)
    ctx = mp.get_context("spawn")
    roles = [("trainer", i) for i in range(spec.trainers)] + \
            [("rollout", j) for j in range(spec.receivers)]
    pipes, procs = [], []
    for role, rank in roles:
        parent, child = ctx.Pipe()
        p = ctx.Process(target=_worker, args=(spec, role, rank, child), daemon=True)
        p.start()
        pipes.append(parent)
        procs.append(p)
    try:
        deadline = time.monotonic() + spec.timeout
        metas = [_recv(c, p, deadline, what="prepare") for c, p in zip(pipes, procs)]
        for m in metas:
            if "fatal" in m or "died" in m or "hung" in m:
                raise RuntimeError(f"a worker failed before the topology: {m}")
        tk, rk = cls.build_topology(spec.trainers, spec.receivers, metas)
        kws = [worker_kwargs(tk, i) for i in range(spec.trainers)] + \
              [worker_kwargs(rk, j) for j in range(spec.receivers)]
        for c, kw in zip(pipes, kws):
            c.send(kw)
        results = _recv_results(pipes, procs, time.monotonic() + spec.timeout,
                                spec.straggler_s)
        if spec.hold:
            for c in pipes:
                try:
                    c.send("release")
                except OSError:  # that worker is gone
                    pass
        return results
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()


def _recv_results(pipes, procs, deadline: float, straggler_s: Optional[float]) -> list[Any]:
    """Every worker's result, polled together: a worker that reports nothing before
    ``deadline``, or for ``straggler_s`` after the latest report of another one, is
    killed and reported as ``{"hung": "result"}``."""
    results: list[Any] = [None] * len(pipes)
    last_report = None
    while any(r is None for r in results):
        now = time.monotonic()
        quiet = straggler_s is not None and last_report is not None \
            and now - last_report > straggler_s
        for i, (conn, proc) in enumerate(zip(pipes, procs)):
            if results[i] is not None:
                continue
            if now > deadline or quiet:
                proc.kill()
                results[i] = {"hung": "result"}
            elif conn.poll(0) or not proc.is_alive():
                results[i] = _recv(conn, proc, deadline, what="result")
                last_report = time.monotonic()
        time.sleep(0.05)
    return results


def _recv(conn, proc, deadline: float, *, what: str) -> Any:
    """A worker's next report; ``{"died": exitcode}`` for a worker that died and
    ``{"hung": what}`` for one that sent nothing before ``deadline`` (it is killed)."""
    while not conn.poll(0.2):
        if not proc.is_alive() and not conn.poll(0.2):
            return {"died": proc.exitcode}
        if time.monotonic() > deadline:
            proc.kill()
            return {"hung": what}
    try:
        return conn.recv()
    except EOFError:
        proc.join(5)
        return {"died": proc.exitcode}
