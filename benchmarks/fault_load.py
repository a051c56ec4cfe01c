"""Syncs in a row with failures injected, per CPU backend: what each failure costs.

The trainer engine runs in this process; the rollout engine in a child process, so a
receiver can really die. Each sync sends a fresh version; with probability 1/5 one failure
is injected:

- ``killed receiver``: the rollout process exits (``os._exit``) mid-sync;
- ``consumer error``: the consumer raises mid-sync;
- ``cancelled task``: the receiving task is cancelled mid-sync;
- ``truncated message``: the trainer's control link carries half a frame, then closes;
- ``wrong token``: a rollout engine with a wrong job token tries to join (the pair is
  re-made for it) and must be refused before any byte;
- (``abandoned``, the consumer breaking out of its loop, is the fourth consumer fault; it
  is drawn with the consumer error and the cancel).

After a failure the pair is re-made where the backend or the failure needs it (a dead or
cut peer, an aborted ``collective`` group), as the manager does when it isolates and
re-adds a replica. Counted per backend: syncs that delivered wrong or stale data (the
rollout checks every byte of every complete sync against the version it asked for; must
be 0), hangs (a side not done within 3 x timeout; must be 0), intruders admitted (must be
0), and the time from the injected failure to the error on each peer.

``--slow`` adds the slow-consumer figure: one sync of ``--slow-mib`` consumed the
README's way (``params[name].copy_(t)``) with a sleep per tensor; the rollout's peak extra
memory (VmHWM after ``clear_refs``, params already resident) against the bound of
2 x bucket + the largest tensor.

    python benchmarks/fault_load.py [--syncs 100] [--backends shm,collective,nixl] [--slow]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import random
import secrets
import socket
import statistics
import threading
import time
from typing import Any, Optional

import torch

from weightsync import CheckpointEngineRegistry
from weightsync.core.errors import WeightSyncError
from weightsync.transport.base import worker_kwargs

TIMEOUT = 6.0
KINDS = ("killed receiver", "consumer error", "cancelled task", "truncated message",
         "wrong token")
CONSUMER_FAULTS = ("consumer error", "cancelled task", "abandoned")
REMAKE = {"killed receiver", "truncated message", "wrong token"}
FAULT_AT = 3  # tensors into the sync


def _model(version: int, n: int = 12, numel: int = 32 * 1024) -> list:
    return [(f"w{i}", torch.full((numel,), float(version * 100 + i))) for i in range(n)]


# -- the rollout process ------------------------------------------------------------------
def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


async def _receive(rx, version: int, fault: Optional[str], conn, slow: float,
                   params: Optional[dict], out: dict) -> dict:
    """Fills ``out`` as it goes (so a failed sync still reports when its fault struck)."""
    out.update(n=0, wrong=False)
    want = None if params is not None else dict(_model(version))
    async for name, t in rx.receive_weights(version):
        out["n"] += 1
        if params is not None:      # the README's way
            params[name].copy_(t)
        elif name not in want or not torch.equal(t, want[name]):
            out["wrong"] = True
        if slow:
            time.sleep(slow)
        if fault and out["n"] == FAULT_AT:
            out["injected"] = time.monotonic()
            if fault == "killed receiver":
                conn.send({"injected": out["injected"], "killed": True})
                os._exit(17)
            if fault == "consumer error":
                raise RuntimeError("injected consumer error")
            if fault == "abandoned":
                break
            if fault == "cancelled task":
                asyncio.current_task().cancel()
                await asyncio.sleep(0)
    if want is not None and not fault and out["n"] != len(want):
        out["wrong"] = True
    return out


def _rollout_main(conn, backend: str, kw: dict) -> None:
    torch.set_num_threads(1)
    rx = CheckpointEngineRegistry.new(backend, role="rollout", **kw)
    conn.send(rx.prepare())
    rk = conn.recv()
    try:
        rx.init_process_group(**rk)
        conn.send({"init": "ok"})
    except Exception as exc:  # noqa: BLE001 (reported)
        conn.send({"init": type(exc).__name__, "msg": str(exc)[:200]})
        return
    params: Optional[dict] = None
    while True:
        cmd = conn.recv()
        if cmd[0] == "close":
            try:
                rx.finalize()
            finally:
                conn.send({"closed": True})
            return
        if cmd[0] == "params":   # the slow-consumer run: resident destination tensors
            params = {name: torch.zeros_like(t) for name, t in _model(0, *cmd[1:])}
            conn.send({"ok": True})
            continue
        _, version, fault, slow = cmd
        res: dict = {}
        if params is not None:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # reset the peak RSS
            res["rss0"] = _rss_kib("VmRSS")
        try:
            asyncio.run(_receive(rx, version, fault, conn, slow, params, res))
            if params is not None:
                res["hwm"] = _rss_kib("VmHWM")  # before the check below allocates
                first = next(iter(params.values()))
                want = dict(_model(version, len(params), first.numel()))
                res["wrong"] = any(not torch.equal(params[k], want[k]) for k in want)
        except (WeightSyncError, RuntimeError, asyncio.CancelledError) as exc:
            res["exc"] = f"{type(exc).__name__}: {str(exc)[:160]}"
        res["end"] = time.monotonic()
        conn.send(res)


# -- the trainer side ----------------------------------------------------------------------
class Pair:
    """A trainer engine here and a rollout engine in a child process, one group."""

    def __init__(self, backend: str, *, wrong_token: bool = False, **kw: Any) -> None:
        kw = {"bucket_size": 64 * 1024, "timeout": TIMEOUT, **kw}
        self.backend = backend
        self.tr = CheckpointEngineRegistry.new(backend, role="trainer", **kw)
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_rollout_main, args=(child, backend, kw), daemon=True)
        self.proc.start()
        if not self.conn.poll(120):
            raise RuntimeError("rollout process did not start")
        meta = self.conn.recv()
        tk, rk = type(self.tr).build_topology(1, 1, [self.tr.prepare(), meta])
        rk0 = worker_kwargs(rk, 0)
        if wrong_token:
            rk0["token"] = secrets.token_hex(16)
        self.conn.send(rk0)
        self.init_error: Optional[BaseException] = None
        t0 = time.monotonic()
        try:
            self.tr.init_process_group(**worker_kwargs(tk, 0))
        except WeightSyncError as exc:
            self.init_error = exc
        self.init_s = time.monotonic() - t0
        self.rx_init = self.conn.recv() if self.conn.poll(3 * TIMEOUT) else {"init": "hang"}

    def sync(self, version: int, fault: Optional[str], slow: float = 0.0,
             model: Any = None) -> dict:
        res: dict = {"fault": fault}
        if fault == "truncated message":
            self._truncate_next_frame(res)
        rx_fault = fault if fault in ("killed receiver",) + CONSUMER_FAULTS else None
        self.conn.send(("sync", version, rx_fault, slow))

        def send() -> None:
            try:
                asyncio.run(self.tr.send_weights(model or _model(version), version=version))
                res["sent"] = True
            except BaseException as exc:  # noqa: BLE001 (counted)
                res["send_exc"] = f"{type(exc).__name__}: {str(exc)[:160]}"
            res["send_end"] = time.monotonic()
        t = threading.Thread(target=send, daemon=True)
        t.start()
        deadline = time.monotonic() + 3 * TIMEOUT + slow * 1000
        rx = None
        while time.monotonic() < deadline:
            if self.conn.poll(0.05):
                try:
                    rx = self.conn.recv()
                except EOFError:
                    rx = None
                    break
                if rx.get("killed"):
                    res["injected"] = rx["injected"]
                    self.proc.join(5)
                    rx = {"exc": "killed", "end": rx["injected"]}
                break
            if not self.proc.is_alive():
                break
        res["rx"] = rx
        t.join(max(0.0, deadline - time.monotonic()) + 0.1)
        res["hang"] = t.is_alive() or rx is None
        if rx and "injected" in rx:
            res["injected"] = rx["injected"]
        return res

    def _truncate_next_frame(self, res: dict) -> None:
        hub = self.tr._hub
        orig = hub._send
        count = {"n": 0}

        def send(rank: int, frame: bytes) -> None:
            count["n"] += 1
            if count["n"] != 1:      # the sync's first frame, the receiver waiting on it
                return orig(rank, frame)
            conn = hub._conns[rank]
            conn.setblocking(True)
            conn.sendall(frame[: max(1, len(frame) // 2)])
            res["injected"] = time.monotonic()
            conn.shutdown(socket.SHUT_RDWR)
            hub._send = orig
            return orig(rank, frame)  # the link is gone: this raises as a real cut would
        hub._send = send

    def close(self) -> None:
        try:
            if self.proc.is_alive():
                self.conn.send(("close",))
                if self.conn.poll(3 * TIMEOUT):
                    self.conn.recv()
        except (OSError, EOFError):
            pass
        self.proc.join(5)
        if self.proc.is_alive():
            self.proc.kill()
        try:
            self.tr.finalize()
        except Exception as exc:  # noqa: BLE001 (teardown of a failed pair)
            print(f"  finalize: {exc!r}")


def run(backend: str, syncs: int, seed: int) -> dict:
    rng = random.Random(seed)
    stats: dict = {"syncs": syncs, "faults": {}, "wrong_or_stale": 0, "hangs": 0, "ok": 0,
                   "to_error_rx": [], "to_error_tx": [], "unexpected": [], "intruders": 0, "refused_s": [],
                   "intruder_side": [], "by_kind": {}}
    pair = Pair(backend)
    drawn = 0
    try:
        for v in range(1, syncs + 1):
            fault = None
            if rng.random() < 0.2:    # the kinds in turn, so that each one is drawn
                fault = KINDS[drawn % len(KINDS)]
                drawn += 1
                if fault == "consumer error":
                    fault = rng.choice(CONSUMER_FAULTS)
            if fault:
                stats["faults"][fault] = stats["faults"].get(fault, 0) + 1
            if fault == "wrong token":
                pair.close()
                intruder = Pair(backend, wrong_token=True)
                if intruder.init_error is None:   # the trainer let it in
                    stats["intruders"] += 1
                else:
                    stats["refused_s"].append(intruder.init_s)
                stats["intruder_side"].append(intruder.rx_init.get("init"))
                intruder.close()
                pair = Pair(backend)
                continue
            res = pair.sync(v, fault)
            rx = res["rx"] or {}
            stats["hangs"] += res["hang"]
            complete = not fault and "exc" not in rx and res.get("sent")
            if complete:
                stats["ok"] += 1
                stats["wrong_or_stale"] += bool(rx.get("wrong"))
            elif not fault:
                stats["unexpected"].append((v, rx.get("exc"), res.get("send_exc")))
            else:
                inj = res.get("injected")
                kind = stats["by_kind"].setdefault(fault, {"rx": [], "tx": [], "tx_done": 0})
                if inj is not None:
                    if "end" in rx and "exc" in rx and fault != "killed receiver":
                        stats["to_error_rx"].append(max(0.0, rx["end"] - inj))
                        kind["rx"].append(max(0.0, rx["end"] - inj))
                    if "send_exc" in res:
                        stats["to_error_tx"].append(max(0.0, res["send_end"] - inj))
                        kind["tx"].append(max(0.0, res["send_end"] - inj))
                    elif res.get("sent"):
                        kind["tx_done"] += 1  # the trainer had finished: nothing to raise
            if fault and (fault in REMAKE or backend == "collective" or res["hang"]):
                pair.close()
                pair = Pair(backend)
    finally:
        pair.close()
    return stats


def slow_consumer(backend: str, mib: int, per_tensor_s: float, bucket_mib: int) -> dict:
    numel = 1 << 20   # 4 MiB fp32 tensors
    n = max(1, mib // 4)
    model = _model(1, n, numel)
    pair = Pair(backend, bucket_size=bucket_mib << 20, timeout=60.0)
    try:
        pair.conn.send(("params", n, numel))
        pair.conn.recv()
        res = pair.sync(1, None, slow=per_tensor_s, model=model)
        rx = res["rx"] or {}
        extra = (rx.get("hwm", 0) - rx.get("rss0", 0)) / 1024
        bound = 2 * bucket_mib + 4
        return {"extra_mib": extra, "bound_mib": bound, "wrong": rx.get("wrong"),
                "exc": rx.get("exc") or res.get("send_exc"), "hang": res["hang"]}
    finally:
        pair.close()


def _fmt(xs: list) -> str:
    if not xs:
        return "-"
    return f"median {statistics.median(xs) * 1e3:.0f} ms, max {max(xs) * 1e3:.0f} ms"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--syncs", type=int, default=100)
    ap.add_argument("--backends", default="shm,collective,nixl")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--slow", action="store_true", help="add the slow-consumer memory figure")
    ap.add_argument("--slow-mib", type=int, default=256)
    ap.add_argument("--slow-bucket-mib", type=int, default=32)
    args = ap.parse_args()
    for backend in args.backends.split(","):
        start = time.monotonic()
        if args.syncs:
            s = run(backend, args.syncs, args.seed)
            print(f"{backend}: {s['syncs']} syncs in {time.monotonic() - start:.1f}s, "
                  f"injected {sum(s['faults'].values())} {dict(sorted(s['faults'].items()))}, "
                  f"{s['ok']} clean ok, wrong/stale={s['wrong_or_stale']}, hangs={s['hangs']}, "
                  f"intruders admitted={s['intruders']}, unexpected={len(s['unexpected'])}")
            for u in s["unexpected"][:5]:
                print(f"  unexpected: {u}")
            print(f"  injected failure -> error on the rollout: {_fmt(s['to_error_rx'])}; "
                  f"on the trainer: {_fmt(s['to_error_tx'])} ({len(s['to_error_tx'])} raised); "
                  f"wrong token refused by the trainer's init after {_fmt(s['refused_s'])} "
                  f"(its timeout), the intruder's own init said {s['intruder_side']}",
                  flush=True)
            for kind, k in sorted(s["by_kind"].items()):
                print(f"    {kind}: error on the rollout {_fmt(k['rx'])}; on the trainer "
                      f"{_fmt(k['tx'])} ({len(k['tx'])} raised, {k['tx_done']} had already "
                      f"sent everything)", flush=True)
        if args.slow:
            r = slow_consumer(backend, args.slow_mib, 0.02, args.slow_bucket_mib)
            print(f"  slow consumer ({args.slow_mib} MiB, 20 ms per 4 MiB tensor, "
                  f"{args.slow_bucket_mib} MiB buckets): rollout peak extra memory "
                  f"{r['extra_mib']:.0f} MiB (bound {r['bound_mib']} MiB), wrong={r['wrong']}, "
                  f"error={r['exc']}, hang={r['hang']}", flush=True)


if __name__ == "__main__":
    main()
