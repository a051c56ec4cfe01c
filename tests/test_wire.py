import json

import pytest
from hypothesis import given, settings, strategies as st

from weightsync.core.errors import WireError
from weightsync.core.plan import TensorMeta
from weightsync.core.wire import (AckMsg, BucketMsg, DoneMsg, ErrorMsg, HelloMsg, NamesMsg, decode,
                             encode)

MESSAGES = [
    BucketMsg(version=3, seq=1, stream=0, index=2, slot=1, nbytes=100, layout="ab",
              entries=(TensorMeta("a", (2, 3), "float32", 0, 24),), checksum=7),
    BucketMsg(version=None, seq=1, stream=0, index=2, slot=1, nbytes=100, layout="ab"),
    BucketMsg(version=4, seq=2, stream=1, index=3, slot=2, nbytes=8, layout="cd", ready=True),
    DoneMsg(version="v1", seq=1, stream=0, num_buckets=2, num_tensors=3, nbytes=5,
            signature="x"),
    ErrorMsg(version=1, seq=2, error="SyncTimeout", message="m", peer="p", phase="send"),
    ErrorMsg(version=1, seq=2, error="PeerFailed", message="m", peer="trainer rank 0",
             phase="send", origin="rollout rank 2"),
    NamesMsg(seq=1, rank=0, digest="d", names=("a", "b")),
    AckMsg(seq=1, stream=0, rank=3, index=4, final=True),
    HelloMsg(stream=0, rank=1, bucket_size=256, num_slots=2, segments=("s",)),
    HelloMsg(stream=0, rank=1, bucket_size=256, num_slots=2, handles=("cudaipc1|x", "y")),
]


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: m.kind)
def test_roundtrip(msg):
    assert decode(encode(msg)) == msg


@pytest.mark.parametrize("raw", [
    b"", b"null", b"[]", b'{"wsv": 2, "kind": "ack"}', b'{"wsv": 1, "kind": "evil"}',
    b'{"wsv": 1, "kind": "ack", "seq": 1, "stream": 0, "rank": 0, "index": -1}',
    b'{"wsv": 1, "kind": "ack", "seq": true, "stream": 0, "rank": 0, "index": 1}',
    b'{"wsv": 1, "kind": "ack", "seq": 1, "stream": 0, "rank": 0, "index": 1, "x": 1}',
    b"\x80\x04\x95",  # a pickle header is just bad JSON here
    b'{"wsv": 1, "kind": "bucket", "version": 1, "seq": 1, "stream": 0, "index": 0, '
    b'"slot": 0, "nbytes": 0, "layout": "", "ready": 1}',   # ready is a bool
])
def test_rejects_malformed(raw):
    with pytest.raises(WireError):
        decode(raw)


def _bucket_with(entry):
    body = json.loads(encode(MESSAGES[0]))
    body["entries"] = [entry]
    return json.dumps(body).encode()


@pytest.mark.parametrize("entry", [
    ["a", [2, 3], "object", 0, 24, 0, 24],          # dtype off the whitelist
    ["a", [2, 3], "float32", 0, 24, 0, 25],         # total does not match shape
    ["a", [2, 3], "float32", 0, 24, 8, 24],         # chunk runs past the end
    ["a", [-2, 3], "float32", 0, 24, 0, 24],        # negative dim
    ["a", [2, 3], "float32", 0, 24, 0],             # too few fields
])
def test_rejects_bad_tensor_entries(entry):
    with pytest.raises(WireError):
        decode(_bucket_with(entry))


@pytest.mark.parametrize("handles", ["x", [1], ["a" * 40000], ["h"] * 1025])
def test_rejects_bad_handles(handles):
    body = {"wsv": 1, "kind": "hello", "stream": 0, "rank": 0, "bucket_size": 256,
            "num_slots": 1, "handles": handles}
    with pytest.raises(WireError):
        decode(json.dumps(body).encode())


def test_size_limit():
    with pytest.raises(WireError):
        decode(b" " * 100, max_bytes=10)


@settings(max_examples=2000, deadline=None)
@given(st.binary(max_size=300))
def test_fuzz_bytes_only_wire_errors(raw):
    try:
        decode(raw)
    except WireError:
        pass


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 2**63) | st.text(max_size=8),
    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4),
    max_leaves=12)


# 600 examples: 6 s on this 2-core box (2000 took 19 s of the CI budget)
@settings(max_examples=600, deadline=None)
@given(st.sampled_from(["bucket", "done", "error", "names", "ack", "hello"]),
       st.dictionaries(st.sampled_from(["version", "seq", "stream", "index", "slot", "nbytes",
                                        "layout", "entries", "checksum", "num_buckets",
                                        "num_tensors", "signature", "error", "message", "peer",
                                        "phase", "rank", "digest", "names", "final",
                                        "bucket_size", "num_slots", "segments",
                                        "handles"]),
                       json_values, max_size=10))
def test_fuzz_structured_only_wire_errors(kind, fields):
    raw = json.dumps({"wsv": 1, "kind": kind, **fields}).encode()
    try:
        decode(raw)
    except WireError:
        pass
