"""GPU benchmark of ``cuda_ipc`` on one GPU: trainer and rollout processes share it.

One run measures, on a synthetic bf16 model with Llama-3-8B shapes (16.06 GB):

(a)  one device-to-device copy of the model's bytes (flat), and a per-tensor copy;
(b)  ``cuda_ipc`` syncs, cold and warm (median of ``--warm`` runs), over a bucket-size
     sweep, and the zero-copy option; extra device memory of each configuration;
(c)  a verl-style baseline (one IPC bucket per sync, an acknowledgement per bucket,
     per-tensor copies on the receiver; see ``verl_baseline.py``).

Every sync is checked: the trainer draws fresh weights before it, and both sides compare
per-tensor checksums after it. Usage: ``python benchmarks/gpu_bench.py --out DIR``;
``--layers 2`` gives a quick small run. Results: ``DIR/gpu_bench.json`` and a table on
stdout. The parent process never touches CUDA.

Experiments (environment): ``GPU_BENCH_SETTLE_MS`` sleeps between the trainer's draw of
fresh weights (~70 ms of kernels) and the sync: right after those kernels the receiver's
copies ran ~1 ms slower on one H100 (BENCHMARKS.md, session 20). With ``--timeline`` both
processes log their engine steps in every warm sync (printed after each configuration's
``engine`` line, a ``timeline: warm sync k of n`` block each; until session 32 only the
last one), and the receiver times its copies on the GPU and replays them after each sync
(``rx_gpu_span_ms``, ``rx_replay_ms``); ``GPU_BENCH_DEFER=1`` holds a zero-copy sync's copy
programs until the end message, ``GPU_BENCH_QUIET=trainer,rollout`` delays the end's polling.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(HERE, "..", "src")]

import torch  # noqa: E402

MiB, GiB = 1 << 20, 1 << 30


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


# -- worker side (one process per role) ------------------------------------------------
def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class Worker:
    """``--cpu-smoke`` runs the same plumbing with the shm backend on the CPU."""

    def __init__(self, role: str, args: dict, peer) -> None:
        self.cuda = not args["cpu_smoke"]
        self.dev = "cuda" if self.cuda else "cpu"
        self.backend = "cuda_ipc" if self.cuda else "shm"
        if self.cuda:
            torch.cuda.set_device(0)
        self.role, self.peer, self.engine, self.args = role, peer, None, args
        self.log: list = []
        self.loop = asyncio.new_event_loop()  # one loop for every sync: no set-up in timings
        self.params = {n: torch.empty(s, dtype=torch.bfloat16, device=self.dev)
                       for n, s in model_shapes(args["layers"], args["scale"])}
        self.fill(12345 if role == "trainer" else 999)
        if self.cuda:
            from weightsync.transport.backends.cuda_ipc.ops import CudaIpcOps
            self.ops = CudaIpcOps("cuda")

    def fill(self, seed: int) -> None:
        g = torch.Generator(device=self.dev).manual_seed(seed)
        for p in self.params.values():
            p.normal_(generator=g)
        sync()

    def perturb(self, seed: int, changed: float) -> None:
        """Flip the lowest bit of ``changed`` of each tensor's elements (random positions,
        a few may repeat): a training step's sparse change, as ``weightsync bench
        --changed`` makes it."""
        g = torch.Generator(device=self.dev).manual_seed(seed)
        for p in self.params.values():
            flat = p.view(-1).view(torch.int16)
            k = max(1, round(changed * flat.numel()))
            flat[torch.randint(flat.numel(), (k,), generator=g, device=self.dev)] ^= 1
        sync()

    def checksum(self) -> list[int]:
        sums = []
        for p in self.params.values():
            v = p.view(torch.int16).view(-1)
            sums += [v.sum(dtype=torch.int64), v[::1021].sum(dtype=torch.int64)]
        return [int(x) for x in torch.stack(sums).tolist()]

    def mem(self) -> dict:
        if not self.cuda:
            return {"free": 0, "total": 0, "allocated": 0, "reserved": 0}
        free, total = torch.cuda.mem_get_info()
        return {"free": free, "total": total, "allocated": torch.cuda.memory_allocated(),
                "reserved": torch.cuda.memory_reserved()}

    def op_d2d(self, reps: int = 10) -> dict:
        nbytes = sum(p.numel() * 2 for p in self.params.values())
        src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_(0, 256)
        dst = torch.empty_like(src)
        flat = timed(lambda: dst.copy_(src), reps)
        # the same copy right after a draw of fresh weights and its checksum, as every sync
        # of this bench starts (the copies of a sync ran ~1 ms slower there on one H100)
        seeds = iter(range(777, 1000))
        after = timed(lambda: dst.copy_(src), max(3, reps // 2), warm=0,
                      before=lambda: (self.fill(next(seeds)), self.checksum()))
        del src, dst
        copy = {n: torch.empty_like(p) for n, p in self.params.items()}
        per_tensor = timed(lambda: [copy[n].copy_(p) for n, p in self.params.items()], 5)
        del copy
        torch.cuda.empty_cache()
        return {"bytes": nbytes, "flat_ms": flat, "per_tensor_ms": per_tensor,
                "flat_after_draw_ms": after}

    def op_engine_prepare(self, cfg: dict) -> dict:
        from weightsync import CheckpointEngineRegistry
        self.views = bool(cfg.pop("views", False))
        consume = cfg.pop("consume", "copy")
        self.into = consume in ("into", "into-detach")
        # into-detach: new views of the parameters every sync, as HfReplica's land_in hands
        # receive_into {name: param.detach()}
        self.detach = consume == "into-detach"
        if not self.cuda:
            cfg = {k: v for k, v in cfg.items() if k not in (
                "zero_copy", "sync", "stream_waits", "links", "ref_first_bytes",
                "rx_stream_waits", "graph_branches", "fill_graphs", "push")}
        # delta: the codec over the same transport; the trainer then changes that fraction
        # of its elements between syncs (op_prep) instead of drawing all of them again
        self.changed, self.primed = cfg.pop("delta", None), False
        name = self.backend if self.changed is None else f"delta+{self.backend}"
        if self.changed is not None:   # the codec engine takes the transport's common options
            cfg = {k: v for k, v in cfg.items() if k in ("bucket_size", "num_slots")}
        self.engine = CheckpointEngineRegistry.new(name, role=self.role, device=self.dev,
                                                   timeout=120, **cfg)
        return {"meta": self.engine.prepare()}

    def op_engine_init(self, kw: dict) -> dict:
        self.engine.init_process_group(**kw)
        if self.args.get("timeline"):
            self._instrument()
        return {}

    def _instrument(self) -> None:
        """Timeline of one sync: wrap engine methods to log (monotonic time, event)."""
        self.log: list = []
        if self.cuda and self.role == "rollout":
            self._gpu_marks()
        quiet = os.environ.get("GPU_BENCH_QUIET", "")
        if self.role in quiet.split(","):   # experiment: no host polling at the sync's end
            poll = self.engine._wait_event

            def wait_event(event, *, peer, phase, version, _poll=poll):
                if peer.startswith("rollout rank"):   # the end's "done" event(s)
                    time.sleep(0.02)
                return _poll(event, peer=peer, phase=phase, version=version)
            self.engine._wait_event = wait_event
        names = ("_publish", "_publish_refs", "_tx_wait_free", "_finish_stream", "_await_acks",
                 "_rx_fetch", "_layout", "_rx_program", "_rx_release", "_rx_finish_stream",
                 "_report", "_await_offers", "_issue_pushes", "_rx_pushed_wait")
        for name in names:
            fn = getattr(self.engine, name, None)
            if fn is None:
                continue

            def wrapped(*a, _fn=fn, _name=name, **k):
                self.log.append((time.perf_counter(), _name + ">"))
                try:
                    if getattr(self, "tracer", None) is None:
                        return _fn(*a, **k)
                    with torch.profiler.record_function("ws" + _name):  # in --cuda-trace
                        return _fn(*a, **k)
                finally:
                    self.log.append((time.perf_counter(), "<" + _name))
            setattr(self.engine, name, wrapped)

    def _gpu_marks(self) -> None:
        """GPU span of a receive's copies: a CUDA event before the first copy program
        runs and one when the stream's end is handled (behind every copy)."""
        self.gpu_marks: list = []
        self.replays: list = []
        self.deferred: list = []
        # GPU_BENCH_DEFER=1: hold every copy program of a sync until the trainer's end
        # message is handled, then launch them back to back (both hosts then only wait)
        defer = os.environ.get("GPU_BENCH_DEFER") == "1"
        make = self.engine._rx_copy_runner
        fin = self.engine._rx_finish_stream

        def runner_factory():
            run = make()

            def marked(pairs):
                self.replays.append((run, pairs))
                if defer:   # experiment: every program runs at the stream's end (below)
                    self.deferred.append((run, pairs))
                    return None
                mark_once()
                return run(pairs)
            return marked

        def mark_once():
            if not self.gpu_marks:
                self.gpu_marks.append(torch.cuda.Event(enable_timing=True))
                self.gpu_marks[0].record()

        def finish(*a, **k):
            if self.deferred:
                mark_once()
                for run, pairs in self.deferred:
                    run(pairs)
                self.deferred = []
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self.gpu_marks.append(end)
            return fin(*a, **k)
        self.engine._rx_copy_runner = runner_factory
        self.engine._rx_finish_stream = finish

    def gpu_times(self) -> dict:
        """The last receive's copies on the GPU (``gpu_span_ms``), then the same programs
        replayed at once, back to back (``replay_ms``) and launched 0.4 ms apart as in a
        sync (``replay_spaced_ms``); empty without ``--timeline`` on a GPU."""
        marks, self.gpu_marks = getattr(self, "gpu_marks", []), []
        replays, self.replays = getattr(self, "replays", []), []
        if len(marks) < 2:
            return {}
        marks[-1].synchronize()

        def replay(gap: float) -> None:
            for run, pairs in replays:
                run(pairs)
                time.sleep(gap)
        return {"gpu_span_ms": marks[0].elapsed_time(marks[-1]),
                "replay_ms": timed(lambda: replay(0.0), 1, torch.cuda.synchronize, warm=0),
                "replay_spaced_ms": timed(lambda: replay(0.0004), 1, torch.cuda.synchronize,
                                          warm=0)}

    def op_engine_close(self) -> dict:
        self.engine.finalize()
        self.engine = None
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.ipc_collect()
            torch.cuda.empty_cache()
        return {}

    def _tidy(self) -> None:
        if self.cuda:  # checksum temporaries must not count as engine memory
            torch.cuda.empty_cache()

    def _mark(self) -> int:
        if not self.cuda:
            return 0
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated()

    def _peak(self, base: int) -> int:
        return torch.cuda.max_memory_allocated() - base if self.cuda else 0

    def op_prep(self, seed: int) -> dict:
        if getattr(self, "changed", None) is not None and self.primed:
            self.perturb(seed, self.changed)
        else:
            self.fill(seed)
            self.primed = True
        out = {"checksum": self.checksum()}
        self._tidy()
        return out

    async def _send(self, version: int) -> dict:
        base = self._mark()
        self.log.clear()
        start = time.perf_counter()
        self.log.append((start, "send_weights>"))
        # views: new tensor objects over the same storage every sync (FSDP2's unsharded
        # buffers, merged-LoRA exports)
        items = [(n, p.view(p.shape)) for n, p in self.params.items()] if self.views \
            else self.params.items()
        if getattr(self, "tracer", None) is not None:
            with torch.profiler.record_function("ws_send_weights"):
                metrics = await self.engine.send_weights(items, version=version)
        else:
            metrics = await self.engine.send_weights(items, version=version)
        self.log.append((time.perf_counter(), "<send_weights"))
        return {"ms": (time.perf_counter() - start) * 1e3, "metrics": metrics,
                "peak": self._peak(base), "log": list(self.log)}

    def op_trace(self, on: bool, path: str = "") -> dict:
        """torch.profiler (CUDA activity) over the following syncs (``on``), or stop it and
        write a Chrome trace to ``path``."""
        from torch.profiler import ProfilerActivity, profile
        if on:
            self.tracer = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
            self.tracer.__enter__()
            return {}
        self.tracer.__exit__(None, None, None)
        self.tracer.export_chrome_trace(path)
        self.tracer = None
        return {}

    def op_profile(self, on: bool, path: str = "") -> dict:
        """cProfile the following syncs of this process (``on``), or dump the stats."""
        import cProfile
        import io
        import pstats
        if on:
            self.prof = cProfile.Profile()
            return {}
        stats = pstats.Stats(self.prof, stream=io.StringIO())
        out = stats.stream
        for key in ("tottime", "cumulative"):
            stats.sort_stats(key).print_stats(45)
        with open(path, "w") as f:
            f.write(out.getvalue())
        self.prof = None
        return {}

    def _profiled(self, coro):
        prof = getattr(self, "prof", None)
        if prof is None:
            return self.loop.run_until_complete(coro)
        prof.enable()
        try:
            return self.loop.run_until_complete(coro)
        finally:
            prof.disable()

    def op_send(self, version: int) -> dict:
        sync()
        return self._profiled(self._send(version))

    async def _receive(self, conn, version: int) -> None:
        conn.send({"listening": True})
        self.log.clear()
        start, first = time.perf_counter(), None
        if self.into:   # the README's consumer: the engine lands the bytes in params
            into = {n: p.detach() for n, p in self.params.items()} if self.detach \
                else self.params
            async for name, t in self.engine.receive_into(into, version=version):
                if first is None:
                    first = time.perf_counter()
        else:
            async for name, t in self.engine.receive_weights(version=version):
                if first is None:
                    first = time.perf_counter()
                self.params[name].copy_(t)
        self.log.append((time.perf_counter(), "consumer done"))
        self.times = {"first_ms": ((first or start) - start) * 1e3,
                      "loop_ms": (time.perf_counter() - (first or start)) * 1e3}

    def op_recv(self, version: int, conn) -> dict:
        base = self._mark()
        self._profiled(self._receive(conn, version))
        sync()
        out = {"peak": self._peak(base), "checksum": self.checksum(), **self.times,
               "log": list(self.log), **self.gpu_times()}
        self._tidy()
        return out

    def op_baseline_send(self, bucket: int) -> dict:
        import verl_baseline
        return {"ms": verl_baseline.send(self.params, self.peer, bucket, self.ops) * 1e3}

    def op_baseline_recv(self, conn) -> dict:
        import verl_baseline
        conn.send({"listening": True})
        verl_baseline.receive(self.params, self.peer, self.ops)
        out = {"checksum": self.checksum()}
        self._tidy()
        return out


def timed(fn, reps: int, before=None, warm: int = 2) -> float:
    """Median milliseconds of ``fn`` on the GPU (CUDA events, ``warm`` warm-ups); ``before``
    runs ahead of each timed call, untimed."""
    for _ in range(warm):
        fn()
    times = []
    for _ in range(reps):
        if before is not None:
            before()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def worker_main(role: str, args: dict, conn, peer) -> None:
    if args.get("switch_interval"):
        sys.setswitchinterval(args["switch_interval"])
    try:
        w = Worker(role, args, peer)
        conn.send({"ready": True, "mem": w.mem(),
                   "gpu": torch.cuda.get_device_name() if w.cuda else "cpu"})
    except BaseException:
        conn.send({"error": traceback.format_exc()})
        return
    while True:
        cmd = conn.recv()
        op = cmd.pop("op")
        if op == "quit":
            return
        try:
            if op in ("recv", "baseline_recv"):
                cmd["conn"] = conn
            conn.send(getattr(w, "op_" + op)(**cmd) if op != "mem" else w.mem())
        except BaseException:
            conn.send({"error": f"{role} {op}: {traceback.format_exc()}"})


# -- driver ------------------------------------------------------------------------------
class Driver:
    def __init__(self, args: dict, timeout: float) -> None:
        ctx = mp.get_context("spawn")
        a, b = ctx.Pipe()
        self.timeout, self.args = timeout, args
        # experiment: let the GPU settle after the trainer's prep (random fill and checksum,
        # ~70 ms of kernels) before each sync
        self.settle_s = float(os.environ.get("GPU_BENCH_SETTLE_MS", "0")) / 1e3
        self.conns, self.procs = {}, []
        for role, peer in (("trainer", a), ("rollout", b)):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=worker_main, args=(role, args, child, peer), daemon=True)
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

    def both(self, op: str, trainer_kw: dict, rollout_kw: dict) -> tuple[dict, dict]:
        self.conns["trainer"].send({"op": op, **trainer_kw})
        self.conns["rollout"].send({"op": op, **rollout_kw})
        return self.get("trainer"), self.get("rollout")

    def sync_once(self, seed: int, baseline_bucket: int = 0) -> dict:
        want = self.call("trainer", "prep", seed=seed)["checksum"]
        time.sleep(self.settle_s)
        rop, top = ("baseline_recv", "baseline_send") if baseline_bucket else ("recv", "send")
        self.conns["rollout"].send({"op": rop, **({} if baseline_bucket else {"version": seed})})
        self.get("rollout")  # listening
        sent = self.call("trainer", top, **({"bucket": baseline_bucket} if baseline_bucket
                                            else {"version": seed}))
        got = self.get("rollout")
        sent["ok"] = got["checksum"] == want
        sent["rx_peak"] = got.get("peak", 0)
        sent["rx_times"] = {k: got[k] for k in ("first_ms", "loop_ms") if k in got}
        sent["rx_log"] = got.get("log", [])
        for key in ("gpu_span_ms", "replay_ms", "replay_spaced_ms"):
            sent["rx_" + key] = got.get(key)
        return sent

    def close(self) -> None:
        for conn in self.conns.values():
            conn.send({"op": "quit"})
        for p in self.procs:
            p.join(30)
            if p.is_alive():
                p.kill()


def run_profile(d: Driver, cfg: dict, out_dir: str, tag: str, seed0: int) -> dict:
    """One cold sync, then three warm ones under cProfile in both processes."""
    from weightsync.transport.base import worker_kwargs
    t, r = d.both("engine_prepare", {"cfg": cfg}, {"cfg": cfg})
    tk, rk = _engine_class(d, cfg).build_topology(1, 1, [t["meta"], r["meta"]])
    d.both("engine_init", {"kw": worker_kwargs(tk, 0)}, {"kw": worker_kwargs(rk, 0)})
    plain = [d.sync_once(seed0 + i) for i in range(3)]
    plain = [(x["ms"], x["rx_times"]) for x in plain]
    d.both("profile", {"on": True}, {"on": True})
    prof = [d.sync_once(seed0 + 3 + i)["ms"] for i in range(3)]
    for role in ("trainer", "rollout"):
        d.call(role, "profile", on=False, path=os.path.join(out_dir, f"prof_{tag}_{role}.txt"))
    d.call("rollout", "engine_close")
    d.call("trainer", "engine_close")
    return {"cfg": cfg, "plain_ms": plain, "profiled_ms": prof}


def _engine_class(d: Driver, cfg: dict) -> type:
    """The engine class the workers made for ``cfg`` (its build_topology)."""
    from weightsync import CheckpointEngineRegistry
    name = "shm" if d.args.get("cpu_smoke") else "cuda_ipc"
    return CheckpointEngineRegistry.get(name if cfg.get("delta") is None else f"delta+{name}")


def run_engine(d: Driver, cfg: dict, warm: int, seed0: int, trace: str = "") -> dict:
    from weightsync.transport.base import worker_kwargs
    free0 = d.call("trainer", "mem")["free"]
    t, r = d.both("engine_prepare", {"cfg": cfg}, {"cfg": cfg})
    tk, rk = _engine_class(d, cfg).build_topology(1, 1, [t["meta"], r["meta"]])
    d.both("engine_init", {"kw": worker_kwargs(tk, 0)}, {"kw": worker_kwargs(rk, 0)})
    ring = free0 - d.call("trainer", "mem")["free"]  # device-wide, both processes
    runs = [d.sync_once(seed0 + i) for i in range(warm + 1)]
    if trace:   # one more warm sync, traced on both sides (not counted)
        d.both("trace", {"on": True}, {"on": True})
        d.sync_once(seed0 + warm + 1)
        for role in ("trainer", "rollout"):
            d.call(role, "trace", on=False, path=f"{trace}_{role}.json")
    d.call("rollout", "engine_close")  # receivers let go first, then the trainer frees
    d.call("trainer", "engine_close")
    warm_ms = [x["ms"] for x in runs[1:]]
    transient = max(x["peak"] + x["rx_peak"] for x in runs[1:])
    # --timeline: every warm sync's steps on both sides (printed by main, not kept in the JSON)
    logged = [{"ms": x["ms"], "log": x.get("log", []), "rx_log": x.get("rx_log", [])}
              for x in runs[1:]]
    gpu = {}
    for key in ("rx_gpu_span_ms", "rx_replay_ms", "rx_replay_spaced_ms"):
        got = [x[key] for x in runs[1:] if x.get(key)]
        gpu[key] = statistics.median(got) if got else None
    return {"cfg": cfg, "cold_ms": runs[0]["ms"], "warm_ms": warm_ms,
            "median_ms": statistics.median(warm_ms), "all_ok": all(x["ok"] for x in runs),
            "ring_bytes": ring, "transient_bytes": transient, "extra_bytes": ring + transient,
            "metrics": runs[-1]["metrics"], "timelines": logged,
            # --timeline, on a GPU: the receiver's copies (first program to the end), and the
            # same programs replayed right after, back to back and spaced (Worker.gpu_times)
            **gpu}


#: Rows beside the plain ones: (option, default MiB, what, engine config of the row).
VARIANTS = (
    ("--stream-waits-buckets", "2048", "ring, stream_waits=True (the trainer's ring stream "
     "waits)", {"stream_waits": True}),
    ("--no-links-buckets", "2048", "ring, links=False (headers and acks through the store)",
     {"links": False}),
    ("--into-buckets", "2048", "ring, consumed with receive_into (the README's way)",
     {"consume": "into"}),
    ("--into-host-buckets", "", "ring, consumed with receive_into, sync=host (the trainer "
     "waits for each bucket's pack before it publishes it)", {"consume": "into", "sync": "host"}),
    ("--into-zero-copy-buckets", "1024", "zero-copy, consumed with receive_into",
     {"consume": "into", "zero_copy": True}),
    ("--into-detach-buckets", "", "ring, receive_into new views of the parameters every "
     "sync (as HfReplica's land_in)", {"consume": "into-detach"}),
    ("--into-detach-zero-copy-buckets", "", "zero-copy, receive_into new views every sync",
     {"consume": "into-detach", "zero_copy": True}),
    ("--into-zero-copy-first-64m-buckets", "", "zero-copy, receive_into, first batch 64 MiB",
     {"zero_copy": True, "consume": "into", "ref_first_bytes": 64 * MiB}),
    ("--zero-copy-first-bucket-buckets", "1024", "zero-copy, first batch a whole bucket",
     {"zero_copy": True, "ref_first_bytes": "bucket"}),
    ("--rx-waits-buckets", "2048", "ring, rx_stream_waits=True (the consumer's stream waits)",
     {"rx_stream_waits": True}),
    ("--rx-waits-zero-copy-buckets", "1024", "zero-copy, rx_stream_waits=True",
     {"rx_stream_waits": True, "zero_copy": True}),
    ("--views-buckets", "1024", "zero-copy and ring, new tensor objects every sync",
     {"views": True}),
    ("--into-branches-buckets", "", "ring, receive_into, copy graphs in each of --branches "
     "chains", {"consume": "into", "graph_branches": "each"}),
    ("--into-zero-copy-branches-buckets", "", "zero-copy, receive_into, copy graphs in each "
     "of --branches chains", {"consume": "into", "zero_copy": True, "graph_branches": "each"}),
    ("--into-fill-graphs-buckets", "", "ring, receive_into, the trainer fills slots through "
     "replayed programs (fill_graphs, the default since session 21)",
     {"consume": "into", "fill_graphs": True}),
    ("--into-no-fill-graphs-buckets", "", "ring, receive_into, fill_graphs=False (the "
     "trainer copies each tensor into its slot at once)", {"consume": "into", "fill_graphs": False}),
    ("--into-delta-buckets", "", "delta+cuda_ipc, receive_into: between syncs the trainer "
     "changes --changed of its elements (warm syncs send the codec's records)",
     {"consume": "into", "delta": "changed"}),
    ("--into-push-buckets", "", "pushes: receive_into offers the receiver's tensors and the "
     "trainer writes them (push=True on both sides; the bucket size sets the batches of "
     "held writes, an eighth of it)", {"consume": "into", "push": True}),
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--warm", type=int, default=6)
    ap.add_argument("--buckets", default="256,512,1024,2048,4096", help="MiB (sync=event)")
    ap.add_argument("--host-buckets", default="1024,4096", help="MiB (sync=host)")
    ap.add_argument("--zero-copy-buckets", default="256,1024", help="MiB (event)")
    ap.add_argument("--zero-copy-host-buckets", default="1024", help="MiB")
    for flag, default, what, extra in VARIANTS:
        ap.add_argument(flag, default=default,
                        help=f"MiB, sync={extra.get('sync', 'event')}: {what}")
    ap.add_argument("--baseline-buckets", default="512,2048", help="MiB")
    ap.add_argument("--branches", default="2,4",
                    help="graph_branches of the *-branches rows (comma-separated)")
    ap.add_argument("--changed", type=float, default=0.005,
                    help="the fraction of elements the trainer changes between the syncs of "
                         "the delta rows")
    ap.add_argument("--scale", type=int, default=1, help="divide every dimension")
    ap.add_argument("--cpu-smoke", action="store_true", help="plumbing check: shm on CPU")
    ap.add_argument("--profile", action="store_true", help="cProfile two configurations")
    ap.add_argument("--timeline", action="store_true",
                    help="print when each engine step ran in every warm sync")
    ap.add_argument("--cuda-trace", action="store_true",
                    help="trace one more warm sync of each configuration with torch.profiler "
                         "(CUDA activity): DIR/trace<k>_<role>.json")
    ap.add_argument("--switch-interval", type=float, default=0.0,
                    help="sys.setswitchinterval in both processes (0: leave Python's 5 ms)")
    ap.add_argument("--ring-probe", action="store_true",
                    help="your host's ring costs: --timeline with only the rows "
                         "benchmarks/timeline_costs.py reads (receive_into at 256 MiB - 4 GiB, "
                         "and 1 / 4 GiB with sync=host); other row options are ignored")
    args = ap.parse_args()
    if args.ring_probe:
        for flag in ["--buckets", "--host-buckets", "--zero-copy-buckets",
                     "--zero-copy-host-buckets", "--baseline-buckets",
                     *(v[0] for v in VARIANTS)]:
            setattr(args, flag[2:].replace("-", "_"), "")
        args.into_buckets, args.into_host_buckets = "256,512,1024,4096", "1024,4096"
        args.timeline = True
    os.makedirs(args.out, exist_ok=True)
    out = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "torch": torch.__version__,
           "layers": args.layers,
           "switch_interval": args.switch_interval or sys.getswitchinterval(),
           "engine": [], "baseline": []}
    d = Driver(vars(args), timeout=600)
    out["gpu"] = d.ready["trainer"]["gpu"]
    try:
        out["d2d"] = d.call("trainer", "d2d") if not args.cpu_smoke else \
            {"bytes": 1, "flat_ms": 1.0, "per_tensor_ms": 1.0}
        print("d2d", out["d2d"], flush=True)
        seed = 1
        if args.profile:
            for tag, cfg in (("zc1g", {"bucket_size": GiB, "zero_copy": True}),
                             ("ring2g", {"bucket_size": 2 * GiB}),
                             ("ring256m", {"bucket_size": 256 * MiB})):
                res = run_profile(d, cfg, args.out, tag, seed)
                seed += 10
                out["engine"].append(res)
                print("profile", tag, json.dumps(res), flush=True)
            return
        configs = []
        for opt, zc, sy in ((args.buckets, False, "event"), (args.host_buckets, False, "host"),
                            (args.zero_copy_buckets, True, "event"),
                            (args.zero_copy_host_buckets, True, "host")):
            configs += [{"bucket_size": int(b) * MiB, "num_slots": 2, "zero_copy": zc,
                         "sync": sy} for b in opt.split(",") if b]
        for flag, _, _, extra in VARIANTS:
            for b in getattr(args, flag[2:].replace("-", "_")).split(","):
                if b:
                    cfg = {"bucket_size": int(b) * MiB, "num_slots": 2, "zero_copy": False,
                           "sync": "event", **extra}
                    if cfg.get("delta") == "changed":
                        cfg["delta"] = args.changed
                    if cfg.get("ref_first_bytes") == "bucket":
                        cfg["ref_first_bytes"] = cfg["bucket_size"]
                    if cfg.get("graph_branches") == "each":
                        configs += [{**cfg, "graph_branches": int(k)}
                                    for k in args.branches.split(",") if k]
                        continue
                    configs += [{**cfg, "zero_copy": zc} for zc in
                                ((True, False) if extra.get("views") else (cfg["zero_copy"],))]
        for k, cfg in enumerate(configs):
            res = run_engine(d, cfg, args.warm, seed,
                             os.path.join(args.out, f"trace{k}") if args.cuda_trace else "")
            seed += args.warm + 2
            out["engine"].append(res)
            logged = res.pop("timelines")
            print("engine", json.dumps({k: v for k, v in res.items() if k != "metrics"}),
                  flush=True)
            if args.timeline:
                for n, sync_log in enumerate(logged, 1):
                    print(f"timeline: warm sync {n} of {len(logged)}, "
                          f"{sync_log['ms']:.2f} ms", flush=True)
                    print(timeline(sync_log), flush=True)
        for b in [b for b in args.baseline_buckets.split(",") if b]:
            runs = [d.sync_once(seed + i, baseline_bucket=int(b) * MiB) for i in range(4)]
            seed += 4
            ms = [x["ms"] for x in runs]
            res = {"bucket_size": int(b) * MiB, "ms": ms, "median_ms": statistics.median(ms[1:]),
                   "all_ok": all(x["ok"] for x in runs)}
            out["baseline"].append(res)
            print("baseline", json.dumps(res), flush=True)
    finally:
        d.close()
    name = "gpu_bench.json" if not args.switch_interval else \
        f"gpu_bench_si{args.switch_interval:g}.json"
    with open(os.path.join(args.out, name), "w") as f:
        json.dump(out, f, indent=1)
    print(report(out))


def timeline(logged: dict) -> str:
    """One sync's logged steps of both processes, merged, in ms since the first of them."""
    events = [(t, "T " + e) for t, e in logged["log"]] + \
        [(t, "R " + e) for t, e in logged["rx_log"]]
    if not events:
        return "(no timeline)"
    t0 = min(t for t, _ in events)
    events.sort()
    rows, prev = [], None
    for t, e in events:  # collapse runs of the same step
        if prev and prev[1] == e:
            prev[2] += 1
            continue
        prev = [t, e, 1]
        rows.append(prev)
    return "\n".join(f"{(t - t0) * 1e3:8.2f} ms  {e}" + (f" x{n}" if n > 1 else "")
                     for t, e, n in rows)


def report(out: dict) -> str:
    a = out["d2d"]["flat_ms"]
    base = min(b["median_ms"] for b in out["baseline"]) if out["baseline"] else float("nan")
    after = out["d2d"].get("flat_after_draw_ms")
    lines = [f"model {out['d2d']['bytes'] / 1e9:.2f} GB bf16; (a) flat D2D copy {a:.2f} ms "
             f"({2 * out['d2d']['bytes'] / a / 1e9:.2f} TB/s read+write), per-tensor copy "
             f"{out['d2d']['per_tensor_ms']:.2f} ms"
             + (f"; the flat copy right after a draw of fresh weights {after:.2f} ms (a "
                "sync's own conditions unless GPU_BENCH_SETTLE_MS)" if after else ""),
             "| config | sync | bucket | cold ms | warm median ms | (b)/(a) | (c)/(b) "
             "| ring | peak transient | extra / bucket | checks |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for e in out["engine"]:
        c = e["cfg"]
        name = "cuda_ipc zero-copy" if c.get("zero_copy") else "cuda_ipc"
        if c.get("stream_waits"):
            name += " (ring stream waits)"
        if c.get("links") is False:
            name += " (store, no links)"
        if c.get("rx_stream_waits"):
            name += " (rx stream waits)"
        if c.get("consume") == "into":
            name += " (receive_into)"
        elif c.get("consume") == "into-detach":
            name += " (receive_into, new views)"
        if c.get("ref_first_bytes"):
            first = c["ref_first_bytes"]
            name += " (first batch = bucket)" if first == c["bucket_size"] else \
                f" (first batch {first // MiB} MiB)"
        if c.get("views"):
            name += " (new views)"
        if c.get("graph_branches"):
            name += f" ({c['graph_branches']} graph branches)"
        if c.get("fill_graphs") is not None:
            name += " (fill programs)" if c["fill_graphs"] else " (no fill programs)"
        if c.get("push"):
            name = "cuda_ipc push (receive_into)"
        if c.get("delta") is not None:
            name = f"delta+{name} ({c['delta']:g} changed)"
        lines.append(f"| {name} | {c.get('sync', '-')} | {c['bucket_size'] // MiB} MiB | "
                     f"{e['cold_ms']:.1f} | {e['median_ms']:.2f} | {e['median_ms'] / a:.2f} | "
                     f"{base / e['median_ms']:.1f} | {e['ring_bytes'] / GiB:.2f} GiB | "
                     f"{e['transient_bytes'] / GiB:.2f} GiB | "
                     f"{e['extra_bytes'] / c['bucket_size']:.2f} | "
                     f"{'ok' if e['all_ok'] else 'MISMATCH'} |")
    for b in out["baseline"]:
        lines.append(f"| verl-style (c) | host | {b['bucket_size'] // MiB} MiB | "
                     f"{b['ms'][0]:.1f} | {b['median_ms']:.2f} | {b['median_ms'] / a:.2f} | "
                     f"- | - | - | - | {'ok' if b['all_ok'] else 'MISMATCH'} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
