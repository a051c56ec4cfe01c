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
