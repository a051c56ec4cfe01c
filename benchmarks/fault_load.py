"""Syncs in a row with failures injected, per CPU backend (issue 14, "faults as figures").

Both engines of a pair run in this process (trainer and rollout, each on its own event
loop in its own thread). Each sync sends a fresh version; with probability 1/5 one failure
is injected on the rollout side: ``consumer error`` (the consumer raises mid-sync),
``cancelled task`` (the receiving task is cancelled mid-sync) or ``abandoned`` (the
consumer breaks out of the loop). After a failure the pair is re-initialized where the
backend needs it (``collective``: its group is aborted; as the manager does). Counted:
syncs that delivered wrong or stale data (must be 0), hangs (a side not done within
3 x timeout: must be 0), and the time from the injected failure to the error on each
peer. Not covered here (they need separate processes or a hostile peer; see
tests/test_faults.py and tests/test_wire*.py): killed receiver, truncated message,
wrong token; nor ``nixl``.

    python benchmarks/fault_load.py [--syncs 100] [--backends shm,collective]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import threading
import time

import torch

from weightsync import CheckpointEngineRegistry
from weightsync.core.errors import WeightSyncError
from weightsync.transport.base import worker_kwargs

TIMEOUT = 6.0


def _pair(backend: str, **kw):
    """A trainer and a rollout engine of one group, both in this process."""
    kw = {"bucket_size": 64 * 1024, **kw}
    tr = CheckpointEngineRegistry.new(backend, role="trainer", **kw)
    rx = CheckpointEngineRegistry.new(backend, role="rollout", **kw)
    tk, rk = type(tr).build_topology(1, 1, [tr.prepare(), rx.prepare()])
    ts = [threading.Thread(target=e.init_process_group, kwargs=worker_kwargs(k, 0))
          for e, k in ((tr, tk), (rx, rk))]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    return tr, rx


def _close(*engines) -> None:
    for e in engines:
        try:
            e.finalize()
        except Exception as exc:  # noqa: BLE001 (teardown of a failed pair)
            print(f"  finalize: {exc!r}")
KINDS = ("consumer error", "cancelled task", "abandoned")


def _model(version: int) -> list:
    return [(f"w{i}", torch.full((32 * 1024,), float(version * 100 + i))) for i in range(12)]


async def _receive(rx, version: int, fault: str | None, marks: dict) -> dict:
    got = {}
    async for name, t in rx.receive_weights(version):
        got[name] = t.clone()
        if fault and len(got) == 3:
            marks["injected"] = time.monotonic()
            if fault == "consumer error":
                raise RuntimeError("injected consumer error")
            if fault == "abandoned":
                break
            if fault == "cancelled task":
                asyncio.current_task().cancel()
                await asyncio.sleep(0)
    return got


def _one_sync(tr, rx, version: int, fault: str | None) -> dict:
    marks: dict = {}
    res: dict = {}

    def send() -> None:
        try:
            asyncio.run(tr.send_weights(_model(version), version=version))
            res["sent"] = True
        except BaseException as exc:  # noqa: BLE001 (counted)
            res["send_exc"] = exc
        res["send_end"] = time.monotonic()
    t = threading.Thread(target=send, daemon=True)
    t.start()
    try:
        res["got"] = asyncio.run(_receive(rx, version, fault, marks))
    except (WeightSyncError, RuntimeError, asyncio.CancelledError) as exc:
        res["recv_exc"] = exc
    res["recv_end"] = time.monotonic()
    t.join(3 * TIMEOUT)
    res["hang"] = t.is_alive()
    res["injected"] = marks.get("injected")
    return res


def _wrong(res: dict, version: int) -> bool:
    got = res.get("got")
    if got is None or res.get("injected"):
        return False     # failed or abandoned: nothing delivered as complete
    want = dict(_model(version))
    return set(got) != set(want) or any(not torch.equal(got[k], want[k]) for k in want)


def run(backend: str, syncs: int, seed: int) -> dict:
    rng = random.Random(seed)
    tr, rx = _pair(backend, timeout=TIMEOUT)
    stats = {"syncs": syncs, "faults": 0, "wrong_or_stale": 0, "hangs": 0, "ok": 0,
             "to_error_rx": [], "to_error_tx": [], "unexpected": 0}
    try:
        for v in range(1, syncs + 1):
            fault = rng.choice(KINDS) if rng.random() < 0.2 else None
            res = _one_sync(tr, rx, v, fault)
            stats["hangs"] += res["hang"]
            stats["wrong_or_stale"] += _wrong(res, v)
            if fault:
                stats["faults"] += 1
                inj = res["injected"]
                stats["to_error_rx"].append(res["recv_end"] - inj)
                if "send_exc" in res and "send_end" in res:
                    stats["to_error_tx"].append(max(0.0, res["send_end"] - inj))
            elif "got" in res and "sent" in res:
                stats["ok"] += 1
            else:
                stats["unexpected"] += 1
            if fault and backend == "collective":   # aborted group: re-initialize
                _close(tr, rx)
                tr, rx = _pair(backend, timeout=TIMEOUT)
    finally:
        _close(tr, rx)
    return stats


def _fmt(xs: list) -> str:
    if not xs:
        return "-"
    return f"median {statistics.median(xs) * 1e3:.0f} ms, max {max(xs) * 1e3:.0f} ms"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--syncs", type=int, default=100)
    ap.add_argument("--backends", default="shm,collective")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    for backend in args.backends.split(","):
        start = time.monotonic()
        s = run(backend, args.syncs, args.seed)
        print(f"{backend}: {s['syncs']} syncs in {time.monotonic() - start:.1f}s, "
              f"{s['faults']} injected, {s['ok']} clean ok, wrong/stale={s['wrong_or_stale']}, "
              f"hangs={s['hangs']}, unexpected={s['unexpected']}")
        print(f"  injected failure -> error on the rollout: {_fmt(s['to_error_rx'])}; "
              f"on the trainer: {_fmt(s['to_error_tx'])} ({len(s['to_error_tx'])} raised)")


if __name__ == "__main__":
    main()
