"""Drive ms-swift's real ``CheckpointEngineManager`` over weightsync on CPU (no GPU, no vLLM).

Trainer actors stand in for ms-swift's ``MegatronWorker``: a small Qwen2 (optionally PEFT
LoRA, FSDP2-sharded over a gloo mesh) whose ``send_checkpoint_weights(adapter_only)``
does what ``MegatronWorker``'s does (export the weights, ``asyncio.run(engine.
send_weights(iterator))``; every rank walks the export, rank 0's engine sends), with
``merge_lora`` / ``unmerge_lora`` / ``get_peft_config_dict``. Rollout actors stand in for
``VllmServer``: an :class:`~weightsync.rollout.hf.HFRolloutReplica` whose
``receive_checkpoint_weights(base_sync_done, peft_config)`` streams
``engine.receive_weights()`` into the model (LoRA adapter when ``peft_config`` is given
after the base sync, as ``VllmServer`` decides; the replica tells the stream where its
tensors are, ``land_in``, so the backend lands the bytes there as under weightsync's own
manager; ms-swift's ``VllmServer`` iterates the same stream without it), plus ``sleep(level)`` / ``wake_up(tags)``.
:class:`SwiftReplica` has the surface of ms-swift's ``RolloutReplica`` the manager uses
(``primary``, ``sleep``, ``wake_up``), with the same code. Both actor classes mix in
:class:`~weightsync.integrations.swift.WeightsyncCheckpointMixin` (and weightsync's own
Ray mixins, so weightsync's manager can drive the same actors for a comparison).

Trainer rank 0 describes what it will send (``weightsync_describe_weights``, metadata
only) once :meth:`SwiftTrainer.set_describe` turns it on; by default it does not, as
ms-swift's ``MegatronWorker``. :meth:`SwiftTrainer.set_export_edit` makes the trainer's
export (and its description) wrong on purpose: a tensor renamed, dropped, added, reshaped
or of another dtype (:func:`edit_export`).

Compare a sync through ms-swift's manager with one through weightsync's own::

    python tests/harness_swift.py --backend shm --syncs 5

(``benchmarks/swift_sync.py`` does it for several backends and both weight-set kinds.)
The actor classes live in this module, which the Ray workers import (the cluster puts
this folder on their ``PYTHONPATH``): Ray pickles classes by reference.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Optional

import torch

import weightsync
from swift.ray.megatron.checkpoint_engine import CheckpointEngineManager, CheckpointEngineMixin

from weightsync.integrations.ray.cluster import kill_actors, start_local_ray, stop_local_ray
from weightsync.integrations.ray.mixins import RolloutWorkerMixin
from weightsync.integrations.ray.workers import ToyTrainerWorker
from weightsync.integrations.swift import WeightsyncCheckpointMixin
from weightsync.rollout.hf import HFRolloutReplica
from weightsync.testing.toymodel import lora_config, random_prompts, tiny_qwen2_config
from weightsync.trainer.digests import describe_export
from weightsync.trainer.export import assign_owners, export_weights, plan_export
from weightsync.trainer.fsdp import dist_rank_world
from weightsync.trainer.lora import lora_config_dict

__all__ = ["SwiftCluster", "SwiftReplica", "SwiftTrainer", "SwiftRollout", "edit_export",
           "edit_layout", "EDITS", "main"]

#: What the Ray workers import: this copy of weightsync and this folder (the actor classes).
_PATH = os.pathsep.join([str(Path(weightsync.__file__).resolve().parents[1]),
                         str(Path(__file__).resolve().parent)])

#: What :func:`edit_export` can do to one tensor of an export.
EDITS = ("rename", "drop", "add", "reshape", "retype")


def _edit_of(edit: Optional[dict]) -> Optional[dict]:
    if edit is not None and (not isinstance(edit, dict) or edit.get("op") not in EDITS
                             or not isinstance(edit.get("name"), str)):
        raise ValueError(f"an export edit is {{'op': one of {EDITS}, 'name': str, ...}}, "
                         f"got {edit!r}")
    return edit


def edit_export(items: Any, edit: Optional[dict], *, add: bool = True) -> Any:
    """``items`` (``(name, tensor)``) with ``edit`` applied to tensor ``edit["name"]``:
    ``rename`` (to ``edit["to"]``), ``drop``, ``add`` (a zero tensor of ``edit["shape"]``
    after the last one, if ``add``), ``reshape`` (flattened), ``retype`` (to
    ``edit["dtype"]``)."""
    edit = _edit_of(edit)
    for name, tensor in items:
        if edit is not None and name == edit["name"]:
            op = edit["op"]
            if op == "rename":
                name = edit["to"]
            elif op == "drop":
                continue
            elif op == "reshape":
                tensor = tensor.reshape(-1)
            elif op == "retype":
                tensor = tensor.to(getattr(torch, edit["dtype"]))
        yield name, tensor
    if edit is not None and edit["op"] == "add" and add:
        yield edit["name"], torch.zeros(edit["shape"])


def edit_layout(entries: list, edit: Optional[dict], *, add: bool = True) -> list:
    """The same edit on a description ``[[name, shape, dtype], ...]``."""
    edit = _edit_of(edit)
    if edit is None:
        return entries
    out = []
    for name, shape, dtype in entries:
        if name == edit["name"]:
            op = edit["op"]
            if op == "rename":
                name = edit["to"]
            elif op == "drop":
                continue
            elif op == "reshape":
                shape = [int(torch.Size(shape).numel())]
            elif op == "retype":
                dtype = edit["dtype"]
        out.append([name, list(shape), dtype])
    if edit["op"] == "add" and add:
        out.append([edit["name"], list(edit["shape"]), "float32"])
    return out


class ToyMegatronWorker(CheckpointEngineMixin, ToyTrainerWorker):
    """The calls ms-swift's manager makes on ``MegatronWorker``, over a toy trainer."""

    def __init__(self, rank: int = 0, world: int = 1) -> None:
        ToyTrainerWorker.__init__(self, rank, world)
        self._checkpoint_engine = None
        self._merged = False
        self.peft_override: Optional[dict] = None
        self.export_edit: Optional[dict] = None

    def merge_lora(self) -> None:
        # ms-swift merges in place; weightsync's export computes the merged tensors instead,
        # bit-equal to PEFT's merge, leaving the trainer's weights untouched.
        self.log.append("merge_lora")
        self._merged = self.lora is not None

    def unmerge_lora(self) -> None:
        self.log.append("unmerge_lora")
        self._merged = False

    def get_peft_config_dict(self) -> dict:
        return dict(self.peft_override or lora_config_dict(self.model))

    def _kind(self, adapter_only: bool) -> str:
        return "adapter" if adapter_only else (
            "full" if self.lora is None or self._merged else "base")

    def send_checkpoint_weights(self, adapter_only: bool = False) -> None:
        """Megatron's export yields every tensor on every rank; this FSDP2 stand-in gives
        each tensor to one rank when every trainer rank sends (``senders="all"``: what the
        ownership agreement settles on), to rank 0 when it alone does (ms-swift's
        topology; the others walk their part)."""
        engine = self._get_or_create_checkpoint_engine()
        kind = self._kind(adapter_only)
        self.log.append(f"send:{kind}")
        spread = getattr(engine, "trainers", 1) > 1
        items = export_weights(self.model, kind=kind, owner=None if spread else 0)
        if getattr(engine, "sends", engine.rank == 0):
            items = edit_export(items, self.export_edit, add=engine.rank == 0)
        asyncio.run(engine.send_weights(items))

    def _share(self, entries: list, kind: str) -> list:
        """The entries of ``entries`` this rank yields when every trainer rank sends."""
        engine = self._get_or_create_checkpoint_engine()
        if getattr(engine, "trainers", 1) <= 1:
            return entries
        me, _, ranks = dist_rank_world()
        items = plan_export(self.model, kind)
        mine = {item.name for item, owner in zip(items, assign_owners(items, ranks))
                if owner == me}
        return [e for e in entries if e[0] in mine]


class SwiftTrainer(WeightsyncCheckpointMixin, ToyMegatronWorker):
    """A trainer actor as ms-swift's manager sees it, over weightsync."""

    describe = False

    def build(self, config: dict, **kwargs: Any) -> dict:
        self.log, self._merged, self.peft_override = [], False, None
        self.export_edit, self.describe = None, False
        return super().build(config, **kwargs)

    def set_peft_override(self, config: Optional[dict]) -> None:
        self.peft_override = config

    def set_describe(self, on: bool) -> None:
        """Describe the weights before each send (metadata only), or not (as ms-swift's
        ``MegatronWorker``, the default)."""
        self.describe = bool(on)

    def set_export_edit(self, edit: Optional[dict]) -> None:
        """Make rank 0's export (and its description) wrong: see :func:`edit_export`."""
        self.export_edit = _edit_of(edit)

    def weightsync_describe_weights(self, adapter_only: bool) -> Optional[list]:
        if not self.describe:
            return None
        kind = self._kind(adapter_only)
        engine = self._get_or_create_checkpoint_engine()
        return edit_layout(self._share(describe_export(self.model, kind), kind),
                           self.export_edit, add=engine.rank == 0)


class _Dying:
    """The engine's stream as the replica loads it (``land_in`` passed on), ending the
    process after ``die_after`` tensors (the fault test: the actor dies mid-sync)."""

    def __init__(self, stream: Any, die_after: Optional[int]) -> None:
        self._stream, self._left = stream, die_after
        land = getattr(stream, "land_in", None)
        if land is not None:
            self.land_in = land

    def __aiter__(self) -> "_Dying":
        return self

    async def __anext__(self) -> Any:
        item = await self._stream.__anext__()
        if self._left is not None:
            if self._left <= 0:
                os._exit(17)
            self._left -= 1
        return item

    async def aclose(self) -> None:
        await self._stream.aclose()


class ToyVllmServer(CheckpointEngineMixin):
    """The calls ms-swift's manager makes on ``VllmServer``, over an HF replica."""

    def __init__(self, config: dict, *, seed: int = 1234, name: str = "hf") -> None:
        torch.set_num_threads(1)
        self._checkpoint_engine = None
        self._config, self._name = dict(config), name
        self.rollout = HFRolloutReplica(config=config, seed=seed, name=name, timeout=60.0)
        self.die_after: Optional[int] = None
        self.load_delay = 0.0
        self.last: dict = {}

    def sleep(self, level: int = 2) -> None:
        self.rollout.sleep(level)

    def wake_up(self, tags: Optional[list] = None) -> None:
        self.rollout.wake_up(tags)

    def get_model_param_names(self) -> list:
        return [n for n, _ in self.rollout.model.named_parameters()]

    def reset_prefix_cache(self) -> None:
        self.rollout.reset_caches()

    def receive_checkpoint_weights(self, base_sync_done: bool = False,
                                   peft_config: Optional[dict] = None) -> None:
        engine = self._get_or_create_checkpoint_engine()
        adapter = peft_config is not None and base_sync_done   # as VllmServer passes it on
        if self.load_delay:       # a server slow to get ready (VllmServer: its zmq sender)
            time.sleep(self.load_delay)

        async def load() -> dict:
            return await self.rollout.load_weights(
                _Dying(engine.receive_weights(), self.die_after), version=engine.version,
                kind="adapter" if adapter else "full",
                adapter_config=peft_config if adapter else None)

        self.last = asyncio.run(load())
        self.rollout.reset_caches()


class SwiftRollout(WeightsyncCheckpointMixin, RolloutWorkerMixin, ToyVllmServer):
    """A rollout actor as ms-swift's manager sees it, over weightsync."""

    def generate(self, prompts: list, max_new_tokens: int = 8) -> dict:
        gens = self.rollout.generate(prompts, max_new_tokens=max_new_tokens, return_logits=True)
        return {"tokens": [g.tokens for g in gens], "logits": [g.logits for g in gens],
                "version": gens[0].version}

    def state(self) -> dict:
        return {"version": self.rollout.current_version(), "log": self.rollout.call_log(),
                "adapter": self.rollout.has_adapter(), "last": dict(self.last),
                "sleeping": self.rollout.is_sleeping()}

    def set_die_after(self, n: Optional[int]) -> None:
        self.die_after = n

    def set_load_delay(self, seconds: float) -> None:
        """Sleep this long in each receive before loading (after the mixin's wrapper)."""
        self.load_delay = float(seconds)

    def reset(self, seed: int = 1234, config: Optional[dict] = None) -> None:
        """A fresh replica and engine (as a restarted actor: no weights from any sync);
        ``config``: of another model from now on."""
        self.configure_weightsync(self.weightsync_backend, **(self.weightsync_options or {}))
        if config is not None:
            self._config = dict(config)
        old, self.last, self.die_after, self.load_delay = self.rollout, {}, None, 0.0
        self.rollout = HFRolloutReplica(config=self._config, seed=seed, name=self._name,
                                        timeout=60.0)
        old.close()

    def weights_digest(self, kind: str = "full") -> dict:
        """Digests of the model's tensors of ``kind`` (``full``: base weights, ``adapter``):
        to tell that a refused sync changed nothing."""
        return self.rollout.weight_digests(kind)["digests"]


class SwiftReplica:
    """What ms-swift's manager uses of its ``RolloutReplica`` (same code as 4.6.0's)."""

    def __init__(self, servers: list) -> None:
        self._servers = list(servers)

    @property
    def primary(self) -> Any:
        return self._servers[0]

    def sleep(self, level: int = 1) -> None:
        import ray
        ray.get([server.sleep.remote(level) for server in self._servers])

    def wake_up(self, tags: Any = None) -> None:
        import ray
        ray.get([server.wake_up.remote(tags=tags) for server in self._servers])


class SwiftCluster:
    """A local Ray cluster: ``trainers`` FSDP2 trainer ranks, ``replicas`` HF rollouts."""

    def __init__(self, backend: str = "shm", *, trainers: int = 2, replicas: int = 2,
                 config: Optional[dict] = None, lora: Optional[dict] = None,
                 timeout: float = 60.0, **options: Any) -> None:
        import ray

        start_local_ray(num_cpus=2, env={"GLOO_SOCKET_IFNAME": "lo", "PYTHONPATH": _PATH})
        self.config = config or tiny_qwen2_config(vocab_size=512, hidden_size=64)
        self.timeout = timeout
        tcls = ray.remote(num_cpus=0)(SwiftTrainer)
        self.trainers = [tcls.remote(r, trainers) for r in range(trainers)]
        if trainers > 1:
            port = ray.get(self.trainers[0].dist_master.remote(), timeout=120)
            ray.get([t.dist_init.remote(port, 120.0) for t in self.trainers], timeout=180)
        rcls = ray.remote(num_cpus=0, max_concurrency=4)(SwiftRollout)
        self.rollouts = [rcls.remote(self.config, seed=100 + i, name=f"rollout-{i}")
                         for i in range(replicas)]
        self.replicas = [SwiftReplica([a]) for a in self.rollouts]
        self.build(lora)
        self.use_backend(backend, timeout=timeout, **options)

    def _all(self, method: str, actors: Optional[list] = None, *args: Any, **kwargs: Any) -> list:
        import ray
        actors = self.trainers + self.rollouts if actors is None else actors
        return ray.get([getattr(a, method).remote(*args, **kwargs) for a in actors],
                       timeout=4 * self.timeout + 60)

    def build(self, lora: Optional[dict] = None, seed: int = 0) -> None:
        """(Re)build the trainer model on every rank; fresh rollouts (of ``self.config``)."""
        self.lora = lora
        self._all("build", self.trainers, self.config, seed=seed, fsdp=len(self.trainers) > 1,
                  lora=lora, lr=0.5)
        self._all("reset", self.rollouts, config=self.config)

    def use_backend(self, backend: str, **options: Any) -> None:
        options.setdefault("timeout", self.timeout)
        self.backend, self.options = backend, options
        self._all("configure_weightsync", None, backend, **options)

    def manager(self, *, colocated: bool = False, sleep_level: int = 1) -> CheckpointEngineManager:
        """ms-swift's own manager over these actors (any mode but 'naive' uses the engine)."""
        return CheckpointEngineManager(self.trainers, self.replicas, weight_sync_mode="weightsync",
                                       is_colocated=colocated, sleep_level=sleep_level,
                                       train_group=None)

    def train(self, step: int) -> None:
        self._all("train_step", self.trainers, step)

    def reference(self, prompts: list, max_new_tokens: int, lora_mode: str = "merged") -> dict:
        """Rank 0's greedy tokens/logits of the trainer's current weights (every rank runs it)."""
        return self._all("reference", self.trainers, prompts, max_new_tokens,
                         lora_mode=lora_mode)[0]

    def generations(self, prompts: list, max_new_tokens: int) -> list[dict]:
        return self._all("generate", self.rollouts, prompts, max_new_tokens)

    def prompts(self, n: int = 3, length: int = 6) -> list:
        return random_prompts(n, length, vocab_size=self.config["vocab_size"])

    def stats(self) -> list[dict]:
        return self._all("weightsync_stats")

    def states(self) -> list[dict]:
        return self._all("state", self.rollouts)

    def kill(self, actors: list) -> None:
        kill_actors(actors)

    def shutdown(self) -> None:
        stop_local_ray()


def _compare(args: argparse.Namespace) -> None:
    from weightsync.orchestration.manager import CheckpointEngineManager as WsManager

    cluster = SwiftCluster(args.backend, bucket_size=args.bucket_mb << 20,
                           config=tiny_qwen2_config(hidden_size=args.hidden, layers=args.layers),
                           lora=lora_config(r=8) if args.lora else None)
    merge = not args.lora          # LoRA: the base once, then adapter-only syncs
    try:
        swift_mgr = cluster.manager()
        ws_mgr = WsManager(args.backend, cluster.trainers, cluster.rollouts,
                           bucket_size=args.bucket_mb << 20, timeout=cluster.timeout)
        runs = {"ms-swift manager": lambda v: swift_mgr.sync_weights(merge_and_sync=merge),
                "weightsync manager": lambda v: ws_mgr.update_weights(v, merge_and_sync=merge)}
        times: dict[str, list] = {name: [] for name in runs}
        version = 0
        for _ in range(2):             # blocks of syncs per manager, twice each
            for name, run in runs.items():
                for i in range(args.syncs + 1):
                    version += 1
                    start = time.perf_counter()
                    run(version)
                    if i:              # the first of a block switches engines (and LoRA state)
                        times[name].append(time.perf_counter() - start)
        kind = "adapter-only" if args.lora else "full"
        for name, values in times.items():
            print(f"{args.backend} {name}: median {1e3 * statistics.median(values):.1f} ms "
                  f"per {kind} sync over {len(values)} syncs (min {1e3 * min(values):.1f})")
        ws_mgr.shutdown()
    finally:
        cluster.shutdown()


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backend", default="shm")
    parser.add_argument("--bucket-mb", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--syncs", type=int, default=5)
    parser.add_argument("--lora", action="store_true", help="adapter-only syncs (LoRA r=8)")
    _compare(parser.parse_args(argv))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from harness_swift import main as run   # the actor classes of the importable module
    run()
