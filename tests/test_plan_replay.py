"""ReplayBuilder: a replayed layout is exactly the layout a fresh PlanBuilder makes, for
the same sequence and for every way a sequence can differ from the earlier one."""

import random

import pytest

from weightsync.core.plan import PlanBuilder, ReplayBuilder

pytestmark = pytest.mark.timeout(60)

BUCKET, ALIGN = 4096, 256


def _seq(rng: random.Random, n: int) -> list:
    out = []
    for i in range(n):
        kind = rng.random()
        numel = 0 if kind < 0.05 else rng.randint(1, 64) if kind < 0.7 else rng.randint(900, 5000)
        out.append((f"t{i}", (numel,), rng.choice(["float32", "bfloat16", "uint8"])))
    return out


def _plan(seq):
    b = PlanBuilder(BUCKET, ALIGN)
    for item in seq:
        b.add(*item)
    return b.finish()


def _run(builder, seq):
    """Feed ``seq``; after each add, check what the sender relies on: every bucket before
    the bucket of the tensor's last piece is closed (a chunked tensor's earlier pieces are
    published before its next piece takes a slot)."""
    pieces = []
    for item in seq:
        got = builder.add(*item)
        pieces.append(got)
        assert len(builder.closed) >= got[-1][0]
        for i, b in enumerate(builder.closed):
            assert b.index == i
    return pieces, builder.finish()


def _variants(rng, seq):
    yield "same", list(seq)
    k = rng.randrange(len(seq))
    yield "renamed", seq[:k] + [("other", seq[k][1], seq[k][2])] + seq[k + 1:]
    yield "reshaped", seq[:k] + [(seq[k][0], (seq[k][1][0] + 7,), seq[k][2])] + seq[k + 1:]
    yield "retyped", seq[:k] + [(seq[k][0], seq[k][1],
                                 "float64" if seq[k][2] != "float64" else "uint8")] + seq[k + 1:]
    yield "shorter", seq[:k]
    yield "longer", seq + _seq(rng, 5)
    yield "dropped", seq[:k] + seq[k + 1:]


@pytest.mark.parametrize("seed", range(25))
def test_replay_equals_a_fresh_layout(seed):
    rng = random.Random(seed)
    seq = _seq(rng, rng.randint(1, 60))
    prev = _plan(seq)
    for label, other in _variants(rng, seq):
        if not other:
            continue
        want_pieces, want = _run(PlanBuilder(BUCKET, ALIGN), other)
        replay = ReplayBuilder(BUCKET, ALIGN, prev.buckets)
        got_pieces, got = _run(replay, other)
        assert got_pieces == want_pieces, label
        assert got.buckets == want.buckets, label
        assert got.signature == want.signature, label
        assert replay.replayed == (label == "same"), label
        if label == "same":   # the earlier plan's own objects: nothing hashed again
            assert all(a is b for a, b in zip(got.buckets, prev.buckets))


def test_replay_of_an_empty_plan_builds():
    replay = ReplayBuilder(BUCKET, ALIGN, ())
    replay.add("a", (3,), "float32")
    assert replay.finish().buckets == _plan([("a", (3,), "float32")]).buckets
