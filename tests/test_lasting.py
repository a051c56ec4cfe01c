"""``LastingStorage``: which yielded tensors a backend may read after the iterator moved
on (``nixl``'s ``auto`` serving). Its errors are the difference between a failed sync and
silently wrong bytes."""

import pytest
import torch

from weightsync.core.errors import IntegrityError
from weightsync.transport.tensors import LastingStorage, mark_stable

pytestmark = pytest.mark.timeout(60)


def _sync(tracker, items):
    tracker.begin()
    out = {name: tracker.lasting(name, t) for name, t in items}
    tracker.finish()
    return out


def test_parameters_and_views_of_one_flat_buffer_last_from_the_second_sync():
    params = {f"p{i}": torch.randn(16) for i in range(3)}
    flat = torch.randn(64)                       # e.g. Megatron's contiguous param buffer
    views = {f"v{i}": flat[16 * i:16 * (i + 1)] for i in range(4)}
    tracker = LastingStorage()
    items = list(params.items()) + list(views.items())
    assert not any(_sync(tracker, items).values())
    assert all(_sync(tracker, items).values())
    assert all(_sync(tracker, items).values())


def test_a_buffer_refilled_for_every_name_and_a_fresh_temporary_never_last():
    tracker = LastingStorage()
    buf = torch.empty(64)
    for _ in range(3):
        got = _sync(tracker, [("a", buf), ("b", buf), ("c", buf[:8])])
        assert got == {"a": False, "b": False, "c": False}
    for _ in range(3):                            # a new tensor every sync
        assert _sync(tracker, [("t", torch.randn(64))]) == {"t": False}


def test_marked_tensors_last_from_the_first_sync_tied_ones_too():
    tracker = LastingStorage()
    w = mark_stable(torch.empty(8))
    assert _sync(tracker, [("embed", w), ("lm_head", mark_stable(w.view(8)))]) == \
        {"embed": True, "lm_head": True}


def test_rewriting_a_lasting_tensor_within_a_sync_is_an_integrity_error():
    tracker = LastingStorage()
    a, big = torch.empty(8), torch.empty(100)
    for _ in range(2):
        _sync(tracker, [("a", a), ("big", big)])
    tracker.begin()
    assert tracker.lasting("a", a)
    with pytest.raises(IntegrityError, match="'b' was yielded over the bytes of 'a'"):
        tracker.lasting("b", a)
    tracker.reset()                               # the failed sync trusts nothing after
    assert _sync(tracker, [("a", a)]) == {"a": False}
    # a span over several earlier ones is still seen (the spans are kept merged)
    tracker.begin()
    tracker.lasting("x", big[10:20])
    tracker.lasting("y", big[50:60])
    assert not tracker.lasting("z", big)
    tracker.finish()
    assert _sync(tracker, [("x", big[10:20]), ("y", big[50:60]), ("z", big)]) == \
        {"x": False, "y": False, "z": False}


def test_small_tensors_never_last_but_may_not_rewrite_a_lasting_one():
    tracker = LastingStorage(min_bytes=1024)
    small, large = torch.empty(16), torch.empty(512)
    for _ in range(2):
        got = _sync(tracker, [("s", small), ("l", large)])
    assert got == {"s": False, "l": True}
    tracker.begin()
    assert tracker.lasting("l", large)
    with pytest.raises(IntegrityError, match="'s2' was yielded over the bytes of 'l'"):
        tracker.lasting("s2", large[:16])
    with pytest.raises(ValueError, match="min_bytes"):
        LastingStorage(min_bytes=-1)


def test_replayed_lasting_answers_as_the_tracker_and_replays_a_steady_sequence():
    """``ReplayedLasting`` gives the plain tracker's answers sync by sync, whatever the
    export does, and from the third identical sync on takes them over without tracking."""
    from weightsync.transport.tensors import ReplayedLasting
    params = {f"p{i}": torch.randn(16) for i in range(4)}
    flat = torch.randn(64)
    cast = torch.empty(16)                       # a buffer refilled for two names
    steady = list(params.items()) + [(f"v{i}", flat[16 * i:16 * (i + 1)]) for i in range(4)]
    syncs = [steady, steady, steady, steady,
             [(n, t.view(t.shape)) for n, t in steady],           # new views: same answers
             steady[:5],                                          # shorter
             steady[:2] + [("c0", cast), ("c1", cast)] + steady[2:],
             steady[:2] + [("c0", cast), ("c1", cast)] + steady[2:],
             steady]
    params["p3"] = torch.randn(16)                               # (used by the last ones)
    syncs += [list(params.items()) + steady[4:], list(params.items()) + steady[4:]]
    plain, fast = LastingStorage(min_bytes=0), ReplayedLasting()
    for items in syncs:
        assert _sync(plain, items) == _sync(fast, items)
    fast.begin()
    got = [fast.lasting(n, t) for n, t in steady]
    assert fast.replayed == 3 and got[3] is False   # replays up to the replaced p3 only
    # a steady run is replayed: answers taken over, none tracked
    fast2 = ReplayedLasting()
    for k in range(4):
        fast2.begin()
        got = [fast2.lasting(n, t) for n, t in steady]
        assert fast2.replayed == (len(steady) if k >= 2 else 0) and all(got) == (k >= 1)
        fast2.finish()


def test_replayed_lasting_still_refuses_an_export_that_starts_rewriting_a_kept_buffer():
    from weightsync.transport.tensors import ReplayedLasting
    params = {f"p{i}": torch.randn(16) for i in range(3)}
    fast = ReplayedLasting()
    for _ in range(3):
        _sync(fast, list(params.items()))
    fast.begin()
    assert fast.lasting("p0", params["p0"]) and fast.replayed == 1
    with pytest.raises(IntegrityError, match="p0"):
        fast.lasting("p1", params["p0"])         # p0's bytes again, under another name
