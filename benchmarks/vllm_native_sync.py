"""Sync time through vLLM's native weight-transfer API vs ``VLLMRolloutReplica``, one run.

For each model (the demo's toy Qwen2, and a config-built ~0.5B Qwen2 with Qwen2.5-0.5B
shapes; random weights, see ``benchmarks/vllm_sync.py``) this starts, all in vLLM's
default process model and all alive at once:

* ``replica``: a :class:`weightsync.rollout.vllm.VLLMRolloutReplica` fed by a ``shm``
  engine in this process (``apply`` ``stream`` and ``staged`` in turn, digests off);
* ``offline``: ``vllm.LLM(..., weight_transfer_config=WeightTransferConfig(backend=
  "weightsync-shm"))`` driven by vLLM's ``WeightTransferTrainerFactory`` +
  ``OfflineLLMClient`` (the native engine always stages a whole version);
* ``served``: a real ``vllm serve`` process (``weightsync-shm``) driven over HTTP by
  ``HTTPWeightSyncClient`` (no pause/resume: only the sync's own requests).

It then runs ``--repeats`` rounds; each round syncs every method once, in turn (so load
drift on a shared box hits them alike), every tensor changed each time, ``--gap`` seconds
apart: vLLM's shared-memory RPC readers (``SpinCondition``, ``busy_loop_s=1``) spin for a
second after each message, so without the gap one instance's spinning slows the next. *Sync time* is
the trainer's wall time from the start of the sync until the replica holds the new
version (replica: ``engine_receive`` in a thread while the engine sends, joined; native:
``send_weights``: start, check, receive + send, finish, prefix-cache reset). The first
round is cold (plans, buffers) and left out of the medians. *HTTP overhead* is the served
median minus the offline one; ``rtt`` is the median round trip of ``GET /is_paused``
(the sync makes 4 POSTs: start, check, receive, finish).

    export "$(scripts/vllm_env.sh)"; export WEIGHTSYNC_LIBIOMP5="$(scripts/vllm_env.sh --path)"
    .venv/bin/python benchmarks/vllm_native_sync.py --models demo,0.5b --dtype bfloat16

``--manager`` compares the two replicas the manager drives instead, in one run:
``CheckpointEngineManager`` syncs (``update_weights``: validation, pause, begin_sync,
transfer, prefix-cache reset, resume) from a trainer worker in this process into a
``VLLMRolloutReplica`` (vLLM's default process model, digests on) and, with a second
trainer worker holding the same weights, into a ``VLLMServerReplica`` (a ``vllm serve``
process driven over HTTP, digests on), alternating, every tensor changed each round, the
first round left out. *Sync time* is ``report.total_seconds`` (the whole call), *transfer*
``report.seconds`` (the send/receive round alone)::

    .venv/bin/python benchmarks/vllm_native_sync.py --manager --models demo --repeats 9
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from vllm_sync import MODELS, _config, _connect, _one_sync, save_results  # noqa: E402

# vllm_sync puts src/ first on sys.path; vLLM's processes inherit it, and a stale
# src/weightsync.egg-info there would hide the installed package's entry points (so the
# weightsync-* backends): src/ goes last, after site-packages' metadata.
SRC = os.path.realpath(os.path.join(HERE, "..", "src"))
sys.path[:] = [p for p in sys.path if os.path.realpath(p or ".") != SRC] + [SRC]

METHODS = ("replica-stream", "replica-staged", "offline", "served")
MANAGER_METHODS = ("manager-replica", "manager-server")


def _source(tensors: dict):
    from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

    class DictSource(WeightSource):
        def metadata(self):
            return [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()]

        def __iter__(self):
            return iter(tensors.items())

    return DictSource()


def release(steps) -> None:
    """Call each of ``steps`` (None is skipped); a failing one is printed and the rest still
    run, so one failure leaves no server or vLLM process behind."""
    for step in steps:
        try:
            if step is not None:
                step()
        except Exception as exc:  # keep going: the rest must still be released
            print(f"  close: {exc}", file=sys.stderr)


def _engine_args(args: argparse.Namespace) -> dict:
    return dict(dtype=args.dtype, enforce_eager=True, kv_cache_memory_bytes=64 << 20,
                max_model_len=512, max_num_seqs=4, max_num_batched_tokens=512,
                skip_tokenizer_init=True)


class Bench:
    """The three vLLM instances of one model and their trainer-side engines."""

    def __init__(self, folder: str, tensors: dict, args: argparse.Namespace) -> None:
        self.folder, self.tensors, self.args = folder, tensors, args
        self.opts = {"bucket_size": args.bucket_mb << 20, "timeout": args.timeout}
        self.replica = self.sender = self.llm = self.offline = self.server = self.served = None
        self.start_seconds: dict = {}

    def start(self) -> None:
        from vllm import LLM
        from vllm.config import WeightTransferConfig
        from vllm.distributed.weight_transfer import WeightTransferTrainerFactory

        from weightsync.integrations.vllm_native import OfflineLLMClient, trainer_init_info
        from weightsync.integrations.vllm_native.server import VLLMServer
        from weightsync.rollout.vllm.replica import VLLMOptions, VLLMRolloutReplica
        from weightsync.transport import CheckpointEngineRegistry

        t = time.perf_counter()
        self.replica = VLLMRolloutReplica(self.folder, dtype=self.args.dtype, options=VLLMOptions(
            multiprocess=True, max_model_len=512, timeout=self.args.timeout, digests=False))
        self.sender = CheckpointEngineRegistry.new("shm", role="trainer", **self.opts)
        _connect(self.sender, self.replica, "shm", self.opts)
        self.start_seconds["replica"] = time.perf_counter() - t
        t = time.perf_counter()
        self.llm = LLM(model=self.folder, **_engine_args(self.args),
                       weight_transfer_config=WeightTransferConfig(backend="weightsync-shm"))
        source = _source(self.tensors)
        info = dict(rank=0, **self.opts)
        self.offline = WeightTransferTrainerFactory.trainer_init(
            trainer_init_info("shm", **info), client=OfflineLLMClient(self.llm), source=source)
        self.start_seconds["offline"] = time.perf_counter() - t
        t = time.perf_counter()
        self.server = VLLMServer(self.folder, backend="weightsync-shm", dtype=self.args.dtype,
                                 start_timeout=600.0, client_timeout=2 * self.args.timeout + 60)
        self.server.start()
        self.served = WeightTransferTrainerFactory.trainer_init(
            trainer_init_info("shm", **info), client=self.server.client, source=source)
        self.start_seconds["served"] = time.perf_counter() - t

    def sync(self, method: str, version: int) -> dict:
        time.sleep(self.args.gap)    # let the last method's vLLM processes stop spinning
        start = time.perf_counter()
        if method.startswith("replica"):
            self.replica.options.apply = method.split("-")[1]
            out = _one_sync(self.sender, self.replica, self.tensors, version, self.args.timeout)
            out = {"worker_transport": out["transport"], "worker_load": out["load"]}
        else:
            engine = self.offline if method == "offline" else self.served
            stats = engine.send_weights(weight_version=str(version))
            out = {k: stats[k] for k in ("check_seconds", "transfer_seconds", "finish_seconds")}
        return {"seconds": time.perf_counter() - start, **out}

    def rtt(self, n: int = 20) -> float:
        times = []
        for _ in range(n):
            t = time.perf_counter()
            self.server.client.is_paused()
            times.append(time.perf_counter() - t)
        return statistics.median(times)

    def close(self) -> None:
        """Release everything, each step on its own (one failing must not leave the
        server or a vLLM process behind)."""
        steps = [getattr(self.offline, "shutdown", None), getattr(self.served, "shutdown", None),
                 getattr(self.sender, "finalize", None), getattr(self.replica, "close", None),
                 self.llm and self.llm.llm_engine.engine_core.shutdown,
                 getattr(self.server, "stop", None)]
        release(steps)


def run_model(name: str, args: argparse.Namespace) -> dict:
    import torch
    from safetensors.torch import load_file

    from weightsync.rollout.vllm.replica import model_folder_from_config

    folder = tempfile.mkdtemp(prefix="wsbench-native-", dir=args.tmp)
    bench = None
    try:
        model_folder_from_config(_config(name), folder, dtype=getattr(torch, args.dtype), seed=0)
        tensors: dict = {}
        for f in sorted(os.listdir(folder)):
            if f.endswith(".safetensors"):
                tensors.update(load_file(os.path.join(folder, f)))
        bench = Bench(folder, tensors, args)
        bench.start()
        runs: dict = {m: [] for m in METHODS}
        for r in range(args.repeats):
            with torch.no_grad():
                for t in tensors.values():
                    t.mul_(1.0 + 2.0 ** -7 * (1 if r % 2 else -1))   # every tensor changes
            for i, method in enumerate(METHODS):
                runs[method].append(bench.sync(method, 10 * r + i + 1))
            print(f"  {name} round {r}: " + ", ".join(
                f"{m} {runs[m][-1]['seconds']:.3f}s" for m in METHODS), flush=True)
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        return {"model": name, "dtype": args.dtype, "bytes": nbytes,
                "params": sum(t.numel() for t in tensors.values()), "rtt": bench.rtt(),
                "start_seconds": bench.start_seconds, "runs": runs}
    finally:
        if bench is not None:
            bench.close()
        shutil.rmtree(folder, ignore_errors=True)


class ManagerBench:
    """Two managers, each with its own trainer worker (same weights): one into a
    ``VLLMRolloutReplica``, one into a ``VLLMServerReplica``."""

    def __init__(self, name: str, args: argparse.Namespace) -> None:
        self.name, self.args = name, args
        self.trainers: dict = {}
        self.workers: dict = {}
        self.managers: dict = {}
        self.start_seconds: dict = {}

    def start(self) -> None:
        import torch

        from weightsync.integrations.ray.vllm_workers import VLLMRolloutWorker, VLLMServerWorker
        from weightsync.integrations.ray.workers import ToyTrainerWorker
        from weightsync.orchestration.manager import CheckpointEngineManager
        from weightsync.rollout.vllm.replica import VLLMOptions
        from weightsync.rollout.vllm.server_replica import VLLMServerOptions

        cfg, a = _config(self.name), self.args
        dtype = getattr(torch, a.dtype)
        t = time.perf_counter()
        self.workers["manager-replica"] = VLLMRolloutWorker(
            cfg, dtype=dtype, seed=0, name="vllm", options=VLLMOptions(
                multiprocess=True, max_model_len=512, timeout=a.timeout))
        self.start_seconds["manager-replica"] = time.perf_counter() - t
        t = time.perf_counter()
        self.workers["manager-server"] = VLLMServerWorker(
            cfg, dtype=dtype, seed=0, name="vllm-server", options=VLLMServerOptions(
                timeout=a.timeout, start_timeout=600.0))
        self.start_seconds["manager-server"] = time.perf_counter() - t
        engine_kw = {} if dtype == torch.float32 else {"dtype": dtype}
        for m in MANAGER_METHODS:
            trainer = self.trainers[m] = ToyTrainerWorker()
            trainer.build(cfg, seed=0)
            self.managers[m] = CheckpointEngineManager(
                "shm", [trainer], [self.workers[m]], bucket_size=a.bucket_mb << 20,
                timeout=a.timeout, **engine_kw)

    def change(self, r: int) -> None:
        """Every tensor of both trainers changes alike."""
        import torch

        with torch.no_grad():
            for trainer in self.trainers.values():
                for p in trainer.model.parameters():
                    p.mul_(1.0 + 2.0 ** -7 * (1 if r % 2 else -1))

    def sync(self, method: str, version: int) -> dict:
        time.sleep(self.args.gap)
        report = self.managers[method].update_weights(version)
        if not report.ok:
            raise RuntimeError(f"{method}: sync {version} failed: {report.summary()}")
        return {"seconds": report.total_seconds, "transfer": report.seconds,
                "bytes": report.bytes}

    def close(self) -> None:
        release([getattr(m, "shutdown", None) for m in self.managers.values()]
                + [getattr(w, "close", None) for w in self.workers.values()])


def run_manager(name: str, args: argparse.Namespace) -> dict:
    bench = ManagerBench(name, args)
    try:
        bench.start()
        runs: dict = {m: [] for m in MANAGER_METHODS}
        for r in range(args.repeats):
            bench.change(r)
            for i, method in enumerate(MANAGER_METHODS):
                runs[method].append(bench.sync(method, 10 * r + i + 1))
            print(f"  {name} round {r}: " + ", ".join(
                f"{m} {runs[m][-1]['seconds']:.3f}s" for m in MANAGER_METHODS), flush=True)
        return {"model": name, "dtype": args.dtype, "bytes": runs[MANAGER_METHODS[0]][0]["bytes"],
                "start_seconds": bench.start_seconds, "runs": runs}
    finally:
        bench.close()


def _manager_table(results: list) -> None:
    print(f"\n{'model':>5} {'MiB':>7} " + " ".join(f"{m:>24}" for m in MANAGER_METHODS) +
          f" {'server/replica':>14} {'server-replica':>14}")
    for r in results:
        warm = {m: r["runs"][m][1:] for m in MANAGER_METHODS}
        s = {m: statistics.median(x["seconds"] for x in v) for m, v in warm.items()}
        tr = {m: statistics.median(x["transfer"] for x in v) for m, v in warm.items()}
        pairs = list(zip(*(warm[m] for m in MANAGER_METHODS)))
        ratio = statistics.median(b["seconds"] / a["seconds"] for a, b in pairs)
        diff = statistics.median(b["seconds"] - a["seconds"] for a, b in pairs)
        r["summary"] = {**{m: s[m] for m in MANAGER_METHODS},
                        **{f"{m} transfer": tr[m] for m in MANAGER_METHODS},
                        "server/replica": ratio, "server-replica": diff}
        print(f"{r['model']:>5} {r['bytes'] / 2**20:7.1f} " +
              " ".join(f"{s[m]:9.3f} (transfer {tr[m]:6.3f})" for m in MANAGER_METHODS) +
              f" {ratio:14.2f} {diff:14.3f}")
    print("(seconds: medians of the warm rounds of update_weights (whole call) and of its "
          "transfer round; server/replica, server-replica: median per-round ratio and "
          "difference)")


def _summary(r: dict) -> dict:
    """Medians (and minima) of the warm rounds, and the per-round paired comparisons."""
    warm = {m: [x["seconds"] for x in r["runs"][m][1:]] for m in METHODS}
    out = {m: statistics.median(v) for m, v in warm.items()}
    out.update({f"{m} min": min(v) for m, v in warm.items()})
    pairs = list(zip(warm["offline"], warm["replica-staged"], warm["replica-stream"],
                     warm["served"]))
    out["offline/staged"] = statistics.median(o / st for o, st, _, _ in pairs)
    out["offline/stream"] = statistics.median(o / sm for o, _, sm, _ in pairs)
    out["served-offline"] = statistics.median(sv - o for o, _, _, sv in pairs)
    return out


def _table(results: list) -> None:
    print(f"\n{'model':>5} {'MiB':>7} " + " ".join(f"{m:>15}" for m in METHODS) +
          f" {'off/staged':>10} {'off/stream':>10} {'served-off':>10} {'rtt ms':>7}")
    for r in results:
        s = r["summary"] = _summary(r)
        print(f"{r['model']:>5} {r['bytes'] / 2**20:7.1f} " +
              " ".join(f"{s[m]:7.3f} ({s[m + ' min']:5.3f})" for m in METHODS) +
              f" {s['offline/staged']:10.2f} {s['offline/stream']:10.2f}"
              f" {s['served-offline']:10.3f} {1e3 * r['rtt']:7.2f}")
    print("(seconds: median (min) of the warm rounds; off/staged, off/stream: median of the "
          "per-round ratios native offline / replica; served-off: median per-round "
          "difference served - offline, the HTTP overhead of a sync)")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="demo,0.5b", help="comma list of " + ",".join(MODELS))
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--bucket-mb", type=int, default=64)
    p.add_argument("--repeats", type=int, default=4)
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--gap", type=float, default=1.5,
                   help="seconds of idle before each sync (vLLM's RPC readers busy-poll "
                        "for 1 s after their last message)")
    p.add_argument("--tmp", default=None, help="where the model folder is written")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--manager", action="store_true",
                   help="compare VLLMRolloutReplica and VLLMServerReplica under the manager")
    args = p.parse_args(argv)
    models = [m for m in args.models.split(",") if m]
    if [m for m in models if m not in MODELS] or args.repeats < 2:
        p.error(f"models are {list(MODELS)}; --repeats must be >= 2")
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    if args.manager:
        results = [run_manager(m, args) for m in models]
        _manager_table(results)
    else:
        results = [run_model(m, args) for m in models]
        _table(results)
    save_results(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
