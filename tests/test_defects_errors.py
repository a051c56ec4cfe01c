"""Issue 14, items 7 and 8: where a failure started, and failures that keep their type.

7: an error a receiver raises about the control server (which lives in the trainer's
process) or about its own consumer must point at the right party, so that ``blame`` never
isolates a healthy replica for a slow store, and does isolate one whose consumer stalled.
8: draining a failed send's export runs it to its end even while the timed-out send is
still inside it; ``collective`` keeps each failure's type and cause; a timed-out Ray call
is cancelled.
"""

import threading
import time

import pytest

from weightsync.core.errors import PeerFailed, SyncTimeout, WeightSyncError, WireError
from weightsync.core.remote import error_msg, failure_origin, raise_remote
from weightsync.core.wire import AckMsg, BucketMsg
from weightsync.orchestration import calls as calls_mod
from weightsync.orchestration.calls import Call, Outcome, call_all
from weightsync.orchestration.isolation import blame


def _relayed(exc, rank=0):
    """What the trainer raises after rollout rank ``rank`` reported ``exc``."""
    msg = error_msg(exc, seq=1, version=3, peer=f"rollout rank {rank}", phase="receive")
    try:
        raise_remote(msg, phase="send")
    except PeerFailed as relayed:
        return relayed


# -- item 7 ---------------------------------------------------------------------------------
class _StuckInbox:
    host = "trainer rank 0"

    def push(self, box, msg):
        time.sleep(30)


@pytest.mark.timeout(60)
def test_slow_control_server_does_not_isolate_a_healthy_replica():
    from weightsync.transport.backends.cuda_ipc.engine import _AckPusher
    pusher = _AckPusher(_StuckInbox(), "weightsync-test-acks", 0.3)
    pusher.push("t", AckMsg(seq=1, stream=0, rank=0, index=0))
    with pytest.raises(SyncTimeout) as info:
        pusher.flush(0.3)
    exc = info.value
    assert failure_origin(exc) == "trainer rank 0", exc
    verdict = blame([Outcome("trainer rank 0", False, error=_relayed(exc))],
                    [Outcome("replica-0", False, error=exc)], {0: "replica-0"})
    assert not verdict.culprits, verdict
    assert verdict.trainer_fault is not None


@pytest.mark.timeout(60)
def test_a_replica_whose_consumer_stalls_is_its_own_culprit():
    from weightsync.transport.backends.collective import CollectiveEngine
    eng = CollectiveEngine(role="rollout", timeout=0.3, bucket_size=1024)
    eng._rank = 0
    eng._free[(0, 0)] = threading.Event()            # the consumer never releases slot 0
    msg = BucketMsg(version=3, seq=1, stream=0, index=0, slot=0, nbytes=8, layout="x")
    with pytest.raises(SyncTimeout) as info:
        eng._rx_fetch(0, msg)
    exc = info.value
    verdict = blame([Outcome("trainer rank 0", False, error=_relayed(exc))],
                    [Outcome("replica-0", False, error=exc)], {0: "replica-0"})
    assert "replica-0" in verdict.culprits and verdict.trainer_fault is None, verdict
    assert not verdict.relays, verdict
    # its own word suffices (before: peer="consumer" read as a relay, innocent, and only
    # the trainer's naming of rollout rank 0 got it isolated)
    alone = blame([], [Outcome("replica-0", False, error=exc)], {0: "replica-0"})
    assert "replica-0" in alone.culprits and not alone.relays, alone


# -- item 8 ---------------------------------------------------------------------------------
@pytest.mark.timeout(60)
def test_drain_runs_the_export_to_its_end_while_the_send_is_still_in_it():
    from weightsync.integrations.ray.mixins import _drain
    produced = []

    def export():
        for i in range(5):
            time.sleep(0.2)          # a collective of the export, say
            produced.append(i)
            yield f"w{i}", i
    items = export()
    t = threading.Thread(target=lambda: next(items))   # the timed-out send, still in it
    t.start()
    time.sleep(0.05)
    _drain(items)
    t.join(5)
    assert produced == [0, 1, 2, 3, 4], produced


@pytest.mark.parametrize("answer,expected", [
    (ConnectionError("store gone"), PeerFailed),
    (b"not json", WireError),
])
def test_collective_link_address_failure_keeps_its_kind(answer, expected):
    from weightsync.transport.backends.collective import CollectiveEngine
    eng = CollectiveEngine(role="rollout", timeout=0.3, bucket_size=1024)

    class _Client:
        def get(self, key, timeout):
            if isinstance(answer, BaseException):
                raise answer
            return answer
    eng._clients = [_Client()]
    eng._token = "t" * 32
    with pytest.raises(WeightSyncError) as info:
        eng._open_link(0, 0.3)
    assert type(info.value) is expected, info.value
    assert info.value.__cause__ is not None        # the cause is kept
    assert info.value.peer == "trainer rank 0"


class ActorHandle:      # looks like a Ray actor handle to ``is_ray_handle``
    __module__ = "ray.fake"

    def __init__(self):
        self.hang = self

    def remote(self, *a, **k):
        return "ref-1"


def test_timed_out_ray_call_is_cancelled(monkeypatch):
    import ray
    cancelled = []
    monkeypatch.setattr(ray, "wait", lambda refs, num_returns=1, timeout=None:
                        (time.sleep(min(timeout or 0, 0.05)), ([], refs))[1])
    monkeypatch.setattr(ray, "cancel", lambda ref, **kw: cancelled.append(ref))
    out = call_all([Call("replica-0", ActorHandle(), "hang")], timeout=0.2, phase="receive")
    assert isinstance(out[0].error, SyncTimeout)
    assert cancelled == ["ref-1"], cancelled
    assert calls_mod is not None
