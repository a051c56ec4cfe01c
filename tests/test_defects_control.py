"""Closing the control server fails its peers at once: every blocked wait wakes, every
client connection is closed; an inbox that loses its store reports ``PeerFailed`` naming
the host, the phase and the version."""

import threading
import time

import pytest

from weightsync.core.errors import PeerFailed
from weightsync.transport.control.server import ControlClient, ControlServer
from weightsync.transport.control.store import Inbox

TOKEN = b"defects-control-token"
TIMEOUT = 30.0


def _blocked(call):
    """Run ``call`` in a thread; returns (thread, outcome dict with 'exc' and 'after')."""
    out = {}

    def run():
        start = time.monotonic()
        try:
            out["value"] = call()
        except BaseException as exc:  # inspected by the test
            out["exc"] = exc
        out["after"] = time.monotonic() - start
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("op", ["pop", "get", "wait"])
def test_close_wakes_every_blocked_client(op):
    srv = ControlServer("127.0.0.1", TOKEN)
    c = ControlClient("127.0.0.1", srv.port, TOKEN, TIMEOUT)
    call = {"pop": lambda: c.queue_pop("q", TIMEOUT), "get": lambda: c.get("k", TIMEOUT),
            "wait": lambda: c.wait(["k"], TIMEOUT)}[op]
    t, out = _blocked(call)
    time.sleep(0.3)  # the request is in the server's wait by now
    srv.close()
    t.join(TIMEOUT + 15)
    assert "after" in out, "the blocked call never returned"
    assert isinstance(out.get("exc"), ConnectionError), out
    assert out["after"] < TIMEOUT / 5, out


@pytest.mark.timeout(60)
def test_close_closes_idle_client_connections():
    srv = ControlServer("127.0.0.1", TOKEN)
    c = ControlClient("127.0.0.1", srv.port, TOKEN, TIMEOUT)
    c.set("k", b"v")
    srv.close()
    start = time.monotonic()
    with pytest.raises(ConnectionError):
        c.get("k", TIMEOUT)   # served before: the connection outlived the server
    assert time.monotonic() - start < TIMEOUT / 5


@pytest.mark.timeout(120)
def test_inbox_pop_of_a_closed_store_is_peer_failed_at_once():
    srv = ControlServer("127.0.0.1", TOKEN)
    store = ControlClient("127.0.0.1", srv.port, TOKEN, TIMEOUT, server=srv)
    inbox = Inbox(store, "ws/x/s0", "r0", TIMEOUT, host="trainer rank 0")
    t, out = _blocked(lambda: inbox.pop(timeout=TIMEOUT, peer="trainer rank 0",
                                        phase="receive", version=7))
    time.sleep(0.3)
    srv.close()
    t.join(TIMEOUT + 15)
    exc = out.get("exc")
    assert isinstance(exc, PeerFailed), out
    assert exc.peer == "trainer rank 0" and exc.phase == "receive" and exc.version == 7, exc
    assert out["after"] < TIMEOUT / 5, out
    inbox.close()
    store.close()


def test_inbox_pop_names_its_host_not_the_expected_sender():
    """The store's host is who went away (a sender waiting for a receiver's ack names the
    rank it waits for as ``peer``, but a lost store is the hosting trainer's failure)."""
    srv = ControlServer("127.0.0.1", TOKEN)
    store = ControlClient("127.0.0.1", srv.port, TOKEN, TIMEOUT, server=srv)
    inbox = Inbox(store, "ws/x/s0", "t", TIMEOUT, host="trainer rank 3")
    srv.close()
    with pytest.raises(PeerFailed) as info:
        inbox.pop(timeout=TIMEOUT, peer="rollout rank 1", phase="send", version="v2")
    assert info.value.peer == "trainer rank 3"
    assert info.value.phase == "send" and info.value.version == "v2"
    inbox.close()
    store.close()


def _two_ranks():
    """Trainer rank 0's ownership store and the two ranks' ``Ownership`` over it."""
    from weightsync.transport.control.store import connect_store, host_store
    from weightsync.transport.protocol.ownership import Ownership

    token = "t" * 32
    host = host_store("127.0.0.1", 10, token)
    client = connect_store("127.0.0.1", host.port, token, 10, peer="trainer rank 0",
                           phase="init")
    return host, client, Ownership(host, "ws/x", 0, 2, 10), Ownership(client, "ws/x", 1, 2, 10)


@pytest.mark.timeout(60)
def test_trainer_rank_0_leaving_lets_the_others_finish_reading_its_store():
    """Trainer rank 0 hosts the ownership store. Its end-of-sync agreement returns once
    every rank posted its names; a rank a little behind still reads them. Rank 0's
    teardown waits for that (bounded) before closing the store (CI caught
    test_two_trainers[disjoint-shm] with trainer rank 1 losing the store mid-read)."""
    from weightsync.transport.control.store import close_store

    host, client, o0, o1 = _two_ranks()
    slow = o1._store.get

    def behind(*args, **kwargs):
        time.sleep(0.3)
        return slow(*args, **kwargs)
    o1._store.get = behind
    errors = []

    def rank1():
        try:
            o1.agree(1, ["a", "b"])
        except Exception as exc:  # inspected below
            errors.append(exc)
    t = threading.Thread(target=rank1)
    t.start()
    o0.agree(1, ["a", "b"])
    start = time.monotonic()
    o0.drain(5.0)                  # what rank 0's teardown does before closing the store
    took = time.monotonic() - start
    o0.close()
    close_store(host)
    t.join(10)
    client.close()
    assert not errors, errors
    assert took < 5.0, took        # it waited for rank 1's reads, not for its bound


@pytest.mark.timeout(60)
def test_rank_0_does_not_wait_at_teardown_for_a_rank_that_posted_its_failure():
    """A sync in which trainer rank 1 failed: it posts its failure in place of its names
    and reads nothing more, so rank 0's teardown has no reader to wait for. CI caught
    test_rollout_process_killed_mid_sync[collective] with rank 0's rebuild ``ws_prepare``
    spending the whole drain bound (the engine timeout) here, past prepare's own bound."""
    from weightsync.core.errors import PeerFailed
    from weightsync.core.wire import ErrorMsg
    from weightsync.transport.control.store import close_store

    host, client, o0, o1 = _two_ranks()
    t = threading.Thread(target=o1.agree, args=(1, ["a", "b"]))
    t.start()
    o0.agree(1, ["a", "b"])                              # sync 1: both agree
    t.join(10)
    o1.fail(2, ErrorMsg(version="2", seq=2, error="PeerFailed", message="replica-2 died",
                        peer="replica-2", phase="broadcast"))
    with pytest.raises(PeerFailed, match="replica-2 died"):
        o0.agree(2, ["a", "b"])                          # sync 2: rank 1's failure
    start = time.monotonic()
    o0.drain(5.0)
    took = time.monotonic() - start
    o0.close()
    o1.close()
    close_store(host)
    client.close()
    assert took < 2.5, took       # nobody reads sync 2's agreement: no wait for the bound


def _hub_and_links(family: str):
    """A trainer's LinkHub and two receivers' Links to it, over TCP or a Unix socket."""
    import socket

    from weightsync.transport.control.links import Link, LinkHub, unix_address

    token = "l" * 32
    if family == "tcp":
        fam, where = socket.AF_INET, ("127.0.0.1", 0)
    else:
        fam, where = socket.AF_UNIX, unix_address(f"{time.monotonic_ns()}{token}", 0)
    hub = LinkHub(fam, where, token, 10.0)
    links = [Link(fam, hub.address, token, r, 10.0, peer="trainer rank 0") for r in (0, 1)]
    hub.accept(2, time.monotonic() + 10.0)
    return hub, links


@pytest.mark.timeout(60)
@pytest.mark.parametrize("family", ["tcp", "unix"])
def test_a_receiver_that_reported_and_left_is_not_a_failed_push(family):
    """A receiver reads only what it needs, reports and may close its link while the
    trainer still names blocks for the others (its last sync): a ``gone_ok`` push skips
    it, a plain one still fails naming it, and the trainer still reads its report. One
    that left without a report is the trainer's ``PeerFailed`` at the next ``pop``."""
    from weightsync.core.wire import PulledMsg, StagedMsg

    hub, (a, b) = _hub_and_links(family)
    try:
        staged = StagedMsg(seq=3, stream=0, blocks=("b0",))
        hub.push_many(["r0", "r1"], staged)      # b never reads it: it closes with it unread
        b.push("t", PulledMsg(seq=3, stream=0, rank=1, nbytes=8, plan="p"))
        b.close()
        time.sleep(0.3)                          # its close (a reset, over TCP) is here
        with pytest.raises(PeerFailed) as info:
            for _ in range(3):                   # TCP may take one write before it tells
                hub.push("r1", staged)
        assert info.value.peer == "rollout rank 1" and info.value.phase == "send"
        hub.push_many(["r0", "r1"], staged, gone_ok=True)
        for _ in range(2):
            assert a.pop(timeout=5, peer="trainer rank 0", phase="receive") == staged
        hub.expect({1})
        got = hub.pop(timeout=5, peer="rollout rank 1", phase="send")
        assert isinstance(got, PulledMsg) and got.rank == 1
        hub.expect({0})          # rank 1 is done: its closed link is dropped quietly
        a.close()                # rank 0 leaves without its report
        time.sleep(0.3)
        hub.push_many(["r0", "r1"], staged, gone_ok=True)
        with pytest.raises(PeerFailed) as info:
            hub.pop(timeout=5, peer="rollout rank 0", phase="send", version=3)
        assert info.value.peer == "rollout rank 0" and info.value.version == 3
    finally:
        hub.close()
        for link in (a, b):
            link.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("family", ["tcp", "unix"])
def test_a_push_to_a_receiver_that_reported_its_failure_and_left_raises_that_report(family):
    """A rollout that fails before it reads (``abort_receive``) reports and closes its
    link; the trainer, still pushing to it, raises that report (its peer, its text), not
    "lost the control link"; a report of another kind read off the closed link is still
    returned by the next ``pop``."""
    from weightsync.core.wire import ErrorMsg, PulledMsg, StagedMsg

    hub, (a, b) = _hub_and_links(family)
    try:
        staged = StagedMsg(seq=3, stream=0, blocks=("b0",))
        b.push("t", ErrorMsg(version=3, seq=3, error="PeerFailed", message="the loader refuses",
                             peer="rollout rank 1", phase="receive"))
        b.close()
        time.sleep(0.3)
        with pytest.raises(PeerFailed) as info:
            for _ in range(3):                   # TCP may take one write before it tells
                hub.push("r1", staged)
        err = info.value
        assert "the loader refuses" in str(err) and err.origin == "rollout rank 1", err
        a.push("t", PulledMsg(seq=3, stream=0, rank=0, nbytes=8, plan="p"))
        a.close()
        time.sleep(0.3)
        with pytest.raises(PeerFailed, match="lost the control link"):
            for _ in range(3):
                hub.push("r0", staged)
        got = hub.pop(timeout=5, peer="rollout rank 0", phase="send")
        assert isinstance(got, PulledMsg) and got.rank == 0
    finally:
        hub.close()
        for link in (a, b):
            link.close()
