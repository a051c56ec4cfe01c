"""What a receiver keeps of each tensor, without vLLM: the box arithmetic of the slice
recorder on the loader patterns vLLM uses (column/row shards, fused q/k/v, vocab rows,
select, chunk), what it refuses (transposes, broadcasts, copies from a cast), ``Keep``
validation, and box digests on the trainer side."""

from __future__ import annotations

import pytest
import torch

from weightsync.core.digests import box_key, parse_box_key, tensor_digest
from weightsync.core.xferplan import Keep
from weightsync.rollout.vllm.slices import Unrecordable, _Recorder, _key, box_of_view


def _meta(*shape):
    return torch.empty(shape, device="meta")


def test_boxes_of_the_views_loaders_take():
    w = _meta(8, 6)
    assert box_of_view(w, (8, 6)) == ((0, 8), (0, 6))
    assert box_of_view(w.narrow(0, 4, 4), (8, 6)) == ((4, 8), (0, 6))        # column shard
    assert box_of_view(w.narrow(1, 3, 3), (8, 6)) == ((0, 8), (3, 6))        # row shard
    assert box_of_view(w[2:5, 1:4], (8, 6)) == ((2, 5), (1, 4))
    assert box_of_view(w.chunk(2, 0)[1], (8, 6)) == ((4, 8), (0, 6))
    assert box_of_view(w.select(0, 3), (8, 6)) == ((3, 4), (0, 6))
    assert box_of_view(w[5:6], (8, 6)) == ((5, 6), (0, 6))
    b = _meta(10)
    assert box_of_view(b.narrow(0, 2, 5), (10,)) == ((2, 7),)
    e = _meta(3, 1, 4)                                                       # a size-1 dim
    assert box_of_view(e[1:], (3, 1, 4)) == ((1, 3), (0, 1), (0, 4))
    with pytest.raises(Unrecordable):
        box_of_view(w.t(), (8, 6))                                          # transposed
    with pytest.raises(Unrecordable):
        box_of_view(w[:, 0:1].expand(8, 4), (8, 6))                          # broadcast


def _record(loader, shapes):
    """Run ``loader(params, source)`` under the recorder; ``shapes``: {param: shape}."""
    params = {n: _meta(*s) for n, s in shapes.items()}
    rec = _Recorder({_key(p): (n, tuple(p.shape)) for n, p in params.items()})
    src = _meta(8, 6)
    rec.sources[_key(src)] = ("w", (8, 6))
    with torch.no_grad(), rec:
        loader(params, src)
    return [(p, db, s, sb) for p, db, s, sb in rec.copies]


def test_the_recorder_maps_copies_into_parameters_to_source_boxes():
    def fused(params, src):          # q rows of a fused qkv, TP rank 1 of 2
        params["qkv"].narrow(0, 0, 4).copy_(src.narrow(0, 4, 4))

    assert _record(fused, {"qkv": (10, 6)}) == [("qkv", ((0, 4), (0, 6)), "w", ((4, 8), (0, 6)))]

    def row(params, src):            # a row-parallel weight: this rank's columns
        params["o"].data.copy_(src.narrow(1, 3, 3))

    assert _record(row, {"o": (8, 3)}) == [("o", ((0, 8), (0, 3)), "w", ((0, 8), (3, 6)))]

    def vocab(params, src):          # padded vocabulary rows, the padding zeroed
        params["e"][:5].data.copy_(src[3:8])
        params["e"][5:].fill_(0)

    assert _record(vocab, {"e": (6, 6)}) == [("e", ((0, 5), (0, 6)), "w", ((3, 8), (0, 6)))]


@pytest.mark.parametrize("loader,shape", [
    (lambda p, s: p["x"].copy_(s.to(torch.float16)), (8, 6)),          # a copy from a cast
    (lambda p, s: p["x"].copy_(s.t().contiguous()), (6, 8)),           # transposed, made contiguous
    (lambda p, s: p["x"].copy_(torch.cat([s[:4], s[4:]])), (8, 6)),    # concatenated
    (lambda p, s: p["x"].copy_(s[0:1].expand(8, 6)), (8, 6)),          # a broadcast
    (lambda p, s: p["x"].copy_(s.t()), (6, 8)),                        # a transposed view
], ids=["cast", "contiguous-transpose", "cat", "broadcast", "transpose"])
def test_what_the_recorder_cannot_map_is_refused(loader, shape):
    with pytest.raises(Unrecordable):
        _record(loader, {"x": shape})


def test_real_parameters_are_never_written_while_recording():
    real = torch.ones(4, 6)
    rec = _Recorder({_key(real): ("bias", (4, 6))})
    src = _meta(8, 6)
    rec.sources[_key(src)] = ("w", (8, 6))
    with torch.no_grad(), rec:
        real.copy_(src[:4])          # would fail for real: meta has no data
        real.fill_(7.0)
        real.zero_()
    assert torch.equal(real, torch.ones(4, 6))
    assert rec.copies == [("bias", ((0, 4), (0, 6)), "w", ((0, 4), (0, 6)))]


def test_keep_validates_and_defaults_to_whole():
    k = Keep(boxes={"a": [[(0, 2), (1, 3)]], "b": []}, notes=("n",))
    assert k.of("a", (4, 4)) == (((0, 2), (1, 3)),)
    assert k.of("b", (4,)) == ()
    assert k.of("c", (2, 3)) == (((0, 2), (0, 3)),)
    for bad in ({"a": [[(0, 1, 2)]]}, {"a": [[(-1, 2)]]}, {"": []}, [("a", [])]):
        with pytest.raises(ValueError):
            Keep(boxes=bad)


def test_box_keys_round_trip_and_the_trainer_hashes_the_boxes_asked_for():
    from weightsync.trainer.digests import export_digests

    assert parse_box_key(box_key("m.w", ((0, 2), (3, 5)))) == ("m.w", ((0, 2), (3, 5)))
    assert parse_box_key("m.w") is None and parse_box_key("m.w[x]") is None
    model = torch.nn.Linear(6, 4)
    key = box_key("weight", ((2, 4), (0, 6)))
    got = export_digests(model, cast_to={key: "float32", "bias": "float32"})
    assert set(got) == {key, "bias"}                 # the whole weight was not asked for
    assert got[key] == tensor_digest(model.weight.detach()[2:4].contiguous())
    assert got["bias"] == tensor_digest(model.bias.detach())
    both = export_digests(model, cast_to={key: "float32", "weight": "float32"})
    assert both["weight"] == tensor_digest(model.weight.detach()) and key in both
