"""``CheckpointEngineManager``: drive trainer workers and rollout replicas through syncs.

Workers are Ray actor handles (or plain objects in this process) whose classes use
:class:`~weightsync.ray.mixins.TrainerWorkerMixin` / ``RolloutWorkerMixin``. The manager
knows the transport only through :class:`~weightsync.engines.CheckpointEngineRegistry`:

1. **Group** (first sync, and again after ``add_replica``/``remove_replica`` or a failed
   sync): ``prepare`` on every worker of both sides concurrently; the backend's
   ``build_topology``; a check that every keyword has one entry per worker
   (``TopologyError`` naming backend, side, key and sizes); ``init_process_group`` on all
   workers concurrently.
2. **Sync** (``update_weights``): pause/abort generation -> (colocated: sleep, offload the
   trainer if asked, wake ``weights``) -> send on every trainer rank and receive on every
   rollout rank concurrently, one round per weight set -> (colocated: reload the trainer,
   wake ``kv_cache``) -> finalize the group unless ``keep_group`` -> reset caches ->
   resume. Returns a :class:`~weightsync.report.SyncReport`.

LoRA (the trainer model is a PEFT model): ``merge_and_sync=True`` sends merged weights;
``merge_and_sync=False`` sends the base weights once (``base_sync_done``) and from then on
only the adapter and its PEFT config; a replica that joined, or a group rebuilt after a
failure, gets the base again. Colocated sleep level 2 discards the rollout's weights; when
the coming sync would not restore all of them (adapter-only, or a replica whose engine
cannot restore what it discarded) the level is capped at 1 with a warning.

Every call on a worker is bounded (``timeout`` of the engines, plus a margin for the
call itself); a worker that does not answer or dies becomes ``SyncTimeout``/``PeerFailed``
naming it.
"""

from __future__ import annotations

import logging
import time
import warnings
from typing import Any, Optional, Sequence

from ._calls import Call, call_all, values_or_raise
from .config import EngineConfig
from .engines.base import validate_topology, worker_kwargs
from .engines.registry import CheckpointEngineRegistry
from .errors import TopologyError, WeightSyncError
from .report import ReplicaStatus, SyncReport
from .rollout.base import SLEEP_LEVELS

__all__ = ["CheckpointEngineManager", "SyncReport", "ReplicaStatus"]

logger = logging.getLogger(__name__)
_ENGINE_KEYS = ("device", "dtype", "num_slots", "checksum", "host")


class CheckpointEngineManager:
    """Weight syncs from ``trainer`` workers (one handle per rank) to ``replicas``."""

    def __init__(self, backend: str, trainer: Any, replicas: Sequence[Any], *,
                 colocated: bool = False, sleep_level: int = 1,
                 bucket_size: Optional[int] = None, timeout: Optional[float] = None,
                 keep_group: bool = True, offload_trainer: bool = False,
                 **engine_kwargs: Any) -> None:
        if not isinstance(backend, str):
            raise ValueError(f"backend must be a backend name (str), got {backend!r}")
        self._engine_cls = CheckpointEngineRegistry.get(backend)  # unknown -> clear error
        self.backend = backend
        self.trainers = list(trainer) if isinstance(trainer, (list, tuple)) else [trainer]
        if not self.trainers:
            raise ValueError("trainer must be a worker handle or a non-empty list of them")
        if isinstance(replicas, (str, bytes)) or not isinstance(replicas, (list, tuple)):
            raise ValueError("replicas must be a list of rollout worker handles")
        if sleep_level not in SLEEP_LEVELS:
            raise ValueError(f"sleep_level must be one of {SLEEP_LEVELS}, got {sleep_level!r}")
        unknown = sorted(set(engine_kwargs) - set(_ENGINE_KEYS))
        if unknown:
            raise ValueError(f"unknown engine option(s) {unknown}; known: "
                             f"{['bucket_size', 'timeout', *_ENGINE_KEYS]}")
        given = {k: v for k, v in (("bucket_size", bucket_size), ("timeout", timeout))
                 if v is not None}   # left out: WEIGHTSYNC_* or the defaults, as engines do
        config = EngineConfig(**given, **engine_kwargs)
        self.engine_kwargs = {"bucket_size": config.bucket_size, "timeout": config.timeout,
                              **engine_kwargs}
        self.timeout = config.timeout
        self.call_timeout = 2 * config.timeout + 60   # above a worker's own bound
        self.colocated, self.sleep_level = bool(colocated), sleep_level
        self.keep_group, self.offload_trainer = bool(keep_group), bool(offload_trainer)
        self.replicas: list[Any] = []
        self._names: dict[int, str] = {}
        self._counter = 0
        for r in replicas:
            self._register(r)
        self._group_ready = False
        self._ranks: list[int] = []              # receiving ranks per replica
        self._caps: dict[int, dict] = {}
        self._weights: dict[int, Optional[str]] = {}   # replica -> "base" / "full" / None
        self._lora: Any = False                  # False: not asked yet; None: no LoRA
        self._warned: set[str] = set()

    # -- replicas ---------------------------------------------------------------------
    def _register(self, replica: Any) -> None:
        if any(r is replica for r in self.replicas):
            raise ValueError("this replica is already managed")
        self.replicas.append(replica)
        self._names[id(replica)] = f"replica-{self._counter}"
        self._counter += 1

    def name_of(self, replica: Any) -> str:
        return self._names[id(replica)]

    def add_replica(self, replica: Any) -> str:
        """Manage one more replica; the next sync rebuilds the group and sends it everything."""
        self._register(replica)
        self._invalidate()
        return self.name_of(replica)

    def remove_replica(self, replica: Any) -> Any:
        """Stop managing ``replica`` (a handle or its index); its engine is finalized."""
        if isinstance(replica, int):
            replica = self.replicas[replica]
        index = next((i for i, r in enumerate(self.replicas) if r is replica), None)
        if index is None:
            raise ValueError("this replica is not managed by this manager")
        self.replicas.pop(index)
        self._invalidate()
        outcome = call_all([Call(self.name_of(replica), replica, "ws_finalize")],
                           timeout=self.timeout, phase="remove_replica")[0]
        if not outcome.ok:
            logger.warning("weightsync: finalizing removed %s failed: %s",
                           self.name_of(replica), outcome.error)
        return replica

    def _invalidate(self) -> None:
        self._group_ready = False
        self._weights = {}

    # -- group ------------------------------------------------------------------------
    def _trainer_calls(self, method: str, *args: Any, per_rank: Optional[list] = None,
                       **kwargs: Any) -> list[Call]:
        return [Call(f"trainer rank {i}", h, method,
                     (per_rank[i],) if per_rank is not None else args, kwargs)
                for i, h in enumerate(self.trainers)]

    def _replica_calls(self, method: str, *args: Any, per_replica: Optional[list] = None,
                       **kwargs: Any) -> list[Call]:
        return [Call(self.name_of(r), r, method,
                     (per_replica[j],) if per_replica is not None else args, kwargs)
                for j, r in enumerate(self.replicas)]

    def _run(self, calls: list[Call], phase: str, version: Any = None,
             timeout: Optional[float] = None) -> list[Any]:
        return values_or_raise(call_all(calls, timeout=timeout or self.timeout, phase=phase,
                                        version=version))

    def _finalize_all(self) -> None:
        outcomes = call_all(self._trainer_calls("ws_finalize") + self._replica_calls("ws_finalize"),
                            timeout=self.timeout, phase="finalize")
        for o in outcomes:
            if not o.ok:
                logger.warning("weightsync: finalize on %s failed: %s", o.label, o.error)

    def build_group(self) -> None:
        """prepare -> build_topology -> validate -> init_process_group (see module doc)."""
        if not self.replicas:
            raise ValueError("no rollout replicas to sync to; add_replica first")
        self._group_ready = False
        metas = self._run(self._trainer_calls("ws_prepare", self.backend, self.engine_kwargs)
                          + self._replica_calls("ws_prepare", self.backend, self.engine_kwargs),
                          "prepare")
        n_train = len(self.trainers)
        trainer_metas, replica_metas = metas[:n_train], metas[n_train:]
        self._ranks = []
        for r, m in zip(self.replicas, replica_metas):
            if not isinstance(m, (list, tuple)) or not m:
                raise TopologyError(f"{self.name_of(r)} returned no receiving rank from "
                                    f"prepare (got {m!r})", peer=self.name_of(r), phase="prepare")
            self._ranks.append(len(m))
        flat = [meta for m in replica_metas for meta in m]
        tk, rk = self._engine_cls.build_topology(n_train, len(flat), list(trainer_metas) + flat)
        self._check(tk, "trainer", n_train)
        self._check(rk, "rollout", len(flat))
        rollout_kw, start = [], 0
        for n in self._ranks:
            rollout_kw.append([self._entry(rk, j) for j in range(start, start + n)])
            start += n
        trainer_kw = [self._entry(tk, i) for i in range(n_train)]
        self._run(self._trainer_calls("ws_init", per_rank=trainer_kw)
                  + self._replica_calls("ws_init", per_replica=rollout_kw), "init")
        caps = self._run(self._replica_calls("ws_capabilities"), "capabilities")
        self._caps = {id(r): c for r, c in zip(self.replicas, caps)}
        self._group_ready = True
        logger.info("weightsync: %s group ready: %d trainer ranks -> %d replicas (%d ranks)",
                    self.backend, n_train, len(self.replicas), len(flat))

    def _check(self, kwargs: Any, side: str, size: int) -> None:
        if isinstance(kwargs, dict):
            validate_topology(self.backend, side, kwargs, size)
        elif isinstance(kwargs, (list, tuple)):
            if len(kwargs) != size:
                raise TopologyError(f"{self.backend}: build_topology gave {len(kwargs)} {side} "
                                    f"entries, but the {side} side has {size} workers",
                                    phase="build_topology")
        else:
            raise TopologyError(f"{self.backend}: build_topology returned "
                                f"{type(kwargs).__name__} for the {side} side",
                                phase="build_topology")

    @staticmethod
    def _entry(kwargs: Any, index: int) -> dict:
        return worker_kwargs(kwargs, index) if isinstance(kwargs, dict) else dict(kwargs[index])

    def shutdown(self) -> None:
        """Finalize every worker's engine (bounded, best effort)."""
        self._finalize_all()
        self._invalidate()

    def __enter__(self) -> "CheckpointEngineManager":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    # -- syncs ------------------------------------------------------------------------
    def lora_config(self) -> Optional[dict]:
        """The trainer's PEFT config (asked once from trainer rank 0), None without LoRA."""
        if self._lora is False:
            self._lora = self._run(self._trainer_calls("ws_lora_config")[:1], "lora_config")[0]
        return self._lora

    @property
    def base_sync_done(self) -> bool:
        return bool(self.replicas) and all(self._weights.get(id(r)) == "base"
                                           for r in self.replicas)

    def _rounds(self, merge_and_sync: bool) -> list[tuple[str, Optional[dict]]]:
        cfg = self.lora_config()
        if cfg is None or merge_and_sync:
            return [("full", None)]
        if self.base_sync_done:
            return [("adapter", cfg)]
        return [("base", None), ("adapter", cfg)]

    def _level(self, rounds: list) -> int:
        level = self.sleep_level
        if level < 2:
            return level
        kinds = {k for k, _ in rounds}
        reason = None
        if not ("full" in kinds or {"base", "adapter"} <= kinds):
            reason = "this sync sends only the LoRA adapter, so the base weights would be lost"
        else:
            bad = [self.name_of(r) for r in self.replicas
                   if not self._caps.get(id(r), {}).get("full_sync_restores_discarded", False)]
            if bad:
                reason = f"{bad} cannot restore everything that level 2 discards"
        if reason is None:
            return level
        msg = f"weightsync: sleep_level={level} capped at 1: {reason}"
        if reason not in self._warned:       # once per reason and manager
            self._warned.add(reason)
            warnings.warn(msg, RuntimeWarning, stacklevel=4)
        else:
            logger.info(msg)
        return 1

    def update_weights(self, version: Any, merge_and_sync: bool = True) -> SyncReport:
        """One sync of the trainer's current weights as ``version`` (see the module doc)."""
        if isinstance(version, bool) or not isinstance(version, (int, str)):
            raise ValueError(f"version must be an int or a str, got {version!r}")
        start = time.perf_counter()
        report = SyncReport(version=version)
        if not self._group_ready:
            self.build_group()
            report.rebuilt = True
        rounds = self._rounds(merge_and_sync)
        report.kinds = [k for k, _ in rounds]
        self._check_kinds(report.kinds)
        statuses = {id(r): ReplicaStatus(j, self.name_of(r), ok=True)
                    for j, r in enumerate(self.replicas)}
        report.replicas = list(statuses.values())
        try:
            self._step(report, "pause", self._replica_calls("ws_pause", abort=True))
            if self.colocated:
                self._sleep_and_wake_weights(report, rounds)
            for kind, cfg in rounds:
                self._transfer(report, statuses, version, kind, cfg)
            if self.colocated:
                if self.offload_trainer:
                    self._step(report, "trainer_reload", self._trainer_calls("ws_reload"))
                self._step(report, "wake_up:kv_cache",
                           self._replica_calls("ws_wake_up", ["kv_cache"]))
            if not self.keep_group:
                self._step(report, "finalize", self._trainer_calls("ws_finalize")
                           + self._replica_calls("ws_finalize"))
                self._group_ready = False
            self._step(report, "reset_caches", self._replica_calls("ws_reset_caches"))
        except BaseException as exc:
            self._after_failure(report, statuses, exc)
            raise
        finally:
            self._resume(report)
            report.total_seconds = time.perf_counter() - start
        kind = "full" if "full" in report.kinds else "base"
        for r in self.replicas:
            self._weights[id(r)] = kind
            statuses[id(r)].version = version
        logger.info("weightsync: %s", report.summary())
        return report

    def _check_kinds(self, kinds: list[str]) -> None:
        """Refuse before anything moves when a replica cannot apply a weight set (e.g. a
        vLLM replica without LoRA support and an adapter-only sync)."""
        for r in self.replicas:
            caps = self._caps.get(id(r), {})
            bad = [k for k in kinds if k not in caps.get("kinds", kinds)]
            if bad:
                why = caps.get("reasons", {}).get("lora", "")
                raise ValueError(f"{self.name_of(r)} cannot apply {bad} syncs"
                                 f"{': ' + why if why else ''}")

    def _step(self, report: SyncReport, phase: str, calls: list[Call]) -> list[Any]:
        report.phases.append(phase)
        return self._run(calls, phase, report.version)

    def _sleep_and_wake_weights(self, report: SyncReport, rounds: list) -> None:
        level = self._level(rounds)
        report.sleep_level = level
        self._step(report, f"sleep:{level}", self._replica_calls("ws_sleep", level))
        if self.offload_trainer:
            self._step(report, "trainer_offload", self._trainer_calls("ws_offload"))
        self._step(report, "wake_up:weights", self._replica_calls("ws_wake_up", ["weights"]))

    def _transfer(self, report: SyncReport, statuses: dict, version: Any, kind: str,
                  cfg: Optional[dict]) -> None:
        report.phases.append(f"sync:{kind}")
        calls = self._trainer_calls("ws_send", version, kind=kind) + \
            self._replica_calls("ws_receive", version, kind=kind, adapter_config=cfg)
        t0 = time.perf_counter()
        outcomes = call_all(calls, timeout=self.call_timeout, phase=f"sync:{kind}",
                            version=version)
        report.seconds += time.perf_counter() - t0
        n = len(self.trainers)
        for o in outcomes[:n]:
            if o.ok:
                report.trainer.append(o.value)
                report.bytes += int(o.value.get("bytes", 0))
        for r, o in zip(self.replicas, outcomes[n:]):
            st = statuses[id(r)]
            if o.ok:
                st.seconds += float(o.value.get("seconds", 0.0))
                st.bytes += int(o.value.get("bytes", 0))
            else:
                st.ok, st.error = False, f"{type(o.error).__name__}: {o.error}"
        # Raise the root cause first: a worker's own failure, not a peer relaying it.
        ordered = sorted(outcomes[n:] + outcomes[:n],
                         key=lambda o: o.ok or getattr(o.error, "peer", None) != o.label)
        values_or_raise(ordered)

    def _after_failure(self, report: SyncReport, statuses: dict, exc: BaseException) -> None:
        self._invalidate()       # the next sync rebuilds the group and resends everything
        for st in statuses.values():
            if st.ok and isinstance(exc, WeightSyncError) and st.error is None:
                st.ok, st.error = False, f"sync aborted: {type(exc).__name__}: {exc}"
        if isinstance(exc, WeightSyncError):
            exc.report = report  # type: ignore[attr-defined]
        if self.colocated:
            outcomes = call_all(self._replica_calls("ws_wake_up", None), timeout=self.timeout,
                                phase="wake_up", version=report.version)
            for o in outcomes:
                if not o.ok:
                    logger.warning("weightsync: wake_up after a failed sync: %s", o.error)

    def _resume(self, report: SyncReport) -> None:
        report.phases.append("resume")
        for o in call_all(self._replica_calls("ws_resume"), timeout=self.timeout,
                          phase="resume", version=report.version):
            if not o.ok:
                logger.warning("weightsync: resume on %s failed: %s", o.label, o.error)

    # -- generation -------------------------------------------------------------------
    def generate(self, prompts: Sequence[Sequence[int]], *, replica: Optional[int] = None,
                 **kwargs: Any) -> list:
        """Generate on one replica (round robin unless ``replica`` is given)."""
        if not self.replicas:
            raise ValueError("no rollout replicas")
        if replica is None:
            replica = self._counter_rr = (getattr(self, "_counter_rr", -1) + 1) % len(self.replicas)
        handle = self.replicas[replica]
        return self._run([Call(self.name_of(handle), handle, "generate", (prompts,), kwargs)],
                         "generate")[0]
