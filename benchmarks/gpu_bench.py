"""GPU benchmark: the colocated sync as a user writes it, two processes on one GPU.

A trainer process holds a bf16 model of Llama-3-8B's shapes (291 tensors, 16.06 GB;
``--layers`` / ``--scale`` shrink it) and a rollout process the same shapes. Rows, each the
median of ``--warm`` warm syncs after a cold one:

* ``copy``: one flat device-to-device copy of the model's bytes (CUDA events);
* ``into``: ``weightsync.connect("cuda_ipc", ...)`` with no options, the rollout
  ``receive_into(params)``;
* ``weights``: the same, the rollout ``receive_weights`` + ``params[name].copy_(t)``;
* ``delta``: ``connect("cuda_ipc", delta=True)``, ``receive_into``; one row per fraction of
  ``--changed``;
* ``kernels``: the codec's device kernels alone, in the trainer process, at each fraction
  of ``--changed`` and each ``--kernel-configs`` (elements per program x warps x MiB of
  tensors per launch): the GPU time of the mark launches and of the record launches (CUDA
  events, the GPU kept busy while the host queues them), the whole encode as a sync runs
  it (launch a group, finish the one before) and the receiver's verify and commit of the
  records, each checked bit for bit;
* ``ring`` (``--rows ring`` or ``--ring-probe``): ``zero_copy=False``, ``receive_into``, at
  each ``--ring-buckets`` size; with ``--timeline`` every warm sync's engine steps are
  printed (``benchmarks/timeline_costs.py`` reads them: ``weightsync plan``'s ring costs).

Between syncs the trainer flips the lowest bit of a fraction of each tensor's elements at
random positions (a delta row's fraction, else 0.5 %). A sync: both processes leave a
shared barrier, the trainer calls ``send_weights`` and the rollout receives; the sync's
time runs from the barrier to the rollout's ``torch.cuda.synchronize()`` after its
receive, the trainer's host time from the barrier to ``send_weights``' return. After every
sync the rollout compares each of its tensors with the trainer's, bit for bit (outside the
timing; the trainer's tensors shared with it through CUDA IPC). Bytes: what the engine
handed to its transport (``send_weights``' ``bytes``). The parent process never touches
CUDA.

    python benchmarks/gpu_bench.py --out DIR                  # the table, DIR/gpu_bench.json
    python benchmarks/gpu_bench.py --out DIR --scale 8 --layers 2 --warm 3   # a smoke run
    python benchmarks/gpu_bench.py --out DIR --ring-probe > DIR/gpu_bench.txt

``--cpu-smoke`` runs the same plumbing on the CPU (``shm`` for ``cuda_ipc``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import secrets
import socket
import statistics
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(HERE, "..", "src")]

import torch  # noqa: E402
import torch.multiprocessing  # noqa: E402,F401  (pipes share tensors instead of copying)

MiB, GiB = 1 << 20, 1 << 30
DENSE_CHANGED = 0.005
ROWS = ("copy", "kernels", "into", "weights", "delta")
#: The engine steps a --timeline prints (what timeline_costs.py reads).
STEPS = ("_publish", "_publish_refs", "_tx_wait_free", "_finish_stream", "_await_acks",
         "_rx_fetch", "_layout", "_rx_program", "_rx_release", "_rx_finish_stream")


def model_shapes(layers: int, scale: int = 1) -> list[tuple[str, tuple[int, ...]]]:
    """Llama-3-8B: vocab 128256, hidden 4096, MLP 14336, 8 KV heads of 128 (dims / scale)."""
    v, h, m, kv = (x // scale for x in (128256, 4096, 14336, 1024))
    out = [("model.embed_tokens.weight", (v, h))]
    for i in range(layers):
        p = f"model.layers.{i}."
        out += [(p + "input_layernorm.weight", (h,)),
                (p + "self_attn.q_proj.weight", (h, h)), (p + "self_attn.k_proj.weight", (kv, h)),
                (p + "self_attn.v_proj.weight", (kv, h)), (p + "self_attn.o_proj.weight", (h, h)),
                (p + "post_attention_layernorm.weight", (h,)),
                (p + "mlp.gate_proj.weight", (m, h)), (p + "mlp.up_proj.weight", (m, h)),
                (p + "mlp.down_proj.weight", (h, m))]
    return out + [("model.norm.weight", (h,)), ("lm_head.weight", (v, h))]


def event_times(fn, reps: int = 10) -> list[float]:
    """Milliseconds (CUDA events) of the GPU work ``fn`` queues, ``reps`` times after two
    unmeasured runs."""
    times = []
    for k in range(reps + 2):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        if k >= 2:
            times.append(a.elapsed_time(b))
    return times


def flat_copy_times(nbytes: int, reps: int = 10) -> list[float]:
    """Milliseconds of ``reps`` device-to-device copies of ``nbytes``: the physical limit
    each row is a multiple of."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_(0, 256)
    dst = torch.empty_like(src)
    times = event_times(lambda: dst.copy_(src), reps)
    del src, dst
    torch.cuda.empty_cache()
    return times


# -- worker side (one process per role) ------------------------------------------------
class Worker:
    def __init__(self, role: str, args: dict, peer, barrier) -> None:
        self.cuda = not args["cpu_smoke"]
        self.dev = "cuda" if self.cuda else "cpu"
        if self.cuda:
            torch.cuda.set_device(0)
        self.role, self.args, self.peer, self.barrier = role, args, peer, barrier
        self.engine, self.log = None, []
        from weightsync.transport.codec import gpu
        self.group_bytes = gpu.GROUP_BYTES     # the library's launch size
        self.loop = asyncio.new_event_loop()   # one loop for every sync
        self.params = {n: torch.empty(s, dtype=torch.bfloat16, device=self.dev)
                       for n, s in model_shapes(args["layers"], args["scale"])}
        g = torch.Generator(device=self.dev).manual_seed(12345 if role == "trainer" else 9)
        for p in self.params.values():
            p.normal_(generator=g)
        self.gen = torch.Generator(device=self.dev).manual_seed(777)
        if role == "trainer":          # the rollout compares its tensors with these
            peer.send(self.params)       # shared, not copied (torch.multiprocessing)
        else:
            self.ref = peer.recv()
        self.sync()

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def op_d2d(self, reps: int = 10) -> dict:
        nbytes = sum(p.numel() * 2 for p in self.params.values())
        if not self.cuda:
            return {"bytes": nbytes, "flat_ms": 1.0}
        times = flat_copy_times(nbytes, reps)
        # the same bytes as the model's tensors, one copy_ each, in one process: what a
        # per-tensor path costs the GPU before any transport
        dst = {n: torch.empty_like(p) for n, p in self.params.items()}

        def each() -> None:
            for n, p in self.params.items():
                dst[n].copy_(p)
        per = event_times(each, reps)
        del dst
        torch.cuda.empty_cache()
        return {"bytes": nbytes, "flat_ms": statistics.median(times), "flat_all_ms": times,
                "per_tensor_ms": statistics.median(per)}

    def op_kernels(self, fracs: list, configs: list, reps: int) -> dict:
        """The codec's kernels alone on this process's model (the ``kernels`` row)."""
        from collections import deque
        from weightsync.transport.codec import delta, gpu
        from weightsync.transport.codec.state import SMALL
        if not gpu.available(torch.device(self.dev)):
            return {"skipped": "no Triton for this device (CPU: TRITON_INTERPRET=1)"}
        names = [n for n, p in self.params.items()
                 if p.numel() * p.element_size() > SMALL and delta.deltable(p)]

        def grouped(limit: int) -> list:       # as EncodeRun groups the caller's tensors
            groups, cur, size = [], [], 0
            for n in names:
                cur.append(n)
                size += self.params[n].numel() * 2
                if size >= limit or len(cur) >= gpu.GROUP_TENSORS:
                    groups.append(cur)
                    cur, size = [], 0
            return groups + ([cur] if cur else [])
        nbytes = sum(self.params[n].numel() * 2 for n in names)
        base = {n: self.params[n].clone() for n in names}
        target = {n: torch.empty_like(base[n]) for n in names}
        saved = (gpu.BLOCK, gpu.WARPS, gpu.GROUP_BYTES)
        rows = []
        try:
            for frac in fracs:
                for block, warps, group_mib in configs:
                    group_bytes = group_mib * MiB if group_mib else saved[2]
                    gpu.BLOCK, gpu.WARPS, gpu.GROUP_BYTES = block, warps, group_bytes
                    groups = grouped(group_bytes)
                    runs = [self._kernel_run(groups, base, target, frac, gpu, deque)
                            for _ in range(reps + 1)][1:]
                    row = {"changed": frac, "block": block, "warps": warps,
                           "group_mib": group_bytes // MiB, "groups": len(groups),
                           "bytes": nbytes,
                           "ok": all(r["ok"] for r in runs),
                           "record_bytes": runs[-1]["record_bytes"],
                           "dense": runs[-1]["dense"]}
                    for key in ("mark_ms", "records_ms", "encode_ms", "apply_ms"):
                        row[key] = statistics.median(r[key] for r in runs)
                    rows.append(row)
                    print("kernels", json.dumps(row), flush=True)
        finally:
            gpu.BLOCK, gpu.WARPS, gpu.GROUP_BYTES = saved
            del base, target
            if self.cuda:
                torch.cuda.empty_cache()
        return {"rows": rows}

    def _kernel_run(self, groups, base, target, frac, gpu, deque) -> dict:
        self.changed = frac
        self.op_prep()                       # new = params; base holds the last ones
        for n in base:
            target[n].copy_(base[n])         # the receiver holds the last version
        self.sync()
        gpu_ms = [0.0, 0.0]
        enc = gpu.Encoder()

        def timed(k: int, fn):             # GPU ms of what fn queues (events; the GPU
            start = time.perf_counter()    # kept busy while the host queues it)
            if self.cuda:
                torch.cuda._sleep(1 << 21)
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
            out = fn()
            if self.cuda:
                b.record()
                b.synchronize()
                gpu_ms[k] += a.elapsed_time(b)
            else:
                gpu_ms[k] += (time.perf_counter() - start) * 1e3
            return out
        for names in groups:                 # mark, then the records, per group, on copies
            scratch = [base[n].clone() for n in names]
            self.sync()
            g = timed(0, lambda: enc.launch([(n, self.params[n], c)
                                             for n, c in zip(names, scratch)]))
            g.readback.get()
            timed(1, lambda: enc.finish(g))
            del scratch
        self.sync()
        start, pending, recs = time.perf_counter(), deque(), []
        for names in groups:                 # the encode as a sync runs it
            pending.append(enc.launch([(n, self.params[n], base[n]) for n in names]))
            while len(pending) > 1:
                recs += enc.finish(pending.popleft())
        while pending:
            recs += enc.finish(pending.popleft())
        self.sync()
        encode_ms = (time.perf_counter() - start) * 1e3
        start = time.perf_counter()
        dec, dense = gpu.Decoder(torch.device(self.dev)), 0
        for r in recs:
            if r.record is None:             # goes dense: its bytes are in its base
                dense += 1
                target[r.key].copy_(base[r.key])
            else:
                dec.add(r.key, r.record, target[r.key])
        results = dec.results()
        self.sync()
        apply_ms = (time.perf_counter() - start) * 1e3
        ok = all(v for _, v in results) and all(
            torch.equal(target[n].view(torch.int16), self.params[n].view(torch.int16))
            for n in target)
        return {"mark_ms": gpu_ms[0], "records_ms": gpu_ms[1], "encode_ms": encode_ms,
                "apply_ms": apply_ms, "ok": ok,
                "dense": dense,
                "record_bytes": sum(r.record.numel() for r in recs if r.record is not None)}

    def op_connect(self, cfg: dict, address: str, token: str) -> dict:
        import weightsync
        kw = {k: v for k, v in cfg.items() if k in ("bucket_size", "num_slots", "zero_copy")}
        if self.args["cpu_smoke"]:
            kw.pop("zero_copy", None)
        if cfg.get("delta") is not None:
            kw["delta"] = True
        from weightsync.transport.codec import gpu   # this process's codec, per launch
        gpu.GROUP_BYTES = cfg.get("group_mib", 0) * MiB or self.group_bytes
        backend = "shm" if self.args["cpu_smoke"] else "cuda_ipc"
        self.consume = cfg.get("consume", "into")
        self.changed = cfg.get("delta") or DENSE_CHANGED
        free0 = torch.cuda.mem_get_info()[0] if self.cuda else 0
        self.engine = weightsync.connect(backend, role=self.role, address=address, token=token,
                                         timeout=120, device=self.dev, **kw)
        if self.args.get("timeline"):
            self._instrument()
        return {"added_bytes": free0 - torch.cuda.mem_get_info()[0] if self.cuda else 0}

    def _instrument(self) -> None:
        """Log (time, step) around the engine's steps (--timeline)."""
        target = getattr(self.engine, "inner", self.engine)
        for name in STEPS:
            fn = getattr(target, name, None)
            if fn is None:
                continue

            def wrapped(*a, _fn=fn, _name=name, **k):
                self.log.append((time.perf_counter(), _name + ">"))
                try:
                    return _fn(*a, **k)
                finally:
                    self.log.append((time.perf_counter(), "<" + _name))
            setattr(target, name, wrapped)

    def op_prep(self) -> dict:
        """Trainer: flip the lowest bit of this row's fraction of each tensor's elements."""
        for p in self.params.values():
            flat = p.view(-1).view(torch.int16)
            k = max(1, round(self.changed * flat.numel()))
            idx = torch.randint(flat.numel(), (k,), generator=self.gen, device=self.dev)
            flat[idx] ^= 1
        self.sync()
        if self.cuda:
            torch.cuda.empty_cache()
        return {}

    async def _send(self, version: int) -> dict:
        return await self.engine.send_weights(self.params.items(), version=version)

    async def _receive(self, version: int) -> None:
        if self.consume == "into":
            async for _ in self.engine.receive_into(self.params, version=version):
                pass
        else:
            async for name, t in self.engine.receive_weights(version=version):
                self.params[name].copy_(t)

    def op_sync(self, version: int, profile: str = "") -> dict:
        self.sync()
        self.log = []
        prof = None
        if profile:                      # this sync under cProfile: the host's costs
            import cProfile
            prof = cProfile.Profile()
        self.barrier.wait()
        t0 = time.perf_counter()
        if prof is not None:
            prof.enable()
        if self.role == "trainer":
            metrics = self.loop.run_until_complete(self._send(version))
            host_ms = (time.perf_counter() - t0) * 1e3
            self._dump(prof, profile)
            return {"t0": t0, "host_ms": host_ms, "metrics": metrics, "log": self.log}
        self.loop.run_until_complete(self._receive(version))
        self.sync()
        ms = (time.perf_counter() - t0) * 1e3
        self._dump(prof, profile)
        bad = [n for n, p in self.params.items()
               if not torch.equal(p.view(torch.int16), self.ref[n].view(torch.int16))]
        return {"t0": t0, "ms": ms, "bad": bad[:5], "log": self.log,
                "rx": dict(getattr(self.engine, "last_receive", None) or {})}

    def _dump(self, prof, path: str) -> None:
        """Write the profiled sync's top functions (own time, then cumulative) to path."""
        if prof is None:
            return
        import io
        import pstats
        prof.disable()
        text = io.StringIO()
        st = pstats.Stats(prof, stream=text)
        st.sort_stats("tottime").print_stats(30)
        st.sort_stats("cumulative").print_stats(40)
        with open(f"{path}-{self.role}.txt", "w") as f:
            f.write(text.getvalue())

    def op_close(self) -> dict:
        import gc
        self.engine.finalize()
        self.engine = None
        gc.collect()                   # the codec's base copies go before the next row
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.ipc_collect()
            torch.cuda.empty_cache()
        return {}


def worker_main(role: str, args: dict, conn, peer, barrier) -> None:
    try:
        w = Worker(role, args, peer, barrier)
        conn.send({"ready": True, "gpu": torch.cuda.get_device_name() if w.cuda else "cpu"})
    except BaseException:
        conn.send({"error": traceback.format_exc()})
        return
    while True:
        cmd = conn.recv()
        op = cmd.pop("op")
        if op == "quit":
            return
        try:
            conn.send(getattr(w, "op_" + op)(**cmd))
        except BaseException:
            conn.send({"error": f"{role} {op}: {traceback.format_exc()}"})


# -- driver ------------------------------------------------------------------------------
class Driver:
    def __init__(self, args: dict, timeout: float) -> None:
        ctx = mp.get_context("spawn")
        a, b = ctx.Pipe()
        barrier = ctx.Barrier(2)
        self.timeout, self.conns, self.procs = timeout, {}, []
        for role, peer in (("trainer", a), ("rollout", b)):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=worker_main, args=(role, args, child, peer, barrier),
                            daemon=True)
            p.start()
            self.conns[role] = parent
            self.procs.append(p)
        self.ready = {r: self.get(r) for r in self.conns}

    def get(self, role: str) -> dict:
        conn = self.conns[role]
        if not conn.poll(self.timeout):
            raise TimeoutError(f"{role} did not answer in {self.timeout}s")
        out = conn.recv()
        if "error" in out:
            raise RuntimeError(out["error"])
        return out

    def call(self, role: str, op: str, **kw) -> dict:
        self.conns[role].send({"op": op, **kw})
        return self.get(role)

    def both(self, op: str, **kw) -> tuple[dict, dict]:
        for role in ("trainer", "rollout"):
            self.conns[role].send({"op": op, **kw})
        return self.get("trainer"), self.get("rollout")

    def close(self) -> None:
        for conn in self.conns.values():
            try:
                conn.send({"op": "quit"})
            except OSError:
                pass
        for p in self.procs:
            p.join(30)
            if p.is_alive():
                p.kill()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_row(d: Driver, name: str, cfg: dict, warm: int, version: int,
            profile: str = "") -> dict:
    """One configuration: connect, a cold sync and ``warm`` timed ones, close; with
    ``profile``, one more sync under cProfile (``profile``-trainer.txt / -rollout.txt),
    left out of the timings."""
    t, r = d.both("connect", cfg=cfg, address=f"127.0.0.1:{_free_port()}",
                  token=secrets.token_hex(16))
    runs = []
    for k in range(warm + 1):
        d.call("trainer", "prep")
        ts, rs = d.both("sync", version=version + k)
        runs.append({"ms": rs["ms"], "host_ms": ts["host_ms"], "bad": rs["bad"], "rx": rs["rx"],
                     "bytes": int(ts["metrics"].get("bytes", 0)), "metrics": ts["metrics"],
                     "log": [(x, "T " + e) for x, e in ts["log"]] +
                            [(x, "R " + e) for x, e in rs["log"]]})
    if profile:
        d.call("trainer", "prep")
        d.both("sync", version=version + warm + 1, profile=profile)
    d.call("rollout", "close")          # receivers let go first, then the trainer frees
    d.call("trainer", "close")
    warm_runs = runs[1:]
    return {"row": name, "cfg": cfg, "cold_ms": runs[0]["ms"],
            "warm_ms": [x["ms"] for x in warm_runs],
            "median_ms": statistics.median(x["ms"] for x in warm_runs),
            "host_ms": statistics.median(x["host_ms"] for x in warm_runs),
            "bytes": statistics.median(x["bytes"] for x in warm_runs),
            "cold_bytes": runs[0]["bytes"], "all_ok": not any(x["bad"] for x in runs),
            "bad": [x["bad"] for x in runs if x["bad"]][:3],
            "added_bytes": t["added_bytes"] + r["added_bytes"],
            "metrics": warm_runs[-1]["metrics"], "rx_metrics": warm_runs[-1]["rx"],
            "timelines": [{"ms": x["ms"], "log": sorted(x["log"])} for x in warm_runs]}


def timeline(log: list) -> str:
    """One sync's logged steps of both processes, in ms since the first of them."""
    if not log:
        return "(no timeline)"
    t0 = log[0][0]
    rows, prev = [], None
    for t, e in log:               # collapse runs of the same step
        if prev and prev[1] == e:
            prev[2] += 1
            continue
        prev = [t, e, 1]
        rows.append(prev)
    return "\n".join(f"{(t - t0) * 1e3:8.2f} ms  {e}" + (f" x{n}" if n > 1 else "")
                     for t, e, n in rows)


def configs(args: argparse.Namespace) -> list[tuple[str, dict]]:
    rows = [r for r in args.rows.split(",") if r]
    out = []
    base = {} if args.bucket_mib is None else {"bucket_size": args.bucket_mib * MiB}
    for row in rows:
        if row == "into":
            out.append(("default, receive_into", {**base, "consume": "into"}))
        elif row == "weights":
            out.append(("default, receive_weights + copy_", {**base, "consume": "copy"}))
        elif row == "delta":
            groups = [int(x) for x in args.delta_group_mib.split(",") if x] or [0]
            for f in (float(x) for x in args.changed.split(",") if x):
                for g in groups:
                    label = f", {g} MiB per launch" if g else ""
                    out.append((f"delta=True, {f:.1%} changed, receive_into{label}",
                                {**base, "consume": "into", "delta": f,
                                 **({"group_mib": g} if g else {})}))
        elif row == "ring":
            for b in (int(x) for x in args.ring_buckets.split(",") if x):
                out.append((f"ring {b} MiB, zero_copy=False, receive_into",
                            {"bucket_size": b * MiB, "num_slots": 2, "zero_copy": False,
                             "sync": "event", "consume": "into"}))
        elif row not in ("copy", "kernels"):
            raise SystemExit(f"unknown row {row!r}")
    return out


def report(out: dict) -> str:
    a = out["d2d"]["flat_ms"]
    lines = [f"{out['gpu']}, model {out['d2d']['bytes'] / 1e9:.2f} GB bf16 "
             f"({out['tensors']} tensors), median of {out['warm']} warm syncs",
             "| path | ms | x flat copy | trainer host ms | bytes to the transport | "
             "x fewer bytes than dense | bit-exact |", "|---|---|---|---|---|---|---|",
             f"| flat D2D copy of the same bytes | {a:.2f} | 1.00 | - | - | - | - |"]
    per = out["d2d"].get("per_tensor_ms")
    if per:
        lines.append(f"| the same tensors, a copy_ each, one process | {per:.2f} | "
                     f"{per / a:.2f} | - | - | - | - |")
    dense = next((e["bytes"] for e in out["engine"] if e["cfg"].get("delta") is None), None)
    for e in out["engine"]:
        fewer = f"{dense / e['bytes']:.0f}" if dense and e["bytes"] and \
            e["cfg"].get("delta") is not None else "-"
        lines.append(f"| {e['row']} | {e['median_ms']:.2f} | {e['median_ms'] / a:.2f} | "
                     f"{e['host_ms']:.2f} | {e['bytes'] / 1e6:,.1f} MB | {fewer} | "
                     f"{'yes' if e['all_ok'] else 'NO'} |")
    kern = out.get("kernels", {}).get("rows", [])
    if kern:
        lines += ["", "codec kernels alone (trainer process): mark and records GPU ms (CUDA "
                  "events), encode and apply wall ms",
                  "| changed | elements x warps x MiB per launch | mark ms | mark x flat copy | "
                  "mark GB/s read | records ms | encode ms | encode x flat copy | apply ms | "
                  "record MB | dense | bit-exact |", "|---" * 12 + "|"]
        for k in kern:
            lines.append(f"| {k['changed']:.1%} | {k['block']} x {k['warps']} x "
                         f"{k['group_mib']} | {k['mark_ms']:.2f} | {k['mark_ms'] / a:.2f} | "
                         f"{2 * k['bytes'] / k['mark_ms'] / 1e6:,.0f} | {k['records_ms']:.2f} | "
                         f"{k['encode_ms']:.2f} | {k['encode_ms'] / a:.2f} | "
                         f"{k['apply_ms']:.2f} | {k['record_bytes'] / 1e6:,.1f} | "
                         f"{k['dense']} | {'yes' if k['ok'] else 'NO'} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--rows", default=",".join(ROWS),
                    help="comma-separated: copy, into, weights, delta, ring")
    ap.add_argument("--changed", default="0.005,0.05",
                    help="fractions of elements changed between syncs (delta rows)")
    ap.add_argument("--kernel-configs", default="4096x4,2048x4,4096x8,8192x8,4096x4x2048",
                    help="shapes of the kernels row: elements per program x warps [x MiB of "
                         "tensors per launch, default the library's]")
    ap.add_argument("--delta-group-mib", default="",
                    help="delta rows at each of these MiB of tensors diffed per launch "
                         "(default: the library's)")
    ap.add_argument("--ring-buckets", default="256,512,1024,4096", help="MiB (ring rows)")
    ap.add_argument("--bucket-mib", type=int, default=None,
                    help="bucket size of the into / weights / delta rows (default: the "
                         "library's)")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--scale", type=int, default=1, help="divide every dimension")
    ap.add_argument("--warm", type=int, default=5)
    ap.add_argument("--timeline", action="store_true",
                    help="print the engine steps of every warm sync")
    ap.add_argument("--ring-probe", action="store_true",
                    help="the ring rows with --timeline only (benchmarks/timeline_costs.py)")
    ap.add_argument("--profile", nargs="?", const="delta", default="",
                    help="one more sync of each delta row (or 'all' rows) under cProfile in "
                         "both processes: OUT/profile-<row>-<role>.txt")
    ap.add_argument("--cpu-smoke", action="store_true", help="plumbing check: shm on CPU")
    args = ap.parse_args()
    if args.ring_probe:
        args.rows, args.timeline = "ring", True
    os.makedirs(args.out, exist_ok=True)
    d = Driver(vars(args), timeout=900)
    out = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "torch": torch.__version__,
           "gpu": d.ready["trainer"]["gpu"], "layers": args.layers, "scale": args.scale,
           "tensors": len(model_shapes(args.layers, args.scale)), "warm": args.warm,
           "command": " ".join(sys.argv), "engine": []}
    try:
        out["d2d"] = d.call("trainer", "d2d")
        print("d2d", json.dumps(out["d2d"]), flush=True)
        if "kernels" in args.rows.split(","):
            cfgs = [(tuple(int(x) for x in c.split("x")) + (0,))[:3]
                    for c in args.kernel_configs.split(",") if c]
            out["kernels"] = d.call("trainer", "kernels", reps=min(args.warm, 3), configs=cfgs,
                                    fracs=[float(x) for x in args.changed.split(",") if x])
        version = 1
        for name, cfg in configs(args):
            prof = ""
            if args.profile and (cfg.get("delta") is not None or args.profile == "all"):
                slug = "-".join("".join(c if c.isalnum() else " " for c in name).split())
                prof = os.path.join(args.out, "profile-" + slug)
            res = run_row(d, name, cfg, args.warm, version, prof)
            version += args.warm + 2
            logged = res.pop("timelines")
            out["engine"].append(res)
            print("engine", json.dumps({k: v for k, v in res.items() if k != "metrics"}),
                  flush=True)
            if args.timeline:
                for n, sync_log in enumerate(logged, 1):
                    print(f"timeline: warm sync {n} of {len(logged)}, {sync_log['ms']:.2f} ms",
                          flush=True)
                    print(timeline(sync_log["log"]), flush=True)
    finally:
        d.close()
    with open(os.path.join(args.out, "gpu_bench.json"), "w") as f:
        json.dump(out, f, indent=1, default=str)
    print(report(out))


if __name__ == "__main__":
    main()
