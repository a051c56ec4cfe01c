"""``CheckpointEngineManager``: drive trainer workers and rollout replicas through syncs.

Owns the public API and the steps of a sync; what it knows of each replica lives in a
:class:`~weightsync.orchestration.replicas.ReplicaSet`, the group and its calls in a
:class:`~weightsync.orchestration.group.ReplicaGroup`, the checks in
:mod:`~weightsync.orchestration.checks`. Used by callers of the library (re-exported by
``weightsync``), the verl integration and ``weightsync demo``.

Workers are Ray actor handles (or plain objects in this process) whose classes use
:class:`~weightsync.integrations.ray.mixins.TrainerWorkerMixin` / ``RolloutWorkerMixin``. The manager
knows the transport only through :class:`~weightsync.transport.CheckpointEngineRegistry`:

1. **Group** (first sync, and again after ``add_replica``/``remove_replica`` or a failed
   sync): ``prepare`` on every worker of both sides concurrently; the backend's
   ``build_topology``; a check that every keyword has one entry per worker
   (``TopologyError`` naming backend, side, key and sizes); ``init_process_group`` on all
   workers concurrently.
2. **Validation before bytes**: every trainer rank describes what it will send (names,
   shapes, dtypes, from metadata only) and every replica checks that against its model;
   a mismatch raises ``PlanMismatch`` listing the offending names before anything is
   paused or sent, and every replica keeps its weights. A replica that already accepted
   the very same description (digest) is not asked again; a stale, isolated or re-added
   replica is, and ``revalidate()`` makes the next sync ask every replica.
3. **Sync** (``update_weights``): pause/abort generation -> ``begin_sync`` (fences
   generation until the whole version is applied) -> (colocated: sleep, offload the
   trainer if asked, wake ``weights``) -> send on every trainer rank and receive on every
   rollout rank concurrently, one round per weight set -> (colocated: reload the trainer,
   wake ``kv_cache``) -> finalize the group unless ``keep_group`` -> reset caches ->
   resume. Returns a :class:`~weightsync.orchestration.report.SyncReport`.

**Failure isolation** (``isolate_failures=True``): a replica that dies, does not answer
in time or fails on its own during any step is removed from the topology and marked
failed (not routed to, fenced); the group is rebuilt without it and the replicas that did
not complete the version receive it again (the trainer re-walks its weights), all within
the same call. The report names who failed and why (``report.isolated``,
``report.failed``). ``add_replica`` takes a failed replica (or its replacement) back; the
next sync brings it to the current version. A trainer's failure cannot be isolated: the
call raises the root cause, with the partial report on ``exc.report``; the replicas stay
fenced until a later sync completes (after a restart: ``set_trainers``).

LoRA (the trainer model is a PEFT model): ``merge_and_sync=True`` sends merged weights;
``merge_and_sync=False`` sends the base weights once (``base_sync_done``) and from then on
only the adapter and its PEFT config; a replica that joined, or a group rebuilt after a
failure, gets the base again. Colocated sleep level 2 discards the rollout's weights; when
the coming sync would not restore all of them (adapter-only, or a replica whose engine
cannot restore what it discarded) the level is capped at 1 with a warning.

**Atomic syncs** (``atomic=True``, or ``WEIGHTSYNC_ATOMIC``): replicas receive into a
staging copy (one copy of their weights) and commit once all have received; a failure
before the sync is decided aborts it and every replica keeps its previous version,
serving (:mod:`~weightsync.orchestration.atomic`; sleep level 2 is capped at 1).

Every call on a worker is bounded (``timeout`` of the engines, plus a margin for the
call itself; once the trainer ranks of a step are done, the replicas get ``timeout`` + 5 s
more); a worker that does not answer or dies becomes ``SyncTimeout``/``PeerFailed``
naming it. ``verify()`` compares a digest of each replica's weights with the trainer's.
"""

from __future__ import annotations

import logging
import threading
import time
import warnings
from typing import Any, Optional, Sequence

from weightsync.orchestration.atomic import abort_all, check_staging, commit_all, release_all
from weightsync.orchestration.calls import Call, call_all
from weightsync.orchestration.group import ReplicaGroup
from weightsync.orchestration.checks import run_validate, run_verify
from weightsync.orchestration.join import JOIN_FROM, can_join, join_replica
from weightsync.orchestration.replicas import ReplicaSet
from weightsync.core.remote import normalize_version
from weightsync.core.config import EngineConfig, build_options, env_value, option_names, parse_bool
from weightsync.transport.registry import CheckpointEngineRegistry
from weightsync.transport.codec import codec_options, resolve_backend
from weightsync.core.errors import PlanMismatch, WeightSyncError
from weightsync.core.plan import dtype_name
from weightsync.orchestration.report import ReplicaStatus, SyncReport, VerifyReport
from weightsync.core.config import SLEEP_LEVELS
from weightsync.orchestration import workers as ws

__all__ = ["CheckpointEngineManager", "SyncReport", "ReplicaStatus", "VerifyReport"]

logger = logging.getLogger(__name__)
_ENGINE_KEYS = ("device", "dtype", "num_slots", "checksum", "host")


def _trainer_list(trainer: Any) -> list:
    trainers = list(trainer) if isinstance(trainer, (list, tuple)) else [trainer]
    if not trainers:
        raise ValueError("trainer must be a worker handle or a non-empty list of them")
    return trainers


def _of_group(name: str) -> property:
    """A setting the manager shares with its group: read and set through the manager."""
    return property(lambda self: getattr(self._group, name),
                    lambda self, value: setattr(self._group, name, value))


class CheckpointEngineManager:
    """Weight syncs from ``trainer`` workers (one handle per rank) to ``replicas``."""

    backend = _of_group("backend")
    trainers = _of_group("trainers")
    engine_kwargs = _of_group("engine_kwargs")
    timeout = _of_group("timeout")
    call_timeout = _of_group("call_timeout")      # above a worker's own bound
    settle = _of_group("settle")                  # replicas, once the trainers are done
    isolate_failures = _of_group("isolate_failures")

    def __init__(self, backend: str, trainer: Any, replicas: Sequence[Any], *,
                 colocated: bool = False, sleep_level: int = 1,
                 bucket_size: Optional[int] = None, timeout: Optional[float] = None,
                 keep_group: bool = True, offload_trainer: bool = False,
                 isolate_failures: bool = True, atomic: Optional[bool] = None,
                 delta: Any = None, quantize: Optional[str] = None,
                 **engine_kwargs: Any) -> None:
        if not isinstance(backend, str):
            raise ValueError(f"backend must be a backend name (str), got {backend!r}")
        # delta / FP8: the codec layer over the backend ("shm" + delta=True: "delta+shm");
        # None: WEIGHTSYNC_DELTA / WEIGHTSYNC_QUANTIZE, else the name's defaults
        backend, codec_kw = resolve_backend(backend, delta=delta,
                                            quantize="unset" if quantize is None else quantize)
        engine_cls = CheckpointEngineRegistry.get(backend)  # unknown -> clear error
        self.codec = codec_options(engine_cls, codec_kw)
        trainers = _trainer_list(trainer)
        if isinstance(replicas, (str, bytes)) or not isinstance(replicas, (list, tuple)):
            raise ValueError("replicas must be a list of rollout worker handles")
        if sleep_level not in SLEEP_LEVELS:
            raise ValueError(f"sleep_level must be one of {SLEEP_LEVELS}, got {sleep_level!r}")
        # the backend's own options (e.g. zero_copy=, direct=, serve=, or options=) travel
        # to every worker's engine as they are; the engine validates them
        backend_keys = set(option_names(engine_cls.options_cls)) | {"options"}
        inner = getattr(engine_cls, "inner_cls", None)     # a codec engine's backend
        if inner is not None:
            backend_keys |= set(option_names(inner.options_cls))
        unknown = sorted(set(engine_kwargs) - set(_ENGINE_KEYS) - backend_keys)
        if unknown:
            raise ValueError(f"unknown engine option(s) {unknown} for backend {backend!r}; known: "
                             f"{['bucket_size', 'timeout', *_ENGINE_KEYS, *sorted(backend_keys)]}")
        given = {k: v for k, v in (("bucket_size", bucket_size), ("timeout", timeout))
                 if v is not None}   # left out: WEIGHTSYNC_* or the defaults, as engines do
        config = EngineConfig(**given, **{k: v for k, v in engine_kwargs.items()
                                          if k in _ENGINE_KEYS})
        # a wrong backend option is a ValueError here, not on every worker later
        opts_cls = inner.options_cls if inner is not None else engine_cls.options_cls
        own = {k: v for k, v in engine_kwargs.items() if k in option_names(opts_cls)}
        given_opts = engine_kwargs.get("options")
        if own or given_opts is not None:
            build_options(opts_cls, given_opts if opts_cls is None or isinstance(given_opts, opts_cls)
                          else None, own, owner=backend)
        self.atomic = bool(env_value("ATOMIC", parse_bool, False) if atomic is None else atomic)
        self._replicas = ReplicaSet()
        self._group = ReplicaGroup(
            backend, engine_cls, {"bucket_size": config.bucket_size, "timeout": config.timeout,
                                  **engine_kwargs, **codec_kw},
            trainers, self._replicas, timeout=config.timeout,
            call_timeout=2 * config.timeout + 60, settle=config.timeout + 5.0,
            isolate_failures=bool(isolate_failures), abort_on_failure=self.atomic)
        self._dtype = dtype_name(config.dtype) if config.dtype is not None else None
        self.colocated, self.sleep_level = bool(colocated), sleep_level
        self.keep_group, self.offload_trainer = bool(keep_group), bool(offload_trainer)
        self.version: Any = None                  # last version a sync completed
        self._last_kinds: list = []               # its rounds
        self.last_join: Optional[dict] = None     # figures of the last add_replica join
        self._lock = threading.RLock()
        self._lora: Any = False                  # False: not asked yet; None: no LoRA
        self._warned: set[str] = set()
        for r in replicas:
            self._replicas.add(r, healthy=True)

    # -- replicas ---------------------------------------------------------------------
    @property
    def replicas(self) -> list:
        """The managed replicas' handles (healthy or stale), in the order they joined."""
        return self._replicas.handles()

    def name_of(self, replica: Any) -> str:
        """The name of a managed or failed replica (``KeyError`` for another handle)."""
        record = self._replicas.lookup(replica)
        if record is None:
            raise KeyError(id(replica))
        return record.name

    def healthy_replicas(self) -> list:
        """Replicas that hold a complete version and may serve generation."""
        return [r.handle for r in self._replicas.healthy()]

    def failed_replicas(self) -> dict[str, str]:
        """Replicas removed by isolation: name -> why (``add_replica`` takes one back)."""
        return self._replicas.failed()

    def replica_health(self) -> list[dict]:
        """Every replica the manager knows: name, state, last known version, error."""
        return self._replicas.health()

    def route(self) -> Any:
        """The next healthy replica, round robin (``WeightSyncError`` if there is none)."""
        return self._replicas.route()

    # -- membership -------------------------------------------------------------------
    def add_replica(self, replica: Any, *, join: bool = True, join_from: str = "auto",
                    join_wait_s: Optional[float] = None) -> str:
        """Manage one more replica (or take back a failed one, under its old name).

        With ``join`` and a backend that can (``nixl``; after a full sync on a kept group),
        the replica is brought to the current version at once
        (:mod:`~weightsync.orchestration.join`): it pulls that version from the trainer
        ranks' arenas (``join_from="trainer"``), from a healthy replica that holds it
        (``"replica"``: the trainer ranks are not asked), or (``"auto"``) from the trainer
        ranks if they all offer within ``join_wait_s`` seconds (default 2), else from a
        healthy replica: a busy trainer does not hold the joiner up. No other replica is
        paused (they keep generating), and it is routed to from then on; a weight set it
        cannot take is a ``PlanMismatch`` before any byte moves, and the replica is not
        added. Otherwise (or when the join fails: logged) it is not routed to until the
        next sync, which sends it everything. Either way the next sync rebuilds the group
        with it."""
        if join_from not in JOIN_FROM:
            raise ValueError(f"join_from must be one of {JOIN_FROM}, got {join_from!r}")
        if join_wait_s is not None and (isinstance(join_wait_s, bool) or
                                        not isinstance(join_wait_s, (int, float)) or
                                        not 0 < join_wait_s <= 3600):
            raise ValueError(f"join_wait_s must be seconds in (0, 3600], got {join_wait_s!r}")
        with self._lock:
            record = self._replicas.add(replica, healthy=self.version is None)
            why = "not asked" if not join else can_join(self._group, self.version,
                                                        self._last_kinds, self.keep_group)
            if why is None:
                try:
                    self.last_join = join_replica(self._group, self._replicas, record,
                                                  self.version, self._dtype, self.codec,
                                                  source=join_from, wait_s=join_wait_s,
                                                  colocated=self.colocated)
                except PlanMismatch:
                    self._replicas.remove(record)
                    raise
                except WeightSyncError as exc:
                    logger.warning("weightsync: %s could not join at version %s (%s); the "
                                   "next sync brings it", record.name, self.version, exc)
                    self._replicas.mark_stale(record)
            elif join and self.version is not None:
                logger.info("weightsync: %s gets the next sync (%s)", record.name, why)
            self._invalidate()
            return record.name

    def remove_replica(self, replica: Any) -> Any:
        """Stop managing ``replica`` (a handle, its index, or a failed replica's handle);
        its engine is finalized."""
        with self._lock:
            record = self._replicas.failed_record(replica)
            if record is not None:
                self._replicas.remove(record)
                return record.handle
            if isinstance(replica, int):
                replica = self.replicas[replica]
            record = self._replicas.get(replica)
            if record is None:
                raise ValueError("this replica is not managed by this manager")
            self._replicas.remove(record)
            self._invalidate()
            outcome = call_all([Call(record.name, replica, ws.FINALIZE)],
                               timeout=self.timeout, phase="remove_replica")[0]
            if not outcome.ok:
                logger.warning("weightsync: finalizing removed %s failed: %s",
                               record.name, outcome.error)
            return replica

    def set_trainers(self, trainer: Any) -> None:
        """Replace the trainer workers (e.g. restarted after a failure); the next sync
        builds a new group and sends everything."""
        with self._lock:
            self.trainers = _trainer_list(trainer)
            self._lora = False
            self._invalidate()

    def build_group(self) -> None:
        """prepare -> build_topology -> validate -> init_process_group (see module doc)."""
        self._group.build(None, self._replicas.managed())

    def _invalidate(self) -> None:
        self._group.invalidate()
        self._replicas.forget_weights()

    def _finalize_all(self) -> None:
        g = self._group
        outcomes = call_all(g.trainer_calls(ws.FINALIZE) + g.replica_calls(ws.FINALIZE),
                            timeout=self.timeout, phase="finalize")
        for o in outcomes:
            if not o.ok:
                logger.warning("weightsync: finalize on %s failed: %s", o.label, o.error)

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
            self._lora = self._group.run(self._group.trainer_calls(ws.LORA_CONFIG)[:1],
                                         "lora_config")[0]
        return self._lora

    @property
    def base_sync_done(self) -> bool:
        records = self._replicas.managed()
        return bool(records) and all(r.weights == "base" for r in records)

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
        if self.atomic:
            reason = "atomic=True keeps the previous version, which level 2 would discard"
        elif not ("full" in kinds or {"base", "adapter"} <= kinds):
            reason = "this sync sends only the LoRA adapter, so the base weights would be lost"
        else:
            bad = [r.name for r in self._replicas.managed()
                   if not r.caps.get("full_sync_restores_discarded", False)]
            if bad:
                reason = f"{bad} cannot restore everything that level 2 discards"
        if reason is None:
            return level
        msg = f"weightsync: sleep_level={level} capped at 1: {reason}"
        if reason not in self._warned:       # once per reason and manager
            self._warned.add(reason)
            warnings.warn(msg, RuntimeWarning, stacklevel=5)
        else:
            logger.info(msg)
        return 1

    def update_weights(self, version: Any, merge_and_sync: bool = True) -> SyncReport:
        """One sync of the trainer's current weights as ``version`` (see the module doc)."""
        if version is None:
            raise ValueError("version must be an int or a str, got None")
        version = normalize_version(version)     # numpy ints and int subclasses: plain int
        with self._lock:
            start = time.perf_counter()
            report = SyncReport(version=version, atomic=self.atomic)
            self._replicas.begin_sync(report)
            try:
                self._sync(report, version, merge_and_sync)
            except BaseException as exc:
                self._after_failure(report, exc)
                raise
            finally:
                self._resume(report)
                report.total_seconds = time.perf_counter() - start
            logger.info("weightsync: %s", report.summary())
            return report

    def _sync(self, report: SyncReport, version: Any, merge_and_sync: bool) -> None:
        if not len(self._replicas):
            raise ValueError("no rollout replicas to sync to; add_replica first")
        g = self._group
        rounds = self._rounds(merge_and_sync)
        report.kinds = [k for k, _ in rounds]
        g.ensure(report)
        self._replicas.check_kinds(report.kinds)
        if self.atomic:
            check_staging(self._replicas, report.kinds)
        run_validate(g, self._replicas, report, rounds, self._dtype, self.codec)
        g.replica_step(report, "pause", ws.PAUSE, kwargs={"abort": True})
        self._replicas.mark_fenced()
        g.replica_step(report, "begin_sync", ws.BEGIN_SYNC, (version, report.kinds),
                       {"staged": True} if self.atomic else None, record=False)
        if self.colocated:
            self._sleep_and_wake_weights(report, rounds)
        g.ensure(report)               # rebuilt without a replica isolated meanwhile
        todo = g.transfer(report, version, rounds)
        while todo:                    # isolated someone: re-run for who did not complete
            report.retries += 1
            members = g.build(report, todo)
            if not members:
                break
            g.replica_step(report, "begin_sync", ws.BEGIN_SYNC, (version, report.kinds),
                           targets=members, record=False)
            todo = g.transfer(report, version, rounds)
        if self.colocated:
            if self.offload_trainer:
                self._step(report, "trainer_reload", g.trainer_calls(ws.RELOAD))
            g.replica_step(report, "wake_up:kv_cache", ws.WAKE_UP, (["kv_cache"],))
        if not self.keep_group:
            self._step(report, "finalize", g.trainer_calls(ws.FINALIZE)
                       + g.replica_calls(ws.FINALIZE))
            g.invalidate()
        if self.atomic:
            commit_all(g, self._replicas, report, version)
        g.replica_step(report, "reset_caches", ws.RESET_CACHES)
        if self.atomic:        # decided: every replica committed and reset its caches
            release_all(g, report, version)
        self._replicas.synced(version, "full" if "full" in report.kinds else "base", report)
        self.version, self._last_kinds = version, list(report.kinds)

    def _step(self, report: SyncReport, phase: str, calls: list[Call]) -> list[Any]:
        report.phases.append(phase)
        return self._group.run(calls, phase, report.version)

    def _sleep_and_wake_weights(self, report: SyncReport, rounds: list) -> None:
        level = self._level(rounds)
        report.sleep_level = level
        self._group.replica_step(report, f"sleep:{level}", ws.SLEEP, (level,))
        if self.offload_trainer:
            self._step(report, "trainer_offload", self._group.trainer_calls(ws.OFFLOAD))
        self._group.replica_step(report, "wake_up:weights", ws.WAKE_UP, (["weights"],))

    def _after_failure(self, report: SyncReport, exc: BaseException) -> None:
        self._invalidate()       # the next sync rebuilds the group and resends everything
        if not self.atomic:
            self._replicas.stale_fenced()      # fenced until a sync completes
        for st in report.replicas:
            if st.ok and isinstance(exc, WeightSyncError) and st.error is None:
                st.ok, st.error = False, f"sync aborted: {type(exc).__name__}: {exc}"
        if isinstance(exc, WeightSyncError):
            exc.report = report  # type: ignore[attr-defined]
        if self.colocated:
            outcomes = call_all(self._group.replica_calls(ws.WAKE_UP, None),
                                timeout=self.timeout, phase="wake_up", version=report.version)
            for o in outcomes:
                if not o.ok:
                    logger.warning("weightsync: wake_up after a failed sync: %s", o.error)
        if self.atomic:          # every replica back on (and serving) its previous version
            abort_all(self._group, self._replicas, report)

    def _resume(self, report: SyncReport) -> None:
        report.phases.append("resume")
        for o in call_all(self._group.replica_calls(ws.RESUME), timeout=self.timeout,
                          phase="resume", version=report.version):
            if not o.ok:
                logger.warning("weightsync: resume on %s failed: %s", o.label, o.error)

    def revalidate(self) -> None:
        """Make the next sync check its weight set on every replica again (e.g. after a
        replica's model was changed outside the manager)."""
        self._replicas.forget_checks()

    # -- integrity and generation -----------------------------------------------------
    def verify(self, *, fence: bool = True) -> VerifyReport:
        """Compare a digest of every replica's weights with the trainer's (xxh3 per tensor,
        the trainer's cast to each replica's dtypes; FSDP2 shards gathered as in a sync).
        ``fence``: a replica that differs is fenced and marked stale until the next sync."""
        with self._lock:
            return run_verify(self._group, self._replicas, self.version, self._dtype,
                              fence=fence, codec=self.codec)

    def generate(self, prompts: Sequence[Sequence[int]], *, replica: Optional[int] = None,
                 **kwargs: Any) -> list:
        """Generate on one replica: the next healthy one (round robin, see ``route``)
        unless ``replica`` (an index into ``replicas``) is given."""
        handle = self.route() if replica is None else self.replicas[replica]
        return self._group.run([Call(self.name_of(handle), handle, "generate", (prompts,),
                                     kwargs)], "generate")[0]
