"""The manager's replica records (``weightsync.orchestration.replicas.ReplicaSet``), without
any worker: names, taking a failed replica back, isolation and removal, health listings."""

import pytest

from weightsync.core.errors import WeightSyncError
from weightsync.orchestration.replicas import ReplicaSet
from weightsync.orchestration.report import SyncReport


class Handle:
    """A stand-in for a worker handle (compared by identity)."""


def filled(n=3, *, healthy=True):
    replicas = ReplicaSet()
    handles = [Handle() for _ in range(n)]
    records = [replicas.add(h, healthy=healthy) for h in handles]
    return replicas, handles, records


def test_add_names_in_order_and_refuses_a_managed_handle():
    replicas, handles, records = filled(3)
    assert [r.name for r in records] == ["replica-0", "replica-1", "replica-2"]
    assert replicas.handles() == handles and len(replicas) == 3
    assert replicas.get(handles[1]) is records[1]
    assert replicas.by_name("replica-2") is records[2]
    assert replicas.lookup(Handle()) is None and replicas.by_name("replica-9") is None
    with pytest.raises(ValueError, match="already managed"):
        replicas.add(handles[0], healthy=True)
    assert len(replicas) == 3


def test_added_after_a_sync_is_stale_and_not_healthy():
    replicas, handles, _ = filled(1)
    late = Handle()
    record = replicas.add(late, healthy=False)
    assert record.state == "stale"
    assert [r.handle for r in replicas.healthy()] == handles
    assert replicas.health()[1] == {"name": "replica-1", "state": "stale", "version": None,
                                    "error": None}


def test_isolate_drops_caps_weights_version_and_lists_it_failed():
    replicas, handles, records = filled(2)
    report = SyncReport(version=4)
    replicas.begin_sync(report)
    replicas.mark_fenced()
    replicas.synced(4, "full", report)
    records[0].caps = {"kinds": ["full"], "full_sync_restores_discarded": True}
    isolated = replicas.isolate("replica-0", "sync:full: PeerFailed: boom")
    assert isolated is records[0]
    assert isolated.state == "failed" and isolated.error == "sync:full: PeerFailed: boom"
    assert isolated.caps == {} and isolated.weights is None and isolated.version is None
    assert not isolated.fenced
    assert isolated.status is report.replicas[0]      # still reported for this sync
    assert replicas.handles() == [handles[1]] and not replicas.is_managed(isolated)
    assert replicas.get(handles[0]) is None and replicas.lookup(handles[0]) is isolated
    assert [r.handle for r in replicas.healthy()] == [handles[1]]
    assert replicas.failed() == {"replica-0": "sync:full: PeerFailed: boom"}
    assert replicas.health() == [
        {"name": "replica-1", "state": "healthy", "version": 4, "error": None},
        {"name": "replica-0", "state": "failed", "version": None,
         "error": "sync:full: PeerFailed: boom"}]
    assert replicas.isolate("replica-0", "again") is None   # not managed any more
    assert replicas.isolate("nobody", "why") is None


def test_take_back_a_failed_replica_under_its_old_name():
    replicas, handles, records = filled(2)
    records[1].caps = {"kinds": ["full"]}
    replicas.isolate("replica-1", "init: SyncTimeout")
    back = replicas.add(handles[1], healthy=False)
    assert back.name == "replica-1" and back.state == "stale"
    assert back.caps == {} and back.error is None and back.version is None
    assert replicas.failed() == {}
    assert replicas.handles() == [handles[0], handles[1]]
    fresh = replicas.add(Handle(), healthy=False)   # the counter did not move
    assert fresh.name == "replica-2"


def test_remove_a_managed_and_a_failed_replica():
    replicas, handles, records = filled(3)
    replicas.isolate("replica-2", "prepare: boom")
    replicas.remove(records[0])
    assert replicas.handles() == [handles[1]] and replicas.lookup(handles[0]) is None
    replicas.remove(replicas.failed_record(handles[2]))
    assert replicas.failed() == {} and replicas.lookup(handles[2]) is None
    assert [h["name"] for h in replicas.health()] == ["replica-1"]
    again = replicas.add(handles[0], healthy=True)   # removed: a new replica, new name
    assert again.name == "replica-3"


def test_forget_weights_and_mark_stale():
    replicas, handles, records = filled(2)
    report = SyncReport(version="v1")
    replicas.begin_sync(report)
    replicas.synced("v1", "base", report)
    assert [r.weights for r in records] == ["base", "base"]
    assert [st.version for st in report.replicas] == ["v1", "v1"]
    replicas.mark_stale(records[0])
    assert records[0].state == "stale" and records[0].weights is None
    assert [r.handle for r in replicas.healthy()] == [handles[1]]
    replicas.forget_weights()
    assert [r.weights for r in records] == [None, None]
    assert records[1].version == "v1"       # what it holds is still known


def test_sync_statuses_and_fences():
    replicas, _, records = filled(3)
    report = SyncReport(version=1)
    replicas.begin_sync(report)
    assert [(st.index, st.name) for st in report.replicas] == [
        (0, "replica-0"), (1, "replica-1"), (2, "replica-2")]
    replicas.mark_fenced()
    replicas.isolate("replica-1", "pause: boom")
    replicas.stale_fenced()
    assert [r.state for r in replicas.managed()] == ["stale", "stale"]
    assert records[1].state == "failed"
    second = SyncReport(version=2)
    replicas.begin_sync(second)
    assert [st.name for st in second.replicas] == ["replica-0", "replica-2"]
    assert not any(r.fenced for r in records) and records[1].status is None
    late = replicas.status(records[1], second)    # a status made mid-sync gets the next index
    assert late.index == 2 and second.replicas[-1] is late


def test_route_round_robin_over_healthy_and_refusal():
    replicas, handles, records = filled(3)
    records[1].state = "stale"
    assert [replicas.route() for _ in range(3)] == [handles[0], handles[2], handles[0]]
    replicas.isolate("replica-0", "x")
    replicas.isolate("replica-2", "y")
    with pytest.raises(WeightSyncError, match=r"no healthy rollout replica.*replica-0"):
        replicas.route()


def test_check_kinds_reads_capabilities():
    replicas, _, records = filled(2)
    replicas.check_kinds(["base", "adapter"])          # no capabilities known: allowed
    records[1].caps = {"kinds": ["full"], "reasons": {"lora": "no LoRA support"}}
    replicas.check_kinds(["full"])
    with pytest.raises(ValueError, match=r"replica-1 cannot apply \['adapter'\] syncs: no LoRA"):
        replicas.check_kinds(["adapter"])
