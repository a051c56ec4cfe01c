"""How fast can one process copy a model's tensors on one GPU? (the copy kernels of cuda_ipc)

On the Llama-3-8B shapes of ``gpu_bench.py`` (16.06 GB bf16 by default), each way of
moving every tensor is timed with CUDA events (median of ``--reps``), with the host time
spent issuing it:

- ``flat``: one copy of the whole model as one buffer (the floor: what ``gpu_bench`` calls
  "one D2D copy");
- ``loop``: ``dst.copy_(src)`` per tensor (what ``cuda_ipc`` zero-copy receivers and the
  ring's pack/unpack do);
- ``foreach``: ``torch._foreach_copy_(dsts, srcs)`` (multi-tensor kernels);
- ``graph-loop`` / ``graph-foreach``: the same captured once as a CUDA graph and replayed;
- ``branches-K``: the per-tensor copies as weightsync's receivers replay them
  (``GraphedCopies`` with ``branches=K``: a graph of K independent chains of copies), for
  each K of ``--branches``;
- ``pack``/``unpack`` ``loop``/``foreach``: the ring's two copies, tensors into and out of
  the slices of a ``--slot-mib`` slot, a slot at a time.

With ``--ipc`` the sources live in another process and are mapped here through CUDA IPC
(as a ``cuda_ipc`` zero-copy receiver reads the trainer's tensors): ``ipc-loop`` and
``ipc-graph-loop``.

Usage: ``python benchmarks/gpu_copies.py --out DIR [--ipc]`` (writes ``DIR/gpu_copies.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(HERE, "..", "src")]

import torch  # noqa: E402

from gpu_bench import model_shapes  # noqa: E402

MiB = 1 << 20


def poll_done(event) -> None:
    """Wait for ``event`` as ``cuda_ipc`` waits for another process's copies: ``query()``,
    then a sleep of 10 us doubling to 100 us."""
    delay = 10e-6
    while not event.query():
        time.sleep(delay)
        delay = min(2 * delay, 100e-6)


def timed(fn, reps: int, idle_ms: float = 0.0, before=None, wait=None) -> dict:
    """Median GPU ms of ``fn`` (CUDA events), and the host time to issue it; with
    ``idle_ms`` the GPU is left idle that long before each timed call (as between syncs);
    ``before`` runs ahead of each timed call, untimed; ``wait`` is how the host waits for
    it (default: the end event's ``synchronize``)."""
    fn()  # warm (allocations, kernel selection)
    torch.cuda.synchronize()
    gpu, host = [], []
    for _ in range(reps):
        if before is not None:
            before()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        if idle_ms:
            time.sleep(idle_ms / 1e3)
        t0 = time.perf_counter()
        start.record()
        fn()
        end.record()
        host.append((time.perf_counter() - t0) * 1e3)
        if wait is not None:
            wait()
        end.synchronize()
        gpu.append(start.elapsed_time(end))
    return {"ms": statistics.median(gpu), "all_ms": gpu, "issue_ms": statistics.median(host)}


def graphed(fn):
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # warm on the side stream before capture
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def slots(sizes: list[int], slot_bytes: int) -> list[list[tuple[int, int, int]]]:
    """Tensors grouped into slots: (tensor index, byte offset in the slot, bytes)."""
    out, cur, used = [], [], 0
    for i, n in enumerate(sizes):
        if cur and used + n > slot_bytes:
            out.append(cur)
            cur, used = [], 0
        cur.append((i, used, n))
        used += (n + 255) // 256 * 256
    return out + ([cur] if cur else [])


def _exporter(layers: int, q, done, poll=None, handle_q=None, rewrite=None,
              rewritten=None) -> None:
    """Child process: the model's tensors, each its own allocation, shared through CUDA
    IPC (torch.multiprocessing), alive until ``done`` is set. While ``poll`` is set it
    polls the copier's interprocess event (its handle from ``handle_q``) as a ``cuda_ipc``
    trainer polls a receiver's "done" event: ``query()``, then a sleep of 10-100 us."""
    shapes = model_shapes(layers)
    ts = [torch.randn(s, device="cuda", dtype=torch.float32).to(torch.bfloat16)
          for _, s in shapes]
    torch.cuda.synchronize()
    q.put(ts)
    if poll is None:
        done.wait(600)
        return
    event = torch.cuda.Event.from_ipc_handle(torch.device("cuda", 0), handle_q.get(timeout=300))
    while not done.is_set():
        if rewrite is not None and rewrite.is_set():   # new values, as a trainer's step
            for t in ts:
                t.normal_()
            torch.cuda.synchronize()
            rewrite.clear()
            rewritten.set()
            continue
        if poll.wait(0.01):
            poll_done(event)   # the copier records it behind each timed call
            time.sleep(10e-6)


def branched(dsts: list, srcs: list, k: int):
    """weightsync's own replayed copies (``GraphedCopies``), captured with ``k`` branches."""
    from weightsync.transport.backends.cuda_ipc.ops import GraphedCopies
    run = GraphedCopies(torch.device("cuda", 0), k)

    def pairs() -> list:
        return list(zip(dsts, srcs))
    run(pairs)   # queued one by one
    run(pairs)   # captured, replayed
    torch.cuda.synchronize()
    if run.graph is None:
        raise RuntimeError("not captured")
    return lambda: run(pairs)


def batches(sizes: list[int], first: int) -> list[list[int]]:
    """Tensor indices in the zero-copy batches of ``cuda_ipc`` (the first closes at
    ``first`` bytes, each next one at twice the last's limit)."""
    out, cur, nbytes, limit = [], [], 0, first
    for i, n in enumerate(sizes):
        cur.append(i)
        nbytes += n
        if nbytes >= limit:
            out.append(cur)
            cur, nbytes, limit = [], 0, limit * 2
    return out + ([cur] if cur else [])


def timed_polled(fn, reps: int, poll_event) -> dict:
    """As :func:`timed`, but the host waits for each call as a ``cuda_ipc`` receiver does:
    ``poll_event`` (interprocess) recorded behind the copies and polled (the GPU time is
    still measured by CUDA events)."""
    return timed(fn, reps, wait=lambda: (poll_event.record(), poll_done(poll_event)))


def ipc_copies(layers: int, reps: int, dsts: list, branches: list) -> dict:
    import torch.multiprocessing as tmp
    ctx = tmp.get_context("spawn")
    q, done, poll, handle_q = ctx.Queue(), ctx.Event(), ctx.Event(), ctx.Queue()
    rewrite, rewritten = ctx.Event(), ctx.Event()
    p = ctx.Process(target=_exporter, args=(layers, q, done, poll, handle_q, rewrite,
                                            rewritten), daemon=True)
    p.start()
    out = {}
    try:
        srcs = q.get(timeout=300)

        def loop() -> None:
            for d, s in zip(dsts, srcs):
                d.copy_(s, non_blocking=True)
        out["ipc-loop"] = timed(loop, reps)
        out["ipc-graph-loop"] = timed(graphed(loop), reps)
        for k in branches:
            out[f"ipc-branches-{k}"] = timed(branched(dsts, srcs, k), reps)
        # as a zero-copy sync lands them: one graph per batch (1 GiB first, doubling),
        # launched back to back; then the same while the exporter polls an event of ours
        # (as the trainer polls the receiver's "done" event), and with our host polling
        parts = [branched([dsts[i] for i in b], [srcs[i] for i in b], 4)
                 for b in batches([d.numel() * d.element_size() for d in dsts], 1 << 30)]

        def in_batches() -> None:
            for part in parts:
                part()
        out["ipc-batches-4"] = timed(in_batches, reps)
        one = branched(dsts, srcs, 4)
        done_event = torch.cuda.Event(interprocess=True)
        handle_q.put(done_event.ipc_handle())
        out["ipc-branches-4-host-polls"] = timed_polled(one, reps, done_event)
        out["ipc-batches-4-host-polls"] = timed_polled(in_batches, reps, done_event)
        poll.set()
        time.sleep(0.2)
        out["ipc-branches-4-peer-polls"] = timed_polled(one, reps, done_event)
        out["ipc-batches-4-peer-polls"] = timed_polled(in_batches, reps, done_event)
        poll.clear()
        out["ipc-branches-4-again"] = timed(one, reps)

        def rewrite_sources() -> None:   # the exporter writes new values into them
            rewritten.clear()
            rewrite.set()
            if not rewritten.wait(60):
                raise RuntimeError("the exporter did not rewrite its tensors")

        def after_rewrite(fn):
            return timed(fn, reps, before=rewrite_sources)
        out["ipc-branches-4-after-peer-writes"] = after_rewrite(one)
        out["ipc-batches-4-after-peer-writes"] = after_rewrite(in_batches)
        out["ipc-branches-4-again2"] = timed(one, reps)
        torch.cuda.synchronize()
        out["ipc_exact"] = all(torch.equal(d, s) for d, s in zip(dsts, srcs))
        del srcs
    finally:
        done.set()
        p.join(30)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--slot-mib", type=int, default=2048)
    ap.add_argument("--branches", default="1,2,4",
                    help="graph branches of the branches-K rows (comma-separated)")
    ap.add_argument("--idle-ms", default="",
                    help="also time the flat copy and the 4-branch graph after the GPU sat "
                         "idle this long (comma-separated ms): clocks that drop while idle")
    ap.add_argument("--only-ipc", action="store_true",
                    help="only the --ipc rows (with zero-copy batches and event polling) "
                         "and the flat copy")
    ap.add_argument("--only-idle", action="store_true",
                    help="only the flat copy, the 4-branch graph and the --idle-ms rows")
    ap.add_argument("--ipc", action="store_true",
                    help="also copy from another process's tensors mapped through CUDA IPC")
    args = ap.parse_args()
    dev = torch.device("cuda", 0)
    shapes = model_shapes(args.layers)
    numels = [int(torch.Size(s).numel()) for _, s in shapes]
    total = sum(numels)
    flat_src = torch.randn(total, device=dev, dtype=torch.float32).to(torch.bfloat16)
    flat_dst = torch.empty_like(flat_src)
    srcs, off = [], 0
    for (_, shape), n in zip(shapes, numels):
        srcs.append(flat_src[off: off + n].view(shape))
        off += n
    dsts = [torch.empty(s, device=dev, dtype=torch.bfloat16) for _, s in shapes]
    nbytes = total * 2

    def flat() -> None:
        flat_dst.copy_(flat_src)

    def loop() -> None:
        for d, s in zip(dsts, srcs):
            d.copy_(s, non_blocking=True)

    def foreach() -> None:
        torch._foreach_copy_(dsts, srcs, non_blocking=True)

    res = {"bytes": nbytes, "tensors": len(shapes), "gpu": torch.cuda.get_device_name(0),
           "torch": torch.__version__}
    if args.only_ipc:
        res.update(ipc_copies(args.layers, args.reps, dsts, [4]))
        res["flat"] = timed(flat, args.reps)
        for k, v in res.items():
            if isinstance(v, dict) and "ms" in v:
                print(f"  {k:28s} {v['ms']:8.2f} ms  {v['ms'] / res['flat']['ms']:5.2f} x")
        print("ipc exact:", res.get("ipc_exact"))
        write(args.out, "gpu_copies_ipc.json", res)
        return
    if args.only_idle:
        res["flat"] = timed(flat, args.reps)
        print("flat", json.dumps(res["flat"]), flush=True)
        four = branched(dsts, srcs, 4)
        res["branches-4"] = timed(four, args.reps)
        print("branches-4", json.dumps(res["branches-4"]), flush=True)
        for idle in [float(x) for x in args.idle_ms.split(",") if x]:
            for name, fn in (("flat", flat), ("branches-4", four)):
                key = f"{name}-idle{idle:g}ms"
                res[key] = timed(fn, args.reps, idle)
                print(key, json.dumps(res[key]), flush=True)
        write(args.out, "gpu_copies_idle.json", res)
        return
    for name, fn in (("flat", flat), ("loop", loop), ("foreach", foreach)):
        res[name] = timed(fn, args.reps)
        print(name, json.dumps(res[name]), flush=True)
    for name, fn in (("graph-loop", loop), ("graph-foreach", foreach)):
        try:
            res[name] = timed(graphed(fn), args.reps)
        except Exception as exc:  # noqa: BLE001 - a capture that fails is a result too
            res[name] = {"error": repr(exc)}
        print(name, json.dumps(res[name]), flush=True)
    branches = [int(k) for k in args.branches.split(",") if k]
    for k in branches:
        for d in dsts:
            d.zero_()
        res[f"branches-{k}"] = timed(branched(dsts, srcs, k), args.reps)
        torch.cuda.synchronize()
        res[f"branches-{k}"]["exact"] = all(torch.equal(d, s) for d, s in zip(dsts, srcs))
        print(f"branches-{k}", json.dumps(res[f"branches-{k}"]), flush=True)

    slot_bytes = args.slot_mib * MiB
    slot = torch.empty(slot_bytes, device=dev, dtype=torch.uint8)
    groups = slots([n * 2 for n in numels], slot_bytes)
    views = [[(i, slot[o: o + n].view(torch.bfloat16).view(shapes[i][1])) for i, o, n in g]
             for g in groups]

    def pack_loop() -> None:
        for g in views:
            for i, v in g:
                v.copy_(srcs[i], non_blocking=True)

    def pack_foreach() -> None:
        for g in views:
            torch._foreach_copy_([v for _, v in g], [srcs[i] for i, _ in g], non_blocking=True)

    def unpack_loop() -> None:
        for g in views:
            for i, v in g:
                dsts[i].copy_(v, non_blocking=True)

    def unpack_foreach() -> None:
        for g in views:
            torch._foreach_copy_([dsts[i] for i, _ in g], [v for _, v in g], non_blocking=True)

    for name, fn in (("pack-loop", pack_loop), ("pack-foreach", pack_foreach),
                     ("unpack-loop", unpack_loop), ("unpack-foreach", unpack_foreach)):
        res[name] = timed(fn, args.reps)
        print(name, json.dumps(res[name]), flush=True)
    # correctness of the fastest candidates
    dsts_ok = True
    for d in dsts:
        d.zero_()
    foreach()
    torch.cuda.synchronize()
    dsts_ok = all(torch.equal(d, s) for d, s in zip(dsts, srcs))
    res["foreach_exact"] = dsts_ok
    if args.ipc:
        res.update(ipc_copies(args.layers, args.reps, dsts, branches))
        print("ipc", json.dumps({k: v for k, v in res.items() if k.startswith("ipc")}),
              flush=True)
    flat_ms = res["flat"]["ms"]
    print(f"model {nbytes / 1e9:.2f} GB, {len(shapes)} tensors, {len(groups)} slots of "
          f"{args.slot_mib} MiB; x the flat copy ({flat_ms:.2f} ms):")
    for k, v in res.items():
        if isinstance(v, dict) and "ms" in v:
            print(f"  {k:16s} {v['ms']:8.2f} ms  {v['ms'] / flat_ms:5.2f} x  "
                  f"(host issue {v['issue_ms']:.2f} ms)")
    print("foreach exact:", dsts_ok)
    write(args.out, "gpu_copies.json", res)


def write(folder: str, name: str, res: dict) -> None:
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, name), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
