"""Delta updates and FP8 on the fly, measured on a real workload.

The demo's Qwen2 (``weightsync.testing.toymodel.tiny_qwen2_config``, sized by ``--size``)
trains in bf16 with AdamW in its own process; after every step it syncs to one receiver
process through each group in turn, in the same run: ``delta+<b>`` and plain ``<b>`` for
each ``--backends`` entry (``--fp8`` adds ``fp8+shm`` and ``delta+fp8+shm``). Per step:
the fraction of bf16 elements that changed, bytes on the wire and sync time (trainer
side: from ``send_weights`` until every receiver applied all) of each group; at the end,
every receiver's tensors are hashed and compared with the trainer's. ``--churn N`` runs N
``delta+shm`` syncs (tiny model, lr 1e-6) with a second receiver dropped for one sync and
re-added every 10, hashing every receiver after every sync.

    PYTHONPATH=src python3 benchmarks/delta_bench.py --size medium --lr 1e-6 1e-5 \\
        --backends shm collective --fp8 --churn 100 --json delta.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import multiprocessing as mp
import statistics
import time
import traceback

import torch

SIZES = {"demo": {}, "medium": dict(vocab_size=8192, hidden_size=512, layers=4,
                                    intermediate_size=1408, heads=8, kv_heads=2),
         "large": dict(vocab_size=16384, hidden_size=1024, layers=8, intermediate_size=2816,
                       heads=16, kv_heads=4)}
ENGINE = {"bucket_size": 64 << 20, "timeout": 300}


# -- what runs in the worker processes ---------------------------------------------------
def w_setup(state, role, size, lr, seed, threads=1):
    import weightsync.transport.codec  # noqa: F401  (registers the codec names)
    from weightsync.testing.toymodel import tiny_qwen2_config
    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    state.update(role=role, engines={}, params={}, step=0)
    if role != "trainer":
        return None
    from transformers import Qwen2Config, Qwen2ForCausalLM
    cfg = tiny_qwen2_config(**SIZES[size])
    model = Qwen2ForCausalLM(Qwen2Config(**cfg)).to(torch.bfloat16)
    state.update(model=model, vocab=cfg["vocab_size"],
                 opt=torch.optim.AdamW(model.parameters(), lr=lr))
    return [(n, list(p.shape), str(p.dtype)[6:]) for n, p in model.named_parameters()]


def w_engine(state, group, backend):
    from weightsync.transport import CheckpointEngineRegistry
    state["engines"][group] = CheckpointEngineRegistry.new(backend, role=state["role"], **ENGINE)


def w_alloc(state, group, desc):
    from weightsync.core.plan import dtype_from_name
    state["params"][group] = {n: torch.zeros(s, dtype=dtype_from_name(d)) for n, s, d in desc}


def w_prepare(state, group):
    return state["engines"][group].prepare()


def w_init(state, group, kwargs):
    state["engines"][group].init_process_group(**kwargs)


def w_finalize(state, group):
    state["engines"][group].finalize()


def w_train(state):
    from weightsync.testing.toymodel import random_batch
    model, opt = state["model"], state["opt"]
    before = [p.detach().clone() for p in model.parameters()]
    start = time.perf_counter()
    ids = random_batch(state["step"], 0, vocab_size=state["vocab"], batch=4, length=64)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    state["step"] += 1
    changed = sum(int((b.view(torch.int16) != p.detach().view(torch.int16)).sum())
                  for b, p in zip(before, model.parameters()))
    total = sum(p.numel() for p in model.parameters())
    return {"loss": loss.item(), "changed": changed, "total": total,
            "train_s": time.perf_counter() - start}


def _weights(state):
    return [(n, p.detach()) for n, p in state["model"].named_parameters()]


def w_send(state, group, version):
    return asyncio.run(state["engines"][group].send_weights(_weights(state), version))


def w_recv(state, group, version):
    engine, params = state["engines"][group], state["params"][group]

    async def main():
        count = 0
        async for _ in engine.receive_into(params, version):
            count += 1
        return count
    start = time.perf_counter()
    count = asyncio.run(main())
    return {"seconds": time.perf_counter() - start, "count": count,
            "codec": getattr(engine, "last_receive", None)}


def w_digests(state, group, quantize=None):
    from weightsync.core.digests import tensor_digest
    from weightsync.transport.codec.fp8 import Quantizer
    if state["role"] != "trainer":
        return {n: tensor_digest(t) for n, t in state["params"][group].items()}
    items = _weights(state)
    if quantize:
        items = [pair for n, t in items for pair in Quantizer(quantize).expand(n, t)]
    return {n: tensor_digest(t.contiguous()) for n, t in items}


def w_fp8(state):
    """FP8 block quantization of the current weights on this CPU, and the delta of the
    quantized bytes against the previous step's (no transport: the bytes a sync would move)."""
    from weightsync.transport.codec.fp8 import Quantizer
    from weightsync.transport.codec.state import EncodeRun, SendStats, SenderBases
    bases = state.setdefault("fp8_bases", SenderBases(limit=None, auto=False))
    qz, stats = Quantizer("fp8-block"), SendStats()
    quant_s = quant_bytes = 0.0
    run = EncodeRun(bases, allow=bases.id is not None, wrap=False, stats=stats)
    for name, t in _weights(state):
        start = time.perf_counter()
        pieces = qz.expand(name, t)
        if len(pieces) == 2:
            quant_s += time.perf_counter() - start
            quant_bytes += t.numel() * t.element_size()
        stats.source_bytes += t.numel() * t.element_size()
        for n, p in pieces:
            run.add(n, p, own=True)
    run.close()
    bases.id = "fp8"
    return {"bf16_bytes": stats.source_bytes, "fp8_bytes": stats.dense_bytes,
            "records": stats.delta,
            "delta_of_fp8_bytes": stats.record_bytes + stats.sent_dense_bytes,
            "quant_gbps": quant_bytes / quant_s / 1e9 if quant_s else 0.0}


def kernels(shape=(4096, 14336), frac=0.005):
    """FP8 block quantization GB/s (bf16 in) and the delta codec's encode/apply times for
    one tensor, on the CPU and (if there is one) the GPU."""
    from weightsync.core.digests import tensor_digest
    from weightsync.transport.codec import delta
    from weightsync.transport.codec.fp8 import quantize_block
    out = {}
    for dev in ["cpu"] + (["cuda"] if torch.cuda.is_available() else []):
        w = (torch.randn(shape, device=dev) * 0.02).to(torch.bfloat16)
        new = w.clone()
        flat = new.view(-1).view(torch.int16)
        flat[torch.randperm(flat.numel(), device=dev)[: int(frac * flat.numel())]] ^= 1
        sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)

        def timed(fn, reps=5):
            fn()
            sync()
            start = time.perf_counter()
            for _ in range(reps):
                fn()
            sync()
            return (time.perf_counter() - start) / reps
        nbytes = w.numel() * 2
        rec, _ = delta.encode(new, w)
        head = delta.parse(rec)
        out[dev] = {"shape": list(shape),
                    "fp8_quant_gbps": nbytes / timed(lambda: quantize_block(w)) / 1e9,
                    "digest_gbps": nbytes / timed(lambda: tensor_digest(w)) / 1e9,
                    "delta_encode_ms": 1e3 * timed(lambda: delta.encode(new, w)),
                    "delta_apply_ms": 1e3 * timed(lambda: delta.apply(head, rec, w.clone()), 3),
                    "clone_ms": 1e3 * timed(lambda: w.clone()), "record_bytes": rec.numel(),
                    "changed_fraction": frac}
    return out


def _actor(conn):
    state = {}
    while True:
        msg = conn.recv()
        if msg is None:
            return
        name, args = msg
        try:
            out = ("ok", globals()[name](state, *args))
        except BaseException:
            out = ("err", traceback.format_exc())
        conn.send(out)


class Actor:
    def __init__(self, ctx) -> None:
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_actor, args=(child,), daemon=True)
        self.proc.start()

    def send(self, name, *args):
        self.conn.send((name, args))

    def recv(self, timeout=1800):
        if not self.conn.poll(timeout):
            raise TimeoutError("worker did not answer")
        tag, value = self.conn.recv()
        if tag == "err":
            raise RuntimeError(value)
        return value

    def call(self, name, *args):
        self.send(name, *args)
        return self.recv()

    def close(self):
        try:
            self.conn.send(None)
        except OSError:
            pass
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()


# -- the driver ----------------------------------------------------------------------------
def join(group, backend, trainer, receivers):
    """(Re)build ``group`` over ``trainer`` + ``receivers`` (engines already created)."""
    from weightsync.transport import CheckpointEngineRegistry
    from weightsync.transport.base import worker_kwargs
    members = [trainer] + receivers
    for a in members:
        a.call("w_finalize", group)
    metas = [a.call("w_prepare", group) for a in members]
    tk, rk = CheckpointEngineRegistry.get(backend).build_topology(1, len(receivers), metas)
    kws = [worker_kwargs(tk, 0)] + [worker_kwargs(rk, j) for j in range(len(receivers))]
    for a, kw in zip(members, kws):
        a.send("w_init", group, kw)
    for a in members:
        a.recv()


def sync(group, trainer, receivers, version):
    trainer.send("w_send", group, version)
    for r in receivers:
        r.send("w_recv", group, version)
    metrics = trainer.recv()
    return metrics, [r.recv() for r in receivers]


def mismatches(group, trainer, receivers, quantize=None):
    want = trainer.call("w_digests", group, quantize)
    bad = 0
    for r in receivers:
        got = r.call("w_digests", group)
        bad += sum(1 for n in want if got.get(n) != want[n])
    return bad


def _desc(desc, backend):
    if "fp8" not in backend:
        return desc
    from weightsync.transport.codec.fp8 import Quantizer
    return Quantizer("fp8-block").describe(desc)


def run_training(ctx, size, lr, steps, groups, fp8, threads, verbose=False):
    import weightsync.transport.codec  # noqa: F401
    trainer, rx = Actor(ctx), Actor(ctx)
    try:
        desc = trainer.call("w_setup", "trainer", size, lr, 0, threads)
        rx.call("w_setup", "rollout", size, lr, 0, threads)
        for g in groups:
            trainer.call("w_engine", g, g)
            rx.call("w_engine", g, g)
            rx.call("w_alloc", g, _desc(desc, g))
            join(g, g, trainer, [rx])
        rows = []
        for step in range(steps + 1):
            row = {"step": step}
            if step:
                row.update(trainer.call("w_train"))
            for g in groups:
                m, (r,) = sync(g, trainer, [rx], step)
                row[g] = {"bytes": m["bytes"], "seconds": m["seconds"], "rx_seconds": r["seconds"],
                          "codec": m.get("codec"), "rx_codec": r["codec"]}
                if verbose and m.get("codec"):
                    c, rc = m["codec"], r["codec"] or {}
                    print(f"  {g}: trainer {_ms(c['phases'])} encode "
                          f"{c['encode_seconds'] * 1e3:.1f} "
                          f"| receiver {_ms(rc.get('phases', {}))} apply "
                          f"{rc.get('apply_seconds', 0) * 1e3:.1f}", flush=True)
            if fp8:
                row["fp8"] = trainer.call("w_fp8")
            rows.append(row)
            print(_line(row, groups), flush=True)
        bad = {g: mismatches(g, trainer, [rx], "fp8-block" if "fp8" in g else None)
               for g in groups}
        return {"size": size, "lr": lr, "rows": rows, "mismatches": bad,
                "params": sum(math.prod(s) for _, s, _ in desc)}
    finally:
        trainer.close()
        rx.close()


def _ms(phases):
    return " ".join(f"{k} {v * 1e3:.1f}" for k, v in phases.items())


def _line(row, groups):
    parts = [f"step {row['step']:2d}"]
    if "changed" in row:
        parts.append(f"changed {row['changed'] / row['total']:.4%}")
    for g in groups:
        parts.append(f"{g} {row[g]['bytes'] / 1e6:.2f} MB {row[g]['seconds'] * 1e3:.1f} ms")
    return " | ".join(parts)


def run_churn(ctx, syncs, every, threads):
    trainer, a, b = Actor(ctx), Actor(ctx), Actor(ctx)
    g = "delta+shm"
    try:
        desc = trainer.call("w_setup", "trainer", "demo", 1e-6, 1, threads)
        for x in (a, b):
            x.call("w_setup", "rollout", "demo", 1e-6, 1, threads)
            x.call("w_alloc", g, desc)
        for x in (trainer, a, b):
            x.call("w_engine", g, g)
        dense, bad, resent, members = [], 0, 0, None
        for v in range(syncs):
            want = [a] if v % every == every - 1 else [a, b]     # b out one sync in ten
            if want != members:
                join(g, g, trainer, want)
                members = want
            if v:
                trainer.call("w_train")
            m, _ = sync(g, trainer, members, v)
            dense += [v] if m["codec"]["mode"] == "dense" else []
            resent += m["codec"]["resent"]
            bad += mismatches(g, trainer, members)
        return {"syncs": syncs, "dense_syncs": dense, "digest_mismatches_left": bad,
                "resent": resent}
    finally:
        for x in (trainer, a, b):
            x.close()


def summary(result, groups):
    rows = [r for r in result["rows"] if r["step"]]
    out = {"changed_fraction_median": statistics.median(r["changed"] / r["total"] for r in rows)}
    for g in groups:
        out[g] = {"bytes_median": statistics.median(r[g]["bytes"] for r in rows),
                  "seconds_median": statistics.median(r[g]["seconds"] for r in rows)}
        codec = rows[-1][g]["codec"]
        if codec:
            out[g]["trainer_base_bytes"] = codec["base_bytes"]
    for g in groups:
        plain = g.split("+")[-1]
        if g.startswith("delta+") and plain in out and "fp8" not in g:
            out[g]["bytes_ratio"] = out[plain]["bytes_median"] / out[g]["bytes_median"]
            paired = [r[plain]["seconds"] / r[g]["seconds"] for r in rows]
            out[g]["time_ratio_paired_median"] = statistics.median(paired)
    if "fp8" in rows[-1]:
        f = [r["fp8"] for r in rows]
        out["fp8"] = {"fp8_over_bf16": f[-1]["fp8_bytes"] / f[-1]["bf16_bytes"],
                      "delta_of_fp8_over_fp8_median": statistics.median(
                          x["delta_of_fp8_bytes"] / x["fp8_bytes"] for x in f[1:]),
                      "quant_gbps_median": statistics.median(x["quant_gbps"] for x in f)}
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="medium", choices=sorted(SIZES))
    ap.add_argument("--lr", type=float, nargs="+", default=[1e-6, 1e-5])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--backends", nargs="+", default=["shm", "collective"])
    ap.add_argument("--fp8", action="store_true", help="also fp8+shm, delta+fp8+shm, FP8 stats")
    ap.add_argument("--churn", type=int, default=0, help="N syncs of the drop/re-add run")
    ap.add_argument("--kernels", action="store_true", help="FP8 / codec kernel speeds only")
    ap.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) // 2 - 1),
                    help="torch threads per process (default: a core each, at least one)")
    ap.add_argument("--verbose", action="store_true", help="print each codec sync's phases")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.kernels:
        torch.set_num_threads(args.threads)
        print(json.dumps({"threads": args.threads, **kernels()}, indent=1), flush=True)
        return
    ctx = mp.get_context("spawn")
    groups = [f"{p}{b}" for b in args.backends for p in ("delta+", "")]
    groups += ["fp8+shm", "delta+fp8+shm"] if args.fp8 else []
    report = {"runs": []}
    for lr in args.lr:
        result = run_training(ctx, args.size, lr, args.steps, groups, args.fp8, args.threads,
                              args.verbose)
        result["summary"] = summary(result, groups)
        print(json.dumps({"lr": lr, "params": result["params"], **result["summary"],
                          "mismatches": result["mismatches"]}, indent=1), flush=True)
        report["runs"].append(result)
    if args.churn:
        report["churn"] = run_churn(ctx, args.churn, 10, args.threads)
        print(json.dumps(report["churn"]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1, default=str)


if __name__ == "__main__":
    main()
