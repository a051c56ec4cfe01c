"""ms-swift's ``CheckpointEngine`` contract over one weightsync engine.

ms-swift's manager drives it exactly as its NCCL engine: ``engine.is_master = flag`` then
``prepare()`` on every actor (only the master's result is used), its own
``NCCLCheckpointEngine.build_topology``, ``init_process_group(rank, world_size,
master_metadata)`` on all at once, ``send_weights(iterator)`` on every trainer rank with
``receive_weights()`` on every rollout, then ``finalize()``. ``init_process_group`` checks
the call and connects to rank 0's store; the join (keep the group or build it) runs at the
start of the send / receive that follows, so it costs no Ray round trip of its own.
Behind that call shape (:mod:`.rendezvous`): the weightsync backend's own topology, token,
timeouts and version checks. ms-swift's topology has one sender (rank 0; the other trainer ranks get rank -1
and only walk their export): ``senders="master"``, the default (env
``WEIGHTSYNC_SWIFT_SENDERS``). ``senders="all"`` puts every trainer rank of rank 0's
``torch.distributed`` world into the weightsync group behind that shape: a rank -1 trainer
learns its index from ``torch.distributed``, reports to rank 0's rendezvous and sends what
its export yields, each name from one rank (the backend's ownership agreement) -- for
trainer ranks with links of their own (several hosts or NICs); on one host the senders
share its memory bandwidth and cores, so one sender is as fast. A send that fails walks the
rest of its iterator, so trainer ranks in a collective export are never left waiting.

The version of a sync is the count of rank 0's ``prepare()`` calls (the same on every
worker, from the master metadata). ``reuse`` (default true, env
``WEIGHTSYNC_SWIFT_REUSE``) keeps buffers and groups across syncs while every worker is
unchanged; a failed sync, a new or restarted worker or :meth:`close` makes everybody
re-join at the next one.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import logging
import os
import re
import secrets
import socket
import threading
import time
import weakref
from typing import Any, AsyncIterator, Optional

from swift.ray.megatron.checkpoint_engine import CheckpointEngine as SwiftCheckpointEngine

from weightsync.core.config import EngineConfig, env_value, parse_bool
from weightsync.core.errors import SyncTimeout, TopologyError, WeightSyncError
from weightsync.integrations.swift.layout import Layout, LayoutFeed
from weightsync.integrations.swift.rendezvous import (GRACE, Channel, follow_join,
                                                      follow_transfer, lead_join, lead_transfer)
from weightsync.transport.control.store import close_store, connect_store, host_store, new_token
from weightsync.rollout.protocol import ReceiveStream
from weightsync.trainer.fsdp import dist_rank_world
from weightsync.transport.registry import CheckpointEngineRegistry as WsRegistry

__all__ = ["WeightsyncSwiftEngine", "new_engine", "describe_actor", "DEFAULT_BACKEND", "PROTOCOL",
           "SENDERS"]

logger = logging.getLogger(__name__)
DEFAULT_BACKEND = "collective"
PROTOCOL = "weightsync-swift/1"
SENDERS = ("all", "master")
_live: "weakref.WeakSet[WeightsyncSwiftEngine]" = weakref.WeakSet()


def _node_ip() -> str:
    try:
        import ray
        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except Exception:  # Ray missing or not connected
        logger.debug("no Ray node IP", exc_info=True)
    return socket.gethostbyname(socket.gethostname())


def describe_actor(obj: Any = None) -> str:
    """``ClassName pid N on host, Ray actor <name or id>``: how errors name a worker."""
    text = f"{type(obj).__name__ if obj is not None else 'process'} pid {os.getpid()} " \
           f"on {socket.gethostname()}"
    try:
        import ray
        if ray.is_initialized():
            ctx = ray.get_runtime_context()
            actor = getattr(ctx, "get_actor_name", lambda: None)() or ctx.get_actor_id()
            if actor:
                text += f", Ray actor {actor}"
    except Exception:  # not in an actor
        logger.debug("no Ray actor context", exc_info=True)
    return text


class _Feed:
    """The trainer's weight iterator; :meth:`drain` walks what a failed send left."""

    def __init__(self, weights: Any) -> None:
        self._it = iter(weights)
        self.broken = False

    def __iter__(self) -> "_Feed":
        return self

    def __next__(self) -> Any:
        try:
            return next(self._it)
        except StopIteration:
            raise
        except BaseException:
            self.broken = True    # the iterator itself failed: nothing left to walk
            raise

    def drain(self) -> None:
        if self.broken:
            return
        try:
            for _ in self._it:    # producing a tensor may be a collective with other ranks
                pass
        except ValueError:        # still running in the failed send's thread: it ends there
            pass
        except Exception as exc:  # the export group itself broke: nothing left to align
            logger.warning("weightsync-swift: draining the export after a failed send: %s", exc)


async def _walk(items: Any) -> None:
    if hasattr(items, "__aiter__"):
        async for _ in items:
            pass
    else:
        for _ in items:
            pass


def _drain(feed: Any) -> None:
    if isinstance(feed, _Feed):
        feed.drain()


def with_names(exc: BaseException, names: dict[str, str]) -> BaseException:
    """The same weightsync error, plus the ms-swift rank and actor of each peer it names."""
    if not isinstance(exc, WeightSyncError) or not names:
        return exc
    text = " ".join(str(x) for x in (exc.peer, exc.origin, exc.detail))
    known = [f"{k} = {v}" for k, v in names.items() if re.search(rf"\b{k}\b", text)]
    if not known:
        return exc
    try:
        new = type(exc)(f"{exc.detail} [{'; '.join(known)}]", peer=exc.peer, phase=exc.phase,
                        version=exc.version, origin=exc.origin)
    except Exception:  # a subclass with another signature: keep the original
        return exc
    new.confirmed = exc.confirmed
    for key, value in exc.__dict__.items():
        new.__dict__.setdefault(key, value)
    return new


class _Call:
    """A rollout's ``receive_checkpoint_weights`` of one round, from the mixin's wrapper:
    its report (join + check, in a thread, started as the call begins), whether the receive
    took that report's answer, and whether the call has ended."""

    def __init__(self, round_: Any) -> None:
        self.round = round_
        self.report: concurrent.futures.Future = concurrent.futures.Future()
        self.taken = self.moving = self.ended = False


class WeightsyncSwiftEngine(SwiftCheckpointEngine):
    """ms-swift's engine contract over the weightsync backend ``backend``.

    ``options``: the engine options (``bucket_size``, ``timeout``, ``num_slots``,
    ``dtype``, ``checksum``, ``device``, ``host``; ``host="auto"`` = this node's IP as Ray
    sees it, for ``collective`` across hosts), ``reuse`` and ``senders`` (see the module
    doc).
    """

    def __init__(self, backend: str = DEFAULT_BACKEND, **options: Any) -> None:
        if "role" in options:
            raise ValueError("options must not set 'role': ms-swift's is_master and ranks "
                             "decide it")
        WsRegistry.get(backend)   # BackendUnavailable / unknown name now, not at the first sync
        self.reuse = options.pop("reuse", env_value("SWIFT_REUSE", parse_bool, True))
        if not isinstance(self.reuse, bool):
            raise ValueError(f"reuse must be true or false, got {self.reuse!r}")
        self.senders = options.pop("senders", env_value("SWIFT_SENDERS", str, "master"))
        if self.senders not in SENDERS:
            raise ValueError(f"senders must be one of {SENDERS}, got {self.senders!r}")
        if (options.get("host") or env_value("HOST", str, None)) == "auto":
            options["host"] = _node_ip()           # as a keyword or WEIGHTSYNC_HOST=auto
        try:
            cfg = EngineConfig(**{k: v for k, v in options.items() if v is not None})
        except TypeError as exc:
            raise ValueError(f"bad weightsync option for ms-swift: {exc}") from None
        self.backend, self.options = backend, options
        self.timeout, self.host = cfg.timeout, cfg.host
        self.is_master, self.rank, self.world_size, self.version = False, None, None, None
        self.trainers = 1                # trainer ranks that send in this sync
        self.tindex: Optional[int] = None   # this trainer's index among them (None: walks)
        # rank 0: the other senders' last layout per (index, weight set)
        self.peer_layouts: dict[tuple, Layout] = {}
        self.told: set = set()   # other senders: (rank 0 session, weight set, digest) it has
        self.leader: Optional[str] = None   # rank 0's session in this sync
        self.who, self.session = describe_actor(), secrets.token_hex(8)
        self.inner: Any = None
        self.chan: Optional[Channel] = None
        self.group: Optional[str] = None
        self.members: Optional[list] = None
        self.names: dict[str, str] = {}
        self.intent: dict = {}
        self.has_base = False
        self.layout: Optional[Layout] = None     # rank 0: the layout checked for this sync
        self.layouts: dict[str, Layout] = {}     # rank 0: per weight set, the last one sent
        self.accepted: dict[str, str] = {}       # rollouts: check key -> digest that fits
        self.peft_fits: set = set()   # rollouts: check keys whose peft config fits the model
        self.stats = {"joins": 0, "reuses": 0, "releases": 0, "syncs": 0, "init_s": 0.0,
                      "refused": 0, "last_error": None, "checks": 0, "layout": None,
                      "sent_bytes": 0, "check_s": 0.0, "send_s": 0.0, "join_s": 0.0,
                      "reported": 0}   # syncs whose check used the reports of the hellos
        self._round = 0
        self._rdv: Any = None            # rank 0: the client that owns the rendezvous store
        self._rdv_auth = ""
        self._client: Any = None         # rollouts: ((host, port, auth), client)
        self._active = self._dirty = self._touched = self._join_pending = False
        self._call: Optional[_Call] = None   # rollouts: the receive call in flight
        self._calls = threading.Condition()
        self._last_kind: Optional[bool] = None
        _live.add(self)

    # -- ms-swift's lifecycle -------------------------------------------------------------
    def prepare(self) -> Optional[dict]:
        self._settle_call()
        if self._active:          # the last sync never reached finalize: it failed
            self._dirty = True
        if self._dirty:
            self._release()
        if not self.is_master:
            return None
        self._engine("trainer")
        if self._rdv is None:
            self._rdv_auth = new_token()
            self._rdv = host_store(self.host, self.timeout, self._rdv_auth)
        self._round += 1
        return {"weightsync": PROTOCOL, "backend": self.backend, "host": self.host,
                "port": self._rdv.port, "auth": self._rdv_auth, "session": self.session,
                "round": self._round, "trainers": self._sending_world()}

    def _sending_world(self) -> int:
        """Rank 0: how many trainer ranks send (its ``torch.distributed`` world, if
        ``senders="all"`` and it is rank 0 of that world; else 1)."""
        if self.senders != "all":
            return 1
        me, world, _ = dist_rank_world()
        if me != 0 and world > 1:
            logger.warning("weightsync-swift: ms-swift's master is torch.distributed rank %d, "
                           "not 0: it alone sends", me)
            return 1
        return world

    @classmethod
    def build_topology(cls, trainer_world_size: int, rollout_world_size: int, metadata: list):
        """ms-swift's shape (its manager computes it with the NCCL engine's classmethod)."""
        master, world = metadata[0], rollout_world_size + 1
        return ({"rank": [0] + [-1] * (trainer_world_size - 1),
                 "world_size": [world] * trainer_world_size,
                 "master_metadata": [master] * trainer_world_size},
                {"rank": list(range(1, world)), "world_size": [world] * rollout_world_size,
                 "master_metadata": [master] * rollout_world_size})

    def init_process_group(self, rank: int, world_size: int, master_metadata: Any) -> None:
        start = time.perf_counter()
        meta = self._check_call(rank, world_size, master_metadata)
        self.rank, self.world_size, self.version = rank, world_size, meta["round"]
        self._active, self.intent, self._touched = True, {}, False
        self.trainers, self.tindex = self._senders_of(rank, meta)
        self.leader = meta.get("session")
        if rank < 0 and self.tindex is None:
            return
        try:
            if rank != 0:
                self._engine("rollout" if rank > 0 else "trainer")
            self.chan = Channel(self._store(meta), f"ws-swift/{meta['session']}", meta["round"])
        except BaseException as exc:
            self._dirty = True
            raise self._failed(exc) from None
        # the join itself runs at the start of this sync's send / receive (one Ray round
        # trip less a sync: ms-swift's manager calls init, then the transfer, on everyone)
        self._join_pending = True
        self.stats["init_s"] = time.perf_counter() - start

    def _rendezvous(self, transfer: Any) -> Any:
        """This sync's join (keep or rebuild the group), then ``transfer``'s check."""
        reported, round_ = None, self.version
        if self._join_pending:
            start = time.perf_counter()
            reported = (lead_join if self.rank == 0 else follow_join)(self)
            if self.version == round_:
                self._join_pending = False
            self.stats["join_s"] = time.perf_counter() - start
            self.stats["reported"] += bool(reported)
        return transfer(self, reported)   # rank 0: the reports or None; others: taken?

    @property
    def sends(self) -> bool:
        """Whether this trainer sends in this sync (rank 0, or a rank -1 trainer behind it)."""
        return self.rank == 0 or self.tindex is not None

    async def send_weights(self, weights: Any) -> Optional[dict]:
        self._check_active("send_weights", trainer=True)
        if not self.sends:        # not in the group: walk the export (it may be collective)
            await _walk(weights)
            return None
        feed = weights if hasattr(weights, "__aiter__") else _Feed(weights)
        kind = bool(self.intent.get("adapter_only"))
        key = "adapter" if kind else "full"
        checked = None
        try:
            self.layout = self._expected_layout(key)
            t0 = time.perf_counter()
            refused = await asyncio.to_thread(self._rendezvous, lead_transfer
                                              if self.rank == 0 else follow_transfer)
            self.stats["check_s"] = time.perf_counter() - t0
            if refused is None and kind != self._last_kind:
                self.inner.reset_plan()     # another weight set: re-send every layout
                self._last_kind = kind
            if refused is None:
                checked = LayoutFeed(feed, self.layout, self.inner.config.dtype,
                                     version=self.version, who=self._trainer_name())
                t0 = time.perf_counter()
                metrics = await self.inner.send_weights(checked, version=self.version)
                self.stats["send_s"] = time.perf_counter() - t0
        except BaseException as exc:
            self._dirty = True
            if checked is not None and checked.deviated:
                self.layouts.pop(key, None)     # the next sync learns the export again
            _drain(feed)
            raise self._failed(exc) from None
        if refused is not None:   # nothing moved: the group stays as it is
            self._refused()
            _drain(feed)
            raise self._failed(refused)
        learned = checked.layout()
        if learned is not None:
            self.layouts[key] = learned
        self.stats["syncs"] += 1
        self.stats["sent_bytes"] = int((metrics or {}).get("bytes") or 0)
        return metrics

    def receive_weights(self) -> ReceiveStream:
        """This sync's ``(name, tensor)`` stream (ms-swift's call). A consumer that says
        where the tensors go before it iterates (``land_in(targets)``, as weightsync's
        replicas do) has them landed there by the backend (``receive_into``). A call that
        fails before it reads the stream tells the group as it ends (:meth:`end_receive`,
        from the mixin's wrapper), not the stream."""
        return ReceiveStream(self, self.version, open_=self._receive, abort_=lambda _: None)

    # -- a rollout's receive call, reported early ----------------------------------------
    def begin_receive(self) -> Optional[_Call]:
        """A rollout, as its ``receive_checkpoint_weights`` begins (the mixin's wrapper):
        send its report (join + check) to rank 0 now, in a thread, while the actor gets
        ready to load; this round's receive then takes that answer instead of starting the
        round trip itself. Returns the call, for :meth:`end_receive`."""
        if not self._active or not isinstance(self.rank, int) or self.rank <= 0 \
                or self.chan is None:
            return None
        call = _Call(self.version)
        with self._calls:
            if self._call is not None and not self._call.ended:
                return None       # a call of this engine still runs: no early report
            self._call = call
        check = self.intent.get("check")
        if callable(check):       # the model is looked at once the actor is ready to load
            self.intent["check"] = lambda offered: self._when_ready(call, check, offered)

        def run() -> None:
            try:
                call.report.set_result(self._rendezvous(follow_transfer))
            except BaseException as exc:
                call.report.set_exception(exc)
            with self._calls:
                self._calls.notify_all()

        threading.Thread(target=run, name="weightsync-swift-report", daemon=True).start()
        return call

    def _when_ready(self, call: _Call, check: Any, offered: list) -> Any:
        """The actor's layout check, run once its receive began (its model is then ready:
        a server may still be building an adapter while the report travels)."""
        with self._calls:
            if not self._calls.wait_for(lambda: call.taken, self.timeout):
                raise SyncTimeout(f"the receive of round {call.round} did not begin within "
                                  f"{self.timeout:.1f}s of its call", peer=self.who,
                                  phase="validate", version=call.round)
        return check(offered)

    def end_receive(self, call: Optional[_Call], error: Optional[BaseException] = None
                    ) -> None:
        """The wrapper, as the call ends (``error``: why it failed, if it did). A call whose
        receive never began (it failed before it read: its loader refused, or it returned
        without reading) tells the group first (:meth:`_tell_unread`); then a report that
        no receive took ends here (its connection dropped if it still waits), and the
        engine re-joins next time."""
        if call is None:
            return
        with self._calls:
            untaken, call.taken = not call.taken, True
            self._calls.notify_all()
        if untaken:
            if error is None:
                error = WeightSyncError("receive_checkpoint_weights ended without reading "
                                        "the weights", peer=self.who, phase="receive",
                                        version=call.round)
            refused = call.report.done() and not call.report.exception() \
                and call.report.result() is not None
            if not refused:
                self._tell_unread(call, error)
            if self._end_report(call) is not None:
                self._refused()       # refused for everybody: nothing moved, group kept
            else:
                self._dirty = True    # rank 0 may be sending to a receive that never ran
        with self._calls:
            call.ended = True
            self._calls.notify_all()

    def _tell_unread(self, call: _Call, error: BaseException) -> None:
        """This rollout's call of ``call.round`` failed before its receive began: tell
        trainer rank 0 in every box it may be waiting on this round (``hello``, ``ready``,
        ``checked``; on a connection of its own, the report's may be blocked), so that it
        ends the round for everybody now, and the inner engine's trainer ranks, in case
        rank 0 already said go and is sending (the group is re-joined next time anyway).
        Best effort: a peer already gone is not an error."""
        text = f"{type(error).__name__}: {error}"[:2000]
        chan, client = self.chan, self._client
        if chan is not None and client is not None and chan.round == call.round:
            try:
                conn = client[1].clone()
            except Exception:  # rank 0's store is gone: nobody to tell there
                logger.debug("weightsync-swift: no connection to tell rank 0", exc_info=True)
            else:
                try:
                    Channel(conn, chan.prefix, call.round).tell_all(
                        ["hello", "ready", "checked"], {"rank": self.rank, "failed": text})
                finally:
                    close_store(conn)
        if self.inner is not None and self.group is not None:
            try:
                self.inner.abort_receive(error, call.round)
            except Exception:  # the inner group may be half-built or gone
                logger.debug("weightsync-swift: could not tell the trainer ranks",
                             exc_info=True)

    def _end_report(self, call: _Call) -> Any:
        """End a report no receive took: its refusal, or None (it said go, or broke)."""
        if not call.report.done() and self._client is not None:
            self._client[1].abort()       # wakes its blocked pop; the next sync reconnects
            self._client = None
        try:
            return call.report.result(timeout=2 * self.timeout + GRACE + 1.0)
        except BaseException:  # that sync failed anyway; the next one re-joins
            logger.debug("an early report no receive took ended badly", exc_info=True)
            return None

    def _settle_call(self) -> None:
        """``prepare`` while the last round's receive call still runs on this actor (ms-swift's
        manager gives up a sync at its first failed call): end that call's report if no
        receive took it, and wait (bounded) until the call ends or moves bytes, so the new
        round's state is never the old call's. A call that ended has already marked the
        group for release if it must go (a refusal keeps it); one still moving bytes has
        not, so the group goes."""
        call = self._call
        if call is None or call.ended:
            return
        with self._calls:
            untaken = not call.taken
        if untaken and not call.report.done():
            self._end_report(call)
        bound = self.timeout + GRACE
        with self._calls:   # a call moving bytes is left to fail as the group goes
            settled = self._calls.wait_for(lambda: call.ended or call.moving, bound)
        if not settled:
            raise SyncTimeout(f"the receive_checkpoint_weights of round {call.round} is still "
                              f"running on this actor after {bound:.1f}s; this sync cannot "
                              "start beside it", peer=self.who, phase="prepare",
                              version=call.round)
        if not call.ended:
            self._dirty = True

    def _take_call(self) -> Optional[_Call]:
        """This round's call with its early report, if it started one no receive took."""
        with self._calls:
            call = self._call
            if call is None or call.taken or call.ended or call.round != self.version:
                return None
            call.taken = True
            self._calls.notify_all()
            return call

    async def _receive(self, into: Optional[dict]) -> AsyncIterator[tuple[str, Any]]:
        self._check_active("receive_weights", trainer=False)
        call = self._take_call()
        try:
            refused = await (asyncio.wrap_future(call.report) if call is not None else
                             asyncio.to_thread(self._rendezvous, follow_transfer))
        except BaseException as exc:
            self._dirty = True
            raise self._failed(exc) from None
        if refused is not None:
            self._refused()
            raise self._failed(refused)
        if call is not None:
            with self._calls:
                call.moving = True
                self._calls.notify_all()
        inner = (self.inner.receive_weights(version=self.version) if into is None
                 else self.inner.receive_into(into, version=self.version))
        self._touched = True
        try:
            async for item in inner:
                yield item
        except BaseException as exc:   # also GeneratorExit: a consumer that stopped early
            self.note_failed()
            if isinstance(exc, GeneratorExit):
                raise
            raise self._failed(exc) from None
        finally:
            await inner.aclose()
        self.has_base = self.has_base or not self.intent.get("adapter_only")
        self.stats["syncs"] += 1

    def finalize(self) -> None:
        self._active = False
        if self._dirty or not self.reuse:
            self._release()

    # -- what the actor side tells the engine ---------------------------------------------
    def expect(self, *, adapter_only: bool, error: Optional[str] = None,
               layout: Optional[list] = None, check: Any = None,
               key: Optional[str] = None) -> None:
        """This sync's kind (trainer: what it sends; rollout: what it will load) and a
        worker's own objection; trainer rank 0 checks them before any byte moves.
        Trainer rank 0: ``layout``, a metadata-only description of what it will send.
        Rollouts: ``check(offered)`` -> ``[[name, why], ...]`` or None (cannot check), and
        ``key``, what the check depends on besides the layout (kind, peft config)."""
        self.intent = {"adapter_only": bool(adapter_only), "error": error, "layout": layout,
                       "check": check, "key": key}

    def note_failed(self) -> None:
        """The rollout failed to apply this sync. Once bytes moved, a failed full sync leaves
        its base weights untrusted: an adapter-only sync then needs a full one first."""
        if not self._touched:
            return
        self._dirty = True
        if not self.intent.get("adapter_only"):
            self.has_base = False

    def name_of(self, rank: int) -> str:
        """How errors name ms-swift rollout rank ``rank`` (1..R)."""
        return self.names.get(f"rollout rank {rank - 1}", f"ms-swift rank {rank}")

    def trainer_name(self, index: int) -> str:
        """How errors name trainer ``index`` (its ``torch.distributed`` rank) of the senders."""
        return self.names.get(f"trainer rank {index}",
                              f"ms-swift rank {0 if index == 0 else -1} (trainer rank {index})")

    def _trainer_name(self) -> str:
        return f"trainer rank {self.tindex or 0}"

    def close(self) -> None:
        """Release everything (also done at interpreter exit). Idempotent."""
        self._active = False
        self._dirty = True
        self._release()
        close_store(self._rdv)
        if self._client is not None:
            close_store(self._client[1])
        self._rdv = self._client = self.chan = None
        _live.discard(self)

    # -- internals ------------------------------------------------------------------------
    def _senders_of(self, rank: int, meta: dict) -> tuple[int, Optional[int]]:
        """(trainer ranks that send, this trainer's index among them or None)."""
        trainers = meta.get("trainers", 1)
        if isinstance(trainers, bool) or not isinstance(trainers, int) or trainers < 1:
            raise TopologyError(f"master_metadata gives {trainers!r} sending trainer ranks",
                                phase="init")
        if rank > 0:
            return trainers, None
        if rank == 0:
            return trainers, 0
        if trainers == 1:
            return 1, None
        me, world, _ = dist_rank_world()
        if world != trainers or not 1 <= me < trainers:
            raise TopologyError(
                f"trainer rank 0 sends from its {trainers} torch.distributed ranks, but this "
                f"rank -1 trainer is rank {me} of {world} (a trainer outside rank 0's world: "
                "configure senders='master' on rank 0)", peer=self.who, phase="init")
        return trainers, me

    def _expected_layout(self, key: str) -> Optional[Layout]:
        """A sender: the layout to check this sync against (``described`` by the trainer
        actor, else ``recorded`` from the last complete send of this weight set); rank 0
        adds the other senders' to it before the check (:mod:`.rendezvous`)."""
        described, known = self.intent.get("layout"), self.layouts.get(key)
        layout = known
        if described is not None:
            try:
                layout = Layout.of(described, self.inner.config.dtype, "described", known)
            except (TypeError, ValueError) as exc:
                self.intent["error"] = f"{self._trainer_name()}: bad weight description: {exc}"
                layout = None
        self.stats["layout"] = layout.source if layout is not None else None
        return layout

    def _failed(self, exc: BaseException) -> BaseException:
        exc = with_names(exc, self.names)
        self.stats["last_error"] = f"{type(exc).__name__}: {exc}"
        return exc

    def _refused(self) -> None:
        self._active = False
        self.stats["refused"] += 1

    def _engine(self, role: str) -> Any:
        if self.inner is not None and self.inner.config.role != role:
            self._dirty = True
            self._release()
            self.inner = None
        if self.inner is None:
            self.inner = WsRegistry.new(self.backend, role=role, **self.options)
        return self.inner

    def _release(self) -> None:
        if self.inner is not None and (self.group is not None or self._dirty):
            self.stats["releases"] += 1
            try:
                self.inner.finalize()
            except Exception:  # releasing after a failure: the failure is what matters
                logger.debug("finalize of the weightsync engine failed", exc_info=True)
        self.group = self.members = None
        self._dirty = False

    def _check_call(self, rank: Any, world_size: Any, meta: Any) -> dict:
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 2:
            raise ValueError(f"world_size must be an int >= 2 (trainer rank 0 + rollouts), "
                             f"got {world_size!r}")
        if isinstance(rank, bool) or not isinstance(rank, int) or not -1 <= rank < world_size:
            raise ValueError(f"rank {rank!r} is outside world_size {world_size} (ms-swift: 0 = "
                             f"trainer rank 0, -1 = other trainer ranks, 1..{world_size - 1} = "
                             "rollouts)")
        if (rank == 0) != bool(self.is_master):
            raise ValueError(f"rank {rank} with is_master={self.is_master}: the master "
                             "(trainer rank 0) and only it takes rank 0")
        if not isinstance(meta, dict) or meta.get("weightsync") != PROTOCOL:
            raise TopologyError(
                f"master_metadata ({type(meta).__name__}) is not weightsync's: trainer rank 0 "
                "runs another checkpoint engine (give the trainer and the rollout actors "
                "weightsync alike: WeightsyncCheckpointMixin or install())", phase="init")
        if meta.get("backend") != self.backend:
            raise TopologyError(f"trainer rank 0 uses backend {meta.get('backend')!r}, this "
                                f"worker {self.backend!r}: configure both sides alike",
                                phase="init")
        if rank == 0 and (meta.get("session"), meta.get("round")) != (self.session, self._round):
            raise TopologyError("rank 0 got master_metadata that is not its own latest "
                                "prepare()", phase="init")
        return meta

    def _store(self, meta: dict) -> Any:
        if self.rank == 0:
            return self._rdv
        key = (meta["host"], int(meta["port"]), meta["auth"])
        if self._client is None or self._client[0] != key:
            if self._client is not None:
                close_store(self._client[1])
            self._client = None
            self._client = (key, connect_store(*key, self.timeout, peer="trainer rank 0",
                                               phase="rendezvous"))
        return self._client[1]

    def _check_active(self, what: str, *, trainer: bool) -> None:
        if not self._active or self.rank is None:
            raise RuntimeError(f"weightsync-swift: {what} needs init_process_group first")
        if trainer != (self.rank <= 0):
            raise RuntimeError(f"weightsync-swift: {what} on ms-swift rank {self.rank}")


def new_engine(backend: Optional[str] = None, **options: Any) -> WeightsyncSwiftEngine:
    """An engine for ``backend`` (else ``WEIGHTSYNC_SWIFT_BACKEND``, else ``collective``)."""
    return WeightsyncSwiftEngine(backend or env_value("SWIFT_BACKEND", str, DEFAULT_BACKEND),
                                 **options)


def _close_all() -> None:
    for engine in list(_live):
        try:
            engine.close()
        except Exception:  # exiting: best effort
            logger.debug("closing a weightsync-swift engine failed", exc_info=True)


atexit.register(_close_all)
