"""What the vLLM test modules share: the tiny model they all load, a temp HOME, a push of
tensors from this process into a replica's workers, and a listing of the files under folders.

vLLM writes caches under HOME (and XDG_CACHE_HOME); a module that starts vLLM points both at
a temp folder for its lifetime (``vllm_home``), which also holds the model folder;
``server_worker`` starts an owned ``vllm serve`` there.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import tempfile
import threading
from typing import Any, Iterable, Iterator

from weightsync.testing.toymodel import tiny_qwen2_config
from weightsync.transport import CheckpointEngineRegistry
from weightsync.transport.base import worker_kwargs

VOCAB = 1000
# hidden 128 / 4 heads: head_dim 32, the smallest the CPU attention kernel takes;
# initializer_range 0.2 gives peaky logits, so greedy comparisons mean something.
CFG = {**tiny_qwen2_config(vocab_size=VOCAB), "max_position_embeddings": 512,
       "initializer_range": 0.2}


@contextlib.contextmanager
def vllm_home(config: dict = CFG, *, seed: int = 1, prefix: str = "wsvllm-") -> Iterator[str]:
    """HOME, XDG_CACHE_HOME (and VLLM_NO_USAGE_STATS) set to a temp folder, restored after;
    yields the path of a model folder built from ``config`` (random weights, ``seed``)."""
    from weightsync.rollout.hf import build_causal_lm

    root = tempfile.mkdtemp(prefix=prefix)
    keys = ("HOME", "XDG_CACHE_HOME", "VLLM_NO_USAGE_STATS")
    old = {k: os.environ.get(k) for k in keys}
    os.environ.update(HOME=root, XDG_CACHE_HOME=os.path.join(root, ".cache"),
                      VLLM_NO_USAGE_STATS="1")
    try:
        folder = os.path.join(root, "model")
        build_causal_lm(config, seed=seed).save_pretrained(folder)
        yield folder
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        shutil.rmtree(root, ignore_errors=True)


@contextlib.contextmanager
def server_worker(prefix: str, name: str, **options: Any) -> Iterator[tuple[Any, str]]:
    """A ``VLLMServerWorker`` (an owned ``vllm serve`` on the tiny model, weights of seed
    3) inside :func:`vllm_home`, its log in the temp root; yields (worker, root) and
    closes it after. ``options``: more ``VLLMServerOptions`` fields."""
    from weightsync.integrations.ray.vllm_workers import VLLMServerWorker
    from weightsync.rollout.vllm.server_replica import VLLMServerOptions

    with vllm_home(CFG, prefix=prefix) as folder:
        root = os.path.dirname(folder)
        worker = VLLMServerWorker(CFG, seed=3, name=name, options=VLLMServerOptions(
            timeout=30, start_timeout=280, log_path=os.path.join(root, "serve.log"),
            **options))
        try:
            yield worker, root
        finally:
            worker.close()


def files_under(*roots: str) -> set[str]:
    """The paths of every file below ``roots``."""
    out = set()
    for root in roots:
        for d, _, names in os.walk(root):
            out.update(os.path.join(d, n) for n in names)
    return out


def push_weights(replica, items: Iterable, version: Any, *, backend: str = "shm",
         timeout: float = 30.0, **receive) -> dict:
    """Send ``items`` (name, tensor pairs, read as the send goes) from an engine in this
    process into the replica's workers; ``receive`` goes to ``replica.engine_receive``
    (``kind``, ``adapter_config``). Returns the receive's stats; raises the receiver's
    error, else the sender's."""
    sender = CheckpointEngineRegistry.new(backend, role="trainer", bucket_size=1 << 20,
                                          timeout=timeout)
    try:
        metas = [sender.prepare()] + replica.engine_prepare(backend, {"bucket_size": 1 << 20,
                                                                      "timeout": timeout})
        tk, rk = type(sender).build_topology(1, 1, metas)
        t = threading.Thread(target=replica.engine_init, args=([worker_kwargs(rk, 0)],))
        t.start()
        sender.init_process_group(**worker_kwargs(tk, 0))
        t.join(timeout)
        result: dict = {}

        def run_receive():
            try:
                result["stats"] = replica.engine_receive(version, **receive)
            except BaseException as exc:  # re-raised below
                result["error"] = exc

        t = threading.Thread(target=run_receive)
        t.start()
        try:
            asyncio.run(sender.send_weights(items, version=version))
        except Exception as exc:  # the receiver's error, if any, says more
            result["send_error"] = exc
        t.join(2 * timeout + 30)
        assert not t.is_alive(), "the receive did not end"
        if "error" in result:
            raise result["error"]
        if "send_error" in result:
            raise result["send_error"]
        return result["stats"]
    finally:
        sender.finalize()
