"""More hostile input for the wire decoder: mutated valid messages (bytes and JSON fields)
and JSON-shaped garbage. Together with the fuzzers of test_wire.py: 12,000 cases.

Properties: ``decode`` raises nothing but ``WireError``; whatever it accepts is a message
that encodes and decodes back to itself; no input takes long (a decoder that scanned
or recursed without bound would trip the per-case limit long before a hang)."""

from __future__ import annotations

import json
import random
import time

from hypothesis import HealthCheck, given, settings, strategies as st

from test_wire import MESSAGES
from weightsync.core.errors import WireError
from weightsync.core.wire import Message, decode, encode

ENCODED = [encode(m) for m in MESSAGES]
BODIES = [json.loads(raw) for raw in ENCODED]
PER_CASE_S = 2.0
FUZZ = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow], database=None)


def _check(raw: bytes) -> None:
    start = time.perf_counter()
    try:
        msg = decode(raw)
    except WireError:
        msg = None
    assert time.perf_counter() - start < PER_CASE_S
    if msg is not None:
        assert isinstance(msg, Message)
        assert decode(encode(msg)) == msg


@settings(FUZZ, max_examples=4000)
@given(st.sampled_from(ENCODED), st.integers(0, 2**64))
def test_fuzz_mutated_bytes(raw, seed):
    """1-6 random flips, inserts, deletes or a truncation (drawn from ``seed``: cheap to
    generate, and a failure still names its exact input)."""
    rng = random.Random(seed)
    data = bytearray(raw)
    for _ in range(rng.randint(1, 6)):
        op, pos = rng.randrange(4), rng.randint(0, len(data))
        if op == 0 and pos < len(data):
            data[pos] ^= rng.randint(1, 255)
        elif op == 1:
            data.insert(pos, rng.randint(0, 255))
        elif op == 2 and pos < len(data):
            del data[pos]
        elif op == 3:
            del data[pos:]
    _check(bytes(data))


_scalars = (st.none() | st.booleans() | st.integers(-2**64, 2**64) | st.floats()
            | st.text(max_size=12) | st.lists(st.integers(-3, 2**63), max_size=4)
            | st.lists(st.text(max_size=6), max_size=3))


@settings(FUZZ, max_examples=2000)
@given(st.sampled_from(range(len(BODIES))), st.lists(
    st.tuples(st.sampled_from(["set", "delete", "add"]), st.integers(0, 50), _scalars),
    min_size=1, max_size=3))
def test_fuzz_mutated_fields(which, edits):
    body = dict(BODIES[which])
    for op, k, value in edits:
        keys = sorted(body)
        key = keys[k % len(keys)] if keys else "kind"
        if op == "set":
            body[key] = value
        elif op == "delete":
            body.pop(key, None)
        else:
            body[f"x{k}"] = value
    _check(json.dumps(body, allow_nan=True).encode())


@settings(FUZZ, max_examples=2000)
@given(st.text(alphabet='{}[]",:0123456789.-+eE truefalsnkidwv\\u', max_size=200))
def test_fuzz_json_shaped_text(text):
    _check(text.encode())


def test_case_count():
    """The cases the fuzzers above and those of test_wire.py run (max_examples each)."""
    import test_wire

    ours = [test_fuzz_mutated_bytes, test_fuzz_mutated_fields, test_fuzz_json_shaped_text]
    theirs = [test_wire.test_fuzz_bytes_only_wire_errors,
              test_wire.test_fuzz_structured_only_wire_errors]
    total = sum(f._hypothesis_internal_use_settings.max_examples    # type: ignore
                for f in ours + theirs)
    assert total >= 10_000, total
