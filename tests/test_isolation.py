"""The evidence rules of failure isolation (``weightsync.orchestration.isolation.blame``), on the error
chains that the engines produce, including failures passed on from peer to peer."""

import pickle

from weightsync.orchestration.calls import Outcome
from weightsync.orchestration.isolation import blame
from weightsync.transport.protocol.sender import error_msg, raise_remote
from weightsync.core.errors import PeerFailed, PlanMismatch, SyncTimeout, WeightSyncError

OWNERS = {0: "replica-0", 1: "replica-1", 2: "replica-2"}


def _fail(label, exc):
    return Outcome(label, False, error=exc)


def _ok(label):
    return Outcome(label, True, value={})


def _relay(exc, sender, phase):
    """What the next peer raises once ``sender`` reported ``exc`` over the wire."""
    try:
        raise_remote(error_msg(exc, seq=1, version=2, peer=sender, phase=phase), phase=phase)
    except PeerFailed as relayed:
        return relayed


def test_a_dead_rollout_rank_relayed_twice_blames_only_its_replica():
    # rollout rank 2 dies; trainer rank 0 sees its link go and tells rollout rank 1, which
    # stops and tells trainer rank 1 (the chain that once got replica-1 isolated too)
    seen = PeerFailed("lost the control link to rollout rank 2", peer="rollout rank 2",
                      phase="send", version=2)
    at_r1 = _relay(seen, "trainer rank 0", "receive")
    at_t1 = _relay(at_r1, "rollout rank 1", "send")
    assert at_r1.peer == "trainer rank 0" and at_r1.origin == "rollout rank 2"
    assert at_t1.peer == "rollout rank 1" and at_t1.origin == "rollout rank 2"
    died = PeerFailed("replica-2 died or became unreachable", peer="replica-2")
    v = blame([_fail("trainer rank 0", seen), _fail("trainer rank 1", at_t1)],
              [_fail("replica-0", at_r1), _fail("replica-1", at_r1), _fail("replica-2", died)],
              OWNERS)
    assert list(v.culprits) == ["replica-2"] and v.trainer_fault is None
    assert "died" in v.culprits["replica-2"]   # its own failure, not a peer's account of it
    assert v.relays == []  # the others are innocent: re-run, not isolated


def test_origin_survives_pickling_as_ray_reraises_it():
    err = PeerFailed("x", peer="trainer rank 0", phase="receive", version=3,
                     origin="rollout rank 2")
    back = pickle.loads(pickle.dumps(err))
    assert (back.peer, back.origin, back.version) == ("trainer rank 0", "rollout rank 2", 3)
    assert "origin=rollout rank 2" in str(back)


def test_a_dead_trainer_relayed_by_a_replica_is_a_trainer_fault():
    lost = PeerFailed("lost the control link to trainer rank 0", peer="trainer rank 0")
    at_t1 = _relay(lost, "rollout rank 1", "receive")
    died = PeerFailed("trainer rank 0 died", peer="trainer rank 0")
    v = blame([_fail("trainer rank 0", died), _fail("trainer rank 1", at_t1)],
              [_fail("replica-0", lost), _fail("replica-1", lost)], OWNERS)
    assert v.trainer_fault is not None and not v.culprits


def test_a_replica_that_rejects_the_plan_is_the_culprit_everywhere():
    own = PlanMismatch("the model has no tensor named 'x'", peer="trainer rank 0")
    at_t0 = _relay(own, "rollout rank 1", "receive")
    at_r0 = _relay(at_t0, "trainer rank 0", "send")
    assert at_t0.origin == "rollout rank 1" and at_r0.origin == "rollout rank 1"
    v = blame([_fail("trainer rank 0", at_t0)],
              [_fail("replica-0", at_r0), _fail("replica-1", own), _ok("replica-2")], OWNERS)
    assert list(v.culprits) == ["replica-1"] and v.trainer_fault is None


def test_a_trainers_own_error_is_never_pinned_on_a_replica():
    own = ValueError("the user's iterator failed")
    at_r0 = _relay(own, "trainer rank 0", "receive")
    at_t1 = _relay(at_r0, "rollout rank 0", "send")
    assert at_r0.origin == "trainer rank 0" and at_t1.origin == "trainer rank 0"
    v = blame([_fail("trainer rank 0", WeightSyncError("own", peer=None)),
               _fail("trainer rank 1", at_t1)], [_fail("replica-0", at_r0)], OWNERS)
    assert v.trainer_fault is not None and not v.culprits


def test_an_ack_timeout_names_the_silent_rollout_rank_as_origin():
    late = SyncTimeout("rollout ranks [1] did not acknowledge bucket 3 in time",
                       peer="rollout rank 1")
    at_r0 = _relay(late, "trainer rank 0", "receive")
    assert at_r0.origin == "rollout rank 1"
    vague = SyncTimeout("broadcast did not complete", peer="rollout ranks")
    assert _relay(vague, "trainer rank 0", "receive").origin == "trainer rank 0"
    v = blame([_fail("trainer rank 0", late)],
              [_fail("replica-0", at_r0), _fail("replica-1", SyncTimeout("hung", peer="replica-1"))],
              OWNERS)
    assert list(v.culprits) == ["replica-1"] and v.trainer_fault is None


def test_a_replica_naming_itself_by_its_adapters_name_is_the_culprit_at_once():
    """A vLLM replica's driver raises with ``peer=self.name`` (its adapter's own name, not
    the manager's): with that name known (``self_name`` in its capabilities) it is the
    replica's own failure, isolated in this step, not a relay left for the trainer's
    timeout. Unknown, the old reading stays (a relay); a trainer rank stays a trainer."""
    own = WeightSyncError("the vLLM engine died while loading", peer="vllm-0", phase="load")
    v = blame([_ok("trainer rank 0")], [_fail("replica-0", own), _ok("replica-1")], OWNERS,
              {"replica-0": "vllm-0", "replica-1": "vllm-0"})
    assert list(v.culprits) == ["replica-0"] and not v.relays
    v = blame([_ok("trainer rank 0")], [_fail("replica-0", own)], OWNERS)
    assert not v.culprits and v.relays == ["replica-0"]
    told = PeerFailed("trainer rank 0 went away", peer="trainer rank 0")
    v = blame([_ok("trainer rank 0")], [_fail("replica-1", told)], OWNERS,
              {"replica-1": "vllm-1"})
    assert not v.culprits and v.relays == ["replica-1"]
