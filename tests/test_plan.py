import json
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings, strategies as st

from weightsync.core.plan import DTYPES, PlanBuilder, build_plan, dtype_name, itemsize

ALIGN = 256
dtype_names = st.sampled_from(sorted(DTYPES))
shapes = st.lists(st.integers(0, 40), min_size=0, max_size=3).map(tuple)
tensor_lists = st.lists(st.tuples(shapes, dtype_names), min_size=0, max_size=40)
bucket_sizes = st.sampled_from([256, 512, 1024, 4096])


def _specs(items):
    return [(f"t{i}", shape, dt) for i, (shape, dt) in enumerate(items)]


@settings(max_examples=300, deadline=None)
@given(tensor_lists, bucket_sizes)
def test_every_byte_lands_exactly_once_and_buckets_stay_bounded(items, bucket_size):
    specs = _specs(items)
    plan = build_plan(specs, bucket_size)
    covered = {name: [] for name, _, _ in specs}
    for b in plan.buckets:
        assert b.nbytes <= bucket_size
        spans = []
        for e in b.entries:
            assert 0 <= e.offset and e.offset + e.nbytes <= b.nbytes <= bucket_size
            if e.nbytes:
                assert e.offset % ALIGN == 0 or e.is_chunk
                spans.append((e.offset, e.offset + e.nbytes))
            covered[e.name].append((e.chunk_offset, e.nbytes))
            if e.is_chunk and not e.is_last_chunk:
                # a chunk that does not end its tensor runs to the end of its bucket
                assert e.offset + e.nbytes == b.nbytes == bucket_size
        spans.sort()
        for (a0, a1), (b0, b1) in zip(spans, spans[1:]):
            assert a1 <= b0, "pieces overlap inside a bucket"
    for name, shape, dt in specs:
        total = itemsize(dt)
        for d in shape:
            total *= d
        pieces = sorted(covered[name])
        assert pieces, name
        pos = 0
        for off, n in pieces:
            assert off == pos
            pos += n
        assert pos == total


@settings(max_examples=100, deadline=None)
@given(tensor_lists, bucket_sizes)
def test_streaming_builder_equals_whole_plan(items, bucket_size):
    specs = _specs(items)
    b = PlanBuilder(bucket_size)
    for name, shape, dt in specs:
        b.add(name, shape, dt)
    assert b.finish() == build_plan(specs, bucket_size)


def test_big_tensor_is_chunked_and_memory_bounded():
    plan = build_plan([("a", (10,), "float32"), ("big", (1000,), "float32"),
                       ("c", (3,), "int8")], 1024)
    chunks = [(b.index, e) for b in plan.buckets for e in b.entries if e.name == "big"]
    # the first chunk fills the open bucket behind "a" (aligned to 256), the next ones
    # whole buckets, the last leaves room for "c"
    assert [(i, e.offset, e.nbytes, e.chunk_offset) for i, e in chunks] == [
        (0, 256, 768, 0), (1, 0, 1024, 768), (2, 0, 1024, 1792), (3, 0, 1024, 2816),
        (4, 0, 160, 3840)]
    assert [b.nbytes for b in plan.buckets] == [1024, 1024, 1024, 1024, 256 + 3]
    assert plan.max_chunk == 4000


def test_tensors_of_one_and_a_half_buckets_fill_every_bucket():
    """Tensors a little over a bucket (an MLP matrix against 64 MiB buckets) do not close
    the open bucket and start one each (buckets would alternate full and ~40 % full): each
    starts in the free space the previous one left."""
    plan = build_plan([(f"w{i}", (384,), "float32") for i in range(6)], 1024)
    assert [b.nbytes for b in plan.buckets] == [1024] * 9
    assert sum(b.nbytes for b in plan.buckets) == 6 * 384 * 4


def test_signature_changes_with_any_field_and_bucket_size():
    base = [("a", (2, 3), "float32"), ("b", (4,), "bfloat16")]
    sig = build_plan(base, 1024).signature
    assert build_plan(base, 2048).signature != sig
    assert build_plan([("a", (3, 2), "float32"), base[1]], 1024).signature != sig
    assert build_plan([("a", (2, 3), "float16"), base[1]], 1024).signature != sig
    assert build_plan([("x", (2, 3), "float32"), base[1]], 1024).signature != sig
    assert build_plan(base[:1], 1024).signature != sig


def test_signature_stable_across_processes():
    code = ("from weightsync.core.plan import build_plan;"
            "print(build_plan([('a',(2,3),'float32'),('b',(5000,),'int8')],1024).signature)")
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           check=True, env={"PYTHONHASHSEED": str(i),
                                            **__import__("os").environ}).stdout
            for i in (1, 2)}
    local = build_plan([("a", (2, 3), "float32"), ("b", (5000,), "int8")], 1024).signature
    assert outs == {local + "\n"}


def test_invalid_input_is_a_value_error():
    with pytest.raises(ValueError):
        build_plan([("a", (2,), "float32")], 1000)  # not a multiple of the alignment
    with pytest.raises(ValueError):
        build_plan([("a", (2,), "float32"), ("a", (2,), "float32")], 1024)
    with pytest.raises(ValueError):
        build_plan([("a", (2,), "nope")], 1024)
    with pytest.raises(ValueError):
        dtype_name(torch.qint8)
