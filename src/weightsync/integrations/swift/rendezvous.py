"""The real topology behind ms-swift's NCCL-shaped one, and the check before each transfer.

ms-swift's manager builds its topology from trainer rank 0's ``prepare()`` alone (rollout
results are dropped): rank 0 -> trainer rank 0, -1 -> other trainer ranks, 1..R -> the
rollouts, every worker given rank 0's metadata. weightsync's metadata is the address and
token of a control store hosted by rank 0, so:

* the join (at the start of the first ``send_weights`` / ``receive_weights`` after
  ``init_process_group``): every rollout reports (``hello``: its session, current group, the
  backend's own ``prepare()``), and so does every other sending trainer rank (``thello``,
  with ``senders="all"``: ms-swift gives them all rank -1, so they are told apart by their
  ``torch.distributed`` rank); rank 0 (:func:`lead_join`) either keeps the group, when
  every worker is the same and already in it, or runs the backend's ``build_topology`` over
  all reports (every sender a trainer rank of it) and hands each worker its keywords
  (``kw/<rank>``, ``kw/t<index>``).
* at the start of ``send_weights`` / ``receive_weights``: every rollout reports what it
  expects (``ready``: full or adapter-only, whether it holds base weights from weightsync,
  its own objection such as a peft config that does not fit its model, the digest of the
  layout it last accepted for this weight set), and every other sender what it sends
  (``tready``: the kind, its own objection, its layout's digest, the layout itself when
  rank 0 has not got it); rank 0 (:func:`lead_transfer`) compares them with what it sends,
  asks the rollouts that have not accepted this sync's layout (every sender's part,
  :mod:`.layout`) to ``check`` it (names, shapes, dtypes; answered in ``checked``), and
  answers ``go`` or ``abort`` (the same text to every rollout and sender), so a bad sync
  is refused before any byte moves. Each follower's report rides on its hello; when rank
  0 keeps the group it takes them from there (one store round trip in a steady sync),
  after a rebuild it gathers them afresh.

Every wait is bounded (followers wait ``_GRACE`` longer than the leader, so the leader
reports first and can name the silent rank). Messages are JSON; boxes are fixed per leader
session and every message carries its round, stale ones are skipped.
"""

from __future__ import annotations

import json
import logging
import secrets
import time
from typing import Any, Optional

from weightsync.core.errors import (PeerFailed, PlanMismatch, SyncTimeout, TopologyError,
                                    WeightSyncError)
from weightsync.integrations.swift.layout import Layout, layout_mismatch
from weightsync.transport.base import validate_topology, worker_kwargs
from weightsync.transport.control.server import StoreTimeout

__all__ = ["Channel", "lead_join", "follow_join", "lead_transfer", "follow_transfer", "GRACE"]

logger = logging.getLogger(__name__)
GRACE = 5.0


class Channel:
    """JSON messages through queues of the leader's control store, every pop bounded."""

    def __init__(self, client: Any, prefix: str, round_: int) -> None:
        self.client, self.prefix, self.round = client, prefix, round_

    def push(self, box: str, obj: dict) -> None:
        data = json.dumps(dict(obj, round=self.round)).encode()
        try:
            self.client.queue_push(f"{self.prefix}/{box}", data)
        except ConnectionError as exc:
            raise PeerFailed(f"lost the rendezvous store ({exc})", peer="trainer rank 0",
                             phase="rendezvous") from None

    def pop(self, box: str, timeout: float, *, waiting_for: str, peer: str) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            try:
                raw = self.client.queue_pop(f"{self.prefix}/{box}", max(left, 0.01))
            except StoreTimeout:
                raise SyncTimeout(f"{waiting_for} did not arrive within {timeout:.1f}s",
                                  peer=peer, phase="rendezvous", version=self.round) from None
            except ConnectionError as exc:
                raise PeerFailed(f"lost the rendezvous store while waiting for {waiting_for} "
                                 f"({exc})", peer="trainer rank 0", phase="rendezvous") from None
            msg = json.loads(raw)
            if not isinstance(msg, dict):
                raise TopologyError(f"malformed rendezvous message {msg!r}", peer=peer,
                                    phase="rendezvous")
            if msg.get("round") == self.round:
                return msg

    def tell_all(self, boxes: list[str], obj: dict) -> None:
        for box in boxes:
            try:
                self.push(box, obj)
            except WeightSyncError:  # best effort: the store is going away anyway
                logger.debug("could not tell %s", box, exc_info=True)


def _gather(engine: Any, box: str, what: str, ranks: Optional[list[int]] = None, *,
            trainers: bool = False) -> dict[int, dict]:
    """Leader: one message from each rollout rank of ``ranks`` (default 1..n), or from
    each of the other sending trainers (``trainers``: indices 1..A-1), bounded by the
    engine's timeout."""
    if ranks is None:
        ranks = list(range(1, engine.trainers)) if trainers else \
            list(range(1, engine.world_size))
    name = engine.trainer_name if trainers else engine.name_of
    got: dict[int, dict] = {}
    deadline = time.monotonic() + engine.timeout
    while len(got) < len(ranks):
        missing = [r for r in ranks if r not in got]
        try:
            msg = engine.chan.pop(box, deadline - time.monotonic(), waiting_for=what,
                                  peer=name(missing[0]))
        except SyncTimeout as exc:
            names = ", ".join(name(r) for r in missing)
            raise SyncTimeout(f"{exc.detail}: nothing from {names}", peer=exc.peer,
                              phase=exc.phase, version=engine.version) from None
        rank = msg.get("rank")
        if "failed" in msg and not trainers and isinstance(rank, int) \
                and not isinstance(rank, bool):
            # a rollout whose call failed before its receive began: the round ends now
            raise PeerFailed(f"{engine.name_of(rank)} failed before it received: "
                             f"{msg['failed']}", peer=f"rollout rank {rank - 1}",
                             phase="rendezvous", version=engine.version,
                             origin=f"rollout rank {rank - 1}")
        if isinstance(rank, bool) or not isinstance(rank, int) or rank not in ranks \
                or rank in got:
            raise TopologyError(f"rank {rank!r} reported twice or outside {ranks}",
                                phase="rendezvous", version=engine.version)
        got[rank] = msg
    return got


def _sender_boxes(engine: Any, prefix: str) -> list[str]:
    return [f"{prefix}/t{i}" for i in range(1, engine.trainers)]


def _reports(hellos: dict[int, dict], others: dict[int, dict]) -> Optional[tuple]:
    """A kept group: the ``ready`` / ``tready`` reports the hellos carried (each of its
    sender's rank), or None when one is missing (the followers then send them again)."""
    ready = {r: h.get("report") for r, h in hellos.items()}
    senders = {i: h.get("report") for i, h in others.items()}
    for got in (ready, senders):
        if any(not isinstance(m, dict) or m.get("rank") != k for k, m in got.items()):
            return None
    return ready, senders


def lead_join(engine: Any) -> Optional[tuple]:
    """Rank 0 at the start of a sync's send: keep the group or build a new one. A kept
    group returns the followers' reports for :func:`lead_transfer` (they came with the
    hellos: one store round trip a sync instead of two); a new one returns None."""
    n, a = engine.world_size - 1, engine.trainers
    boxes = [f"kw/{r}" for r in range(1, n + 1)] + _sender_boxes(engine, "kw")
    inner = engine.inner
    try:
        hellos = _gather(engine, "hello", f"init_process_group of {n} rollout(s)")
        others = _gather(engine, "thello", f"init_process_group of {a - 1} other trainer "
                         "rank(s)", trainers=True) if a > 1 else {}
        engine.names = {f"rollout rank {r - 1}": f"ms-swift rank {r} ({h.get('who')})"
                        for r, h in hellos.items()}
        engine.names.update({f"trainer rank {i}": f"ms-swift rank -1 (trainer rank {i}, "
                             f"{h.get('who')})" for i, h in others.items()})
        members = [engine.session] + [others[i].get("session") for i in range(1, a)] + \
            [hellos[r].get("session") for r in range(1, n + 1)]
        if engine.reuse and engine.group is not None and members == engine.members and \
                all(h.get("group") == engine.group
                    for h in list(hellos.values()) + list(others.values())):
            reported = _reports(hellos, others)
            engine.chan.tell_all(boxes, {"reuse": engine.group, "who": engine.who,
                                         "took_report": reported is not None})
            engine.stats["reuses"] += 1
            return reported
        metas = [inner.prepare()] + [others[i].get("meta") for i in range(1, a)] + \
            [hellos[r].get("meta") for r in range(1, n + 1)]
        tk, rk = type(inner).build_topology(a, n, metas)
        validate_topology(engine.backend, "trainer", tk, a)
        validate_topology(engine.backend, "rollout", rk, n)
    except BaseException as exc:
        engine.chan.tell_all(boxes, {"abort": f"trainer rank 0: {exc}"})
        raise
    group = str((tk.get("token") or [None])[0] or secrets.token_hex(16))
    for r in range(1, n + 1):
        engine.chan.push(f"kw/{r}", {"join": group, "kw": worker_kwargs(rk, r - 1),
                                     "who": engine.who})
    for i in range(1, a):
        engine.chan.push(f"kw/t{i}", {"join": group, "kw": worker_kwargs(tk, i),
                                      "who": engine.who})
    engine.group = None
    inner.init_process_group(**worker_kwargs(tk, 0))
    engine.group, engine.members = group, members
    engine.stats["joins"] += 1


def follow_join(engine: Any) -> bool:
    """A rollout, or a rank -1 sender, at the start of its receive / send: say hello (with
    this sync's report for :func:`follow_transfer`), then join or keep what rank 0 says.
    True when rank 0 kept the group and took the report."""
    inner, chan = engine.inner, engine.chan    # this round's channel, whatever comes next
    sender = engine.rank < 0
    me = engine.tindex if sender else engine.rank
    chan.push("thello" if sender else "hello",
                     {"rank": me, "session": engine.session, "group": engine.group,
                      "meta": inner.prepare(), "who": engine.who,
                      "report": _sender_report(engine) if sender else _ready_report(engine)})
    reply = chan.pop(f"kw/t{me}" if sender else f"kw/{me}", engine.timeout + GRACE,
                     peer="trainer rank 0", waiting_for="the topology from trainer rank 0")
    if "abort" in reply:
        raise PeerFailed(str(reply["abort"]), peer="trainer rank 0", phase="init")
    engine.names = {"trainer rank 0": f"ms-swift rank 0 ({reply.get('who')})"}
    if "join" in reply:
        engine.group = None
        inner.init_process_group(**reply["kw"])
        engine.group = str(reply["join"])
        engine.stats["joins"] += 1
        return False
    elif reply.get("reuse") == engine.group and engine.group is not None:
        engine.stats["reuses"] += 1
        return bool(reply.get("took_report"))
    else:
        raise TopologyError(f"trainer rank 0 kept group {reply.get('reuse')!r}, this worker "
                            f"is in {engine.group!r}", peer="trainer rank 0", phase="init")


def _kind(adapter_only: Any) -> str:
    return "adapter-only" if adapter_only else "full"


def _problems(engine: Any, ready: dict[int, dict]) -> list[str]:
    mine, out = engine.intent.get("adapter_only"), []
    for r, msg in sorted(ready.items()):
        who = engine.name_of(r)
        theirs = msg.get("adapter_only")
        if msg.get("error"):
            out.append(f"{who}: {msg['error']}")
        if mine is not None and theirs is not None and bool(mine) != bool(theirs):
            out.append(f"{who} expects {_kind(theirs)} weights, trainer rank 0 sends {_kind(mine)}")
        if (mine or theirs) and not msg.get("has_base"):
            out.append(f"{who}: adapter-only sync before any base sync reached it (it holds no "
                       "base weights from weightsync); sync full weights first (ms-swift: "
                       "manager.base_sync_done = False)")
    return out


def _sender_problems(engine: Any, ready: dict[int, dict]) -> list[str]:
    mine, out = engine.intent.get("adapter_only"), []
    for i, msg in sorted(ready.items()):
        who = engine.trainer_name(i)
        if msg.get("error"):
            out.append(f"{who}: {msg['error']}")
        if bool(msg.get("adapter_only")) != bool(mine):
            out.append(f"{who} sends {_kind(msg.get('adapter_only'))} weights, trainer rank 0 "
                       f"sends {_kind(mine)}")
    return out


def _sync_layout(engine: Any, ready: dict[int, dict]) -> Optional[Layout]:
    """Leader: the layout of this sync over every sender (None: some sender's is not
    known, the first pass of a weight set; the rollouts check what arrives)."""
    if engine.layout is None:
        return None
    parts = [engine.layout]
    for i, msg in sorted(ready.items()):
        slot = (i, msg.get("key"))
        if msg.get("entries") is not None:
            engine.peer_layouts[slot] = Layout(msg["entries"], str(msg.get("source")))
        known = engine.peer_layouts.get(slot)
        if msg.get("digest") is None or known is None or known.digest != msg["digest"]:
            return None
        parts.append(known)
    return Layout.union(parts)


def _check_layout(engine: Any, ready: dict[int, dict],
                  layout: Layout) -> Optional[PlanMismatch]:
    """Leader: the rollouts that have not accepted this sync's layout check it now."""
    need = [r for r, msg in sorted(ready.items()) if msg.get("accepted") != layout.digest]
    if not need:
        return None
    ask = {"check": layout.entries, "digest": layout.digest, "source": layout.source}
    for r in need:
        engine.chan.push(f"go/{r}", ask)
    checked = _gather(engine, "checked", f"the layout check of {len(need)} rollout(s)", need)
    bad = {engine.name_of(r): msg["problems"] for r, msg in sorted(checked.items())
           if msg.get("problems")}
    errors = [f"{engine.name_of(r)}: checking the layout failed: {msg['error']}"
              for r, msg in sorted(checked.items()) if msg.get("error")]
    if errors:
        return PlanMismatch("; ".join(errors), phase="validate", version=engine.version)
    if bad:
        kind = _kind(engine.intent.get("adapter_only"))
        return layout_mismatch(bad, kind, engine.version)
    return None


def lead_transfer(engine: Any, reported: Optional[tuple] = None) -> Optional[PlanMismatch]:
    """Rank 0 before sending: the refusal (nothing moved) or ``None`` to go ahead.
    ``reported``: the followers' reports, taken from their hellos (else gathered now)."""
    boxes = [f"go/{r}" for r in range(1, engine.world_size)] + _sender_boxes(engine, "go")
    try:
        if reported is not None:
            ready, senders = reported
        else:
            ready = _gather(engine, "ready", "receive_checkpoint_weights of every rollout")
            senders = _gather(engine, "tready", "send_checkpoint_weights of every other "
                              "trainer rank", trainers=True) if engine.trainers > 1 else {}
        problems = _sender_problems(engine, senders) + _problems(engine, ready)
        if engine.intent.get("error"):
            problems.insert(0, str(engine.intent["error"]))
        layout = None
        try:
            layout = _sync_layout(engine, senders)
        except ValueError as exc:
            problems.append(str(exc))
        refused = PlanMismatch("; ".join(problems), phase="validate",
                               version=engine.version) if problems else None
        if refused is None and layout is not None:
            refused = _check_layout(engine, ready, layout)
    except BaseException as exc:
        engine.chan.tell_all(boxes, {"abort": f"trainer rank 0: {exc}", "failed": True})
        raise
    if refused is not None:
        engine.chan.tell_all(boxes, {"abort": refused.detail})
        return refused
    engine.chan.tell_all(boxes, {"go": True})
    return None


def _run_check(engine: Any, ask: dict) -> dict:
    """A rollout: check rank 0's layout with the actor's check (``expect(check=...)``)."""
    check, key = engine.intent.get("check"), engine.intent.get("key")
    out: dict = {"rank": engine.rank, "problems": None, "error": None}
    if not callable(check):
        return out
    engine.stats["checks"] += 1
    try:
        problems = check(ask["check"])
    except Exception as exc:  # a failing check refuses the sync, it does not crash it
        out["error"] = f"{type(exc).__name__}: {exc}"[:2000]
        return out
    out["problems"] = [[str(p[0]), str(p[1])] for p in problems] if problems else None
    if not problems and key is not None:
        engine.accepted[key] = ask["digest"]
    return out


def _told(engine: Any) -> tuple:
    layout = engine.layout
    key = "adapter" if engine.intent.get("adapter_only") else "full"
    return engine.leader, key, layout.digest if layout is not None else None


def _sender_report(engine: Any) -> dict:
    """A rank -1 sender's ``tready``: the kind, its objection, its layout's digest (and the
    layout itself when rank 0 has not got it)."""
    layout, told = engine.layout, _told(engine)
    return {"rank": engine.tindex, "adapter_only": engine.intent.get("adapter_only"),
            "error": engine.intent.get("error"), "key": told[1], "digest": told[2],
            "source": layout.source if layout is not None else None,
            "entries": layout.entries if layout is not None and told not in engine.told
            else None}


def _ready_report(engine: Any) -> dict:
    """A rollout's ``ready``: what it expects, whether it holds base weights, its
    objection, the digest of the layout it last accepted for this weight set."""
    key = engine.intent.get("key")
    return {"rank": engine.rank, "has_base": engine.has_base,
            "adapter_only": engine.intent.get("adapter_only"),
            "error": engine.intent.get("error"),
            "accepted": engine.accepted.get(key) if key else None}


def _follow_as_sender(engine: Any, chan: Channel, reported: bool) -> dict:
    """A rank -1 sender before sending: report what it sends (unless its hello did), wait
    for rank 0's answer."""
    if not reported:
        chan.push("tready", _sender_report(engine))
    if engine.layout is not None:   # rank 0 has this layout now
        if len(engine.told) > 16:   # bounded; forgetting only costs resending a layout
            engine.told.clear()
        engine.told.add(_told(engine))
    return chan.pop(f"go/t{engine.tindex}", 2 * engine.timeout + GRACE,
                    peer="trainer rank 0", waiting_for="trainer rank 0's go")


def follow_transfer(engine: Any, reported: bool = False) -> Optional[PlanMismatch]:
    """A rollout before receiving (or a rank -1 sender before sending): report (unless its
    hello did, ``reported``), check rank 0's layout if asked, wait for its answer."""
    chan = engine.chan      # this round's channel, whatever comes next
    if engine.rank < 0:
        return _answer(engine, _follow_as_sender(engine, chan, reported))
    if not reported:
        chan.push("ready", _ready_report(engine))
    while True:     # rank 0 may gather every ready, then every check: twice its timeout
        reply = chan.pop(f"go/{engine.rank}", 2 * engine.timeout + GRACE,
                         peer="trainer rank 0", waiting_for="trainer rank 0's go")
        if "check" not in reply:
            break
        chan.push("checked", _run_check(engine, reply))
    return _answer(engine, reply)


def _answer(engine: Any, reply: dict) -> Optional[PlanMismatch]:
    if reply.get("failed"):     # not a refusal: the sync broke (e.g. another rollout is gone)
        raise PeerFailed(str(reply["abort"]), peer="trainer rank 0", phase="validate",
                         version=engine.version)
    if "abort" in reply:
        return PlanMismatch(str(reply["abort"]), peer="trainer rank 0", phase="validate",
                            version=engine.version)
    return None
