"""A verl-style colocated weight sync, rebuilt for the GPU benchmark (the baseline (c)).

Modelled on the structure of verl's bucketed CUDA-IPC transfer (read for facts only):
per sync the trainer allocates ONE bucket, exports its IPC handle and the rollout maps it;
per bucket the trainer packs tensors (chunking large ones), synchronizes the device, sends
the bucket's metadata and waits for the rollout's reply; the rollout clones each tensor out
of the bucket (per-tensor copies), loads it into its parameters (another copy, as a
``load_weights`` does), synchronizes and replies. At the end both sides drop the buffer,
collect IPC memory and empty the cache. Metadata travels as JSON over a pipe.
"""

from __future__ import annotations

import gc
import json
import math
import time
from typing import Any

import torch

from weightsync.core.plan import dtype_from_name, dtype_name


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
