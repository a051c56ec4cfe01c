"""A verl-style colocated weight sync on one GPU: the baseline cuda_ipc is compared with.

Modelled on the structure of verl's bucketed CUDA-IPC transfer (read for facts only):
per sync the trainer allocates ONE bucket, exports its IPC handle and the rollout maps it;
per bucket the trainer packs tensors (chunking large ones), synchronizes the device, sends
the bucket's metadata and waits for the rollout's reply; the rollout clones each tensor out
of the bucket (per-tensor copies), loads it into its parameters (another copy, as a
``load_weights`` does), synchronizes and replies. At the end both sides drop the buffer,
collect IPC memory and empty the cache. Metadata travels as JSON over a pipe.

Run it (a trainer and a rollout process on GPU 0, the synthetic bf16 model of Llama-3-8B
shapes ``gpu_bench.py`` uses; ``--layers`` 32, the default, is the whole model)::

    python benchmarks/verl_baseline.py --out DIR --bucket-mib 2048 --warm 3 --settle-ms 200

One cold sync, then ``--warm`` more; each against one flat device-to-device copy of the
model's bytes, and checked (the trainer draws fresh weights before every sync, both sides
compare per-tensor checksums after it). ``--settle-ms`` leaves the GPU that long after the
draw, before the sync. Results: ``DIR/verl_baseline.json`` and one line on stdout.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import multiprocessing as mp
import os
import statistics
import sys
import time
import traceback
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(HERE, "..", "src")]

import torch  # noqa: E402

from weightsync.core.plan import dtype_from_name, dtype_name  # noqa: E402


def _flush(peer: Any, meta: list, last: bool) -> None:
    torch.cuda.synchronize()
    peer.send_bytes(json.dumps({"meta": meta, "last": last}).encode())
    peer.recv_bytes()


def send(params: dict[str, torch.Tensor], peer: Any, bucket: int, ops: Any) -> float:
    """Trainer side; returns the seconds of the whole sync."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    buf = torch.empty(bucket, dtype=torch.uint8, device="cuda")
    peer.send_bytes(ops.export(buf, 1)[0].encode())
    peer.recv_bytes()
    offset, meta = 0, []
    for name, w in params.items():
        wb = w.reshape(-1).view(torch.uint8)
        total, done = wb.numel(), 0
        while done < total:
            chunk = min(total - done, bucket - offset)
            if chunk == 0:
                _flush(peer, meta, False)
                offset, meta = 0, []
                continue
            meta.append([name, list(w.shape), dtype_name(w.dtype), done, offset, chunk,
                         done + chunk == total])
            buf[offset: offset + chunk].copy_(wb[done: done + chunk], non_blocking=True)
            offset += chunk
            done += chunk
            if offset == bucket and done < total:
                _flush(peer, meta, False)
                offset, meta = 0, []
    _flush(peer, meta, True)
    del buf
    gc.collect()
    torch.cuda.ipc_collect()
    torch.cuda.empty_cache()
    return time.perf_counter() - start


def receive(params: dict[str, torch.Tensor], peer: Any, ops: Any) -> None:
    """Rollout side of one sync."""
    buf = ops.open(peer.recv_bytes().decode())
    peer.send_bytes(b"ok")
    partial: dict[str, torch.Tensor] = {}
    view = None
    while True:
        msg = json.loads(peer.recv_bytes())
        weights = []
        for name, shape, dname, done, offset, chunk, complete in msg["meta"]:
            dtype = dtype_from_name(dname)
            view = buf[offset: offset + chunk]
            if complete and chunk == math.prod(shape) * dtype.itemsize:
                weights.append((name, view.view(dtype).view(shape).clone()))
                continue
            if name not in partial:
                partial[name] = torch.empty(shape, dtype=dtype, device="cuda")
            partial[name].view(-1).view(torch.uint8)[done: done + chunk].copy_(
                view, non_blocking=True)
            if complete:
                weights.append((name, partial.pop(name)))
        for name, tensor in weights:  # load_weights
            params[name].copy_(tensor)
        del weights
        torch.cuda.synchronize()
        peer.send_bytes(b"ok")
        if msg["last"]:
            break
    torch.cuda.synchronize()
    del buf, view
    gc.collect()
    torch.cuda.ipc_collect()
    torch.cuda.empty_cache()


# -- the benchmark: a trainer and a rollout process on GPU 0 ---------------------------
def _fill(params: dict[str, torch.Tensor], seed: int) -> None:
    g = torch.Generator(device="cuda").manual_seed(seed)
    for p in params.values():
        p.normal_(generator=g)
    torch.cuda.synchronize()


def _checksum(params: dict[str, torch.Tensor]) -> list[int]:
    sums = [p.view(torch.int16).view(-1).sum(dtype=torch.int64) for p in params.values()]
    return [int(x) for x in torch.stack(sums).tolist()]


def _worker(role: str, args: dict, conn: Any, peer: Any) -> None:
    try:
        from gpu_bench import flat_copy_times, model_shapes
        from weightsync.transport.backends.cuda_ipc.ops import CudaIpcOps
        torch.cuda.set_device(0)
        ops = CudaIpcOps("cuda")
        params = {n: torch.empty(s, dtype=torch.bfloat16, device="cuda")
                  for n, s in model_shapes(args["layers"], args["scale"])}
        _fill(params, 999)
        nbytes = sum(p.numel() * p.element_size() for p in params.values())
        ready = {"bytes": nbytes, "gpu": torch.cuda.get_device_name()}
        if role == "trainer":
            ready["flat_ms"] = statistics.median(flat_copy_times(nbytes))
        conn.send(ready)
        while True:
            cmd = conn.recv()
            if cmd["op"] == "quit":
                return
            if cmd["op"] == "prep":
                _fill(params, cmd["seed"])
                conn.send({"checksum": _checksum(params)})
            elif cmd["op"] == "send":
                conn.send({"ms": send(params, peer, args["bucket_mib"] << 20, ops) * 1e3})
            elif cmd["op"] == "recv":
                conn.send({"listening": True})
                receive(params, peer, ops)
                conn.send({"checksum": _checksum(params)})
    except BaseException:
        conn.send({"error": f"{role}: {traceback.format_exc()}"})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--scale", type=int, default=1, help="divide every dimension")
    ap.add_argument("--bucket-mib", type=int, default=2048)
    ap.add_argument("--warm", type=int, default=3)
    ap.add_argument("--settle-ms", type=float, default=0.0,
                    help="sleep between the trainer's draw of fresh weights and the sync")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per step")
    args = vars(ap.parse_args())
    os.makedirs(args["out"], exist_ok=True)
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    conns, procs = {}, []
    for role, peer in (("trainer", a), ("rollout", b)):
        parent, child = ctx.Pipe()
        p = ctx.Process(target=_worker, args=(role, args, child, peer), daemon=True)
        p.start()
        conns[role] = parent
        procs.append(p)

    def get(role: str) -> dict:
        if not conns[role].poll(args["timeout"]):
            raise TimeoutError(f"{role} did not answer in {args['timeout']} s")
        msg = conns[role].recv()
        if "error" in msg:
            raise RuntimeError(msg["error"])
        return msg
    try:
        trainer, rollout = get("trainer"), get("rollout")
        ms, ok = [], True
        for seed in range(1, args["warm"] + 2):
            conns["trainer"].send({"op": "prep", "seed": seed})
            want = get("trainer")["checksum"]
            time.sleep(args["settle_ms"] / 1e3)
            conns["rollout"].send({"op": "recv"})
            get("rollout")                                  # listening
            conns["trainer"].send({"op": "send"})
            ms.append(get("trainer")["ms"])
            ok = ok and get("rollout")["checksum"] == want
    finally:
        for conn in conns.values():
            try:
                conn.send({"op": "quit"})
            except OSError:     # that worker is gone
                pass
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    warm = ms[1:] or ms
    res = {"args": args, "gpu": trainer["gpu"], "bytes": trainer["bytes"],
           "flat_ms": trainer["flat_ms"], "cold_ms": ms[0], "warm_ms": ms[1:],
           "median_ms": statistics.median(warm), "all_ok": ok}
    res["x_flat"] = res["median_ms"] / res["flat_ms"]
    with open(os.path.join(args["out"], "verl_baseline.json"), "w") as f:
        json.dump(res, f, indent=1)
    print(f"verl-style baseline, {res['gpu']}, {res['bytes'] / 1e9:.2f} GB, "
          f"{args['bucket_mib']} MiB bucket: warm {res['median_ms']:.2f} ms = "
          f"{res['x_flat']:.2f} x the flat copy ({res['flat_ms']:.2f} ms); checks "
          f"{'ok' if ok else 'MISMATCH'}", flush=True)
    if not ok:
        sys.exit(1)


if __name__ == "__main__":
    main()
