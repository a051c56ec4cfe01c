"""Tests of the planner's ``shm`` paths with torch shared memory on either side
(weightsync.tools.planner.bucketed, ``Scenario.shared`` / ``trainer_device``): a push writes
every tensor into each receiver in turn (a CPU trainer over its push threads, a GPU trainer
by device-to-host copies), a shared read copies direct tensors at the receivers' memcpy rate
instead of the cross-memory-read rate, and a GPU trainer's ring is device-to-host copies
into it; hand-computed on small models with the software costs set to zero."""

from __future__ import annotations

import pytest

from weightsync.tools.cli import main
from weightsync.tools.planner import (PlannerError, Scenario, load_links, model_from_tensors,
                                      predict)
from weightsync.tools.planner.bucketed import slot_pipeline, zero_copy_batches

pytestmark = pytest.mark.timeout(60)

MiB = 1 << 20
ZERO_SW = {"tensor_us": 0, "bucket_us": 0, "read_us": 0, "control_us": 0, "op_us": 0}


def host_links(cores: int = 2, dev: float = 10.0, host: float = 14.0, **links) -> dict:
    doc = {"name": "host", "device": "host", "gpus_per_node": 8, "max_nodes": 1,
           "cores": cores,
           "links": {"intra": {"GBps": 5.0}, "device_mem": {"GBps": dev},
                     "host_mem": {"GBps": host}},
           "collective": {"algo": "star"},
           "ring": {"direct_min_bytes": 8 * MiB, "direct_max_receivers": 1, "direct_GBps": 8.0},
           "software": dict(ZERO_SW)}
    doc["links"].update(links)
    return doc


# 4 tensors of 16 MiB (direct / split) and 8 of 1 MiB (bucketed, one thread), bf16
MODEL = model_from_tensors("mixed", [(f"big{i}.weight", (8 * MiB,)) for i in range(4)] +
                           [(f"small{i}.weight", (MiB // 2,)) for i in range(8)])
BIG, SMALL = 4 * 16 * MiB, 8 * MiB


def ring(links: dict, replicas: int = 1, **kw):
    sc = Scenario(model=kw.pop("model", MODEL), links=load_links(links), trainer_gpus=1,
                  replicas=replicas, bucket_size=kw.pop("bucket_size", MiB),
                  strategies=("ring",), **kw)
    return predict(sc).results["ring"]


def test_cpu_push_writes_each_receiver_in_turn_over_the_push_threads():
    """shared="receivers": no bucket, no receiver copy; the trainer writes every tensor into
    each receiver, one after another: tensors of 8 MiB or more split over min(4, cores) = 2
    threads (2 x 10 GB/s, within host_mem's 14), the rest on one thread (10 GB/s). Twice
    the receivers, twice the time. "both" is a push too."""
    one = ring(host_links(), shared="receivers")
    want = BIG / 14e9 + SMALL / 10e9
    assert one.seconds == pytest.approx(want, rel=1e-9)
    assert "shm push" in one.bottleneck.limit
    assert one.dest_reads == [0.0]               # no bucket, no direct read
    assert any("push" in n for n in one.notes)
    two = ring(host_links(), replicas=2, shared="receivers")
    assert two.seconds == pytest.approx(2 * want, rel=1e-9)
    assert ring(host_links(), shared="both").seconds == one.seconds
    # the ring of the same sync: direct reads at 8 GB/s plus the buckets' two copies
    assert ring(host_links()).seconds > 1.2 * one.seconds
    # more cores: four push threads, the host's memory sets the pace of the big ones
    many = ring(host_links(cores=8, host=100.0), shared="receivers")
    assert many.seconds == pytest.approx(BIG / 40e9 + SMALL / 10e9, rel=1e-9)


def test_shared_read_copies_direct_tensors_at_the_receivers_memcpy_rate():
    """shared="trainer": the direct tensors (>= 8 MiB) are copied out of the trainer's
    shared memory over the receiver's copy threads (cores // receivers = 2: min(2 x 10,
    14) GB/s) instead of read at ring.direct_GBps (8); the bucketed rest is unchanged. With
    2 receivers on 2 cores there are no direct reads, so nothing changes."""
    plain = ring(host_links())
    shared = ring(host_links(), shared="trainer")
    assert plain.seconds - shared.seconds == pytest.approx(BIG / 8e9 - BIG / 14e9, rel=1e-9)
    assert "shm shared read" in shared.bottleneck.limit
    assert shared.dest_reads == plain.dest_reads
    assert ring(host_links(), replicas=2, shared="trainer").seconds == \
        ring(host_links(), replicas=2).seconds


def test_gpu_trainer_on_a_host_ring_and_push():
    """trainer_device="gpu": the trainer's bytes leave by device-to-host copies (links.d2h,
    no core; half a copy's load on host memory). Ring: D2H into the ring while the receiver
    copies out over its 16 copy threads (16 cores, one receiver), host memory carrying the
    copy and the DMA writes, plus one bucket's fill; nothing goes direct. Push: every byte
    D2H into each receiver, the copy engine's time."""
    links = host_links(cores=16, dev=4.0, host=36.0, d2h={"GBps": 50.0})
    model = model_from_tensors("four", [(f"l{i}.weight", (32 * MiB,)) for i in range(4)])
    nbytes, bucket = 4 * 64 * MiB, 64 * MiB
    r = ring(links, model=model, bucket_size=bucket, trainer_device="gpu")
    fluid = (nbytes + nbytes / 2) / 36e9
    fill = bucket / 50e9 + bucket / min(16 * 4e9, 36e9)
    assert r.seconds == pytest.approx(fluid + fill, rel=1e-9)
    assert "host_mem" in r.bottleneck.limit
    assert r.links["d2h"]["bytes"] == nbytes
    assert r.dest_reads == [4.0]                 # four buckets, no direct read
    p = ring(links, model=model, bucket_size=bucket, trainer_device="gpu", shared="receivers")
    assert p.seconds == pytest.approx(nbytes / 50e9, rel=1e-9)
    assert "d2h" in p.bottleneck.limit
    p2 = ring(links, replicas=2, model=model, bucket_size=bucket, trainer_device="gpu",
              shared="receivers")
    assert p2.seconds == pytest.approx(2 * nbytes / 50e9, rel=1e-9)
    sc = Scenario(model=model, links=load_links(links), trainer_gpus=1, replicas=1,
                  trainer_device="gpu")
    res = predict(sc)
    assert not res.results["p2p"].applicable and not res.results["broadcast"].applicable
    assert res.bound["via"] == ["d2h"]


def test_a_trainer_that_waits_for_each_direct_read_pays_direct_wait_us_a_read():
    """ring.direct_window 1 (the engine waits for each direct read before its next item):
    each of the 4 direct tensors adds software.direct_wait_us, serially (the receivers idle
    meanwhile); the default window (2) adds nothing. Without direct_wait_us a waited read
    adds control_us + tensor_us. Two receivers on two cores read nothing directly, so the
    window changes nothing there."""
    def links(window=None, **sw):
        doc = host_links()
        doc["software"].update(sw)
        if window is not None:
            doc["ring"]["direct_window"] = window
        return doc

    plain = ring(links(direct_wait_us=500))
    assert ring(links(window=2, direct_wait_us=500)).seconds == plain.seconds
    waited = ring(links(window=1, direct_wait_us=500))
    assert waited.seconds - plain.seconds == pytest.approx(4 * 500e-6, rel=1e-9)
    assert "read one at a time" in waited.bottleneck.limit
    assert any("waits for each direct read" in n and "+500 us" in n for n in waited.notes)
    assert not any("waits for each direct read" in n for n in plain.notes)
    base = ring(links(control_us=100, tensor_us=20))
    default = ring(links(window=1, control_us=100, tensor_us=20))
    assert default.seconds - base.seconds == pytest.approx(4 * 120e-6, rel=1e-9)
    assert ring(links(window=1, direct_wait_us=500), replicas=2).seconds == \
        ring(links(direct_wait_us=500), replicas=2).seconds
    # the CPU box's preset carries the measured cost; a --link-set reaches the window
    assert load_links("cpu-2core").software["direct_wait_us"] == pytest.approx(370e-6)
    assert load_links("cpu-2core", {"ring.direct_window": 1}).direct_window == 1
    assert load_links("cpu-2core").direct_window == 2


@pytest.mark.parametrize("mutate, field, words", [
    (lambda d: d["ring"].update(direct_window=0), "links.ring.direct_window", "> 0"),
    (lambda d: d["ring"].update(direct_window=1.5), "links.ring.direct_window",
     "whole number"),
    (lambda d: d["ring"].update(direct_window="one"), "links.ring.direct_window", "a number"),
    (lambda d: d["software"].update(direct_wait_us=-1), "links.software.direct_wait_us",
     ">= 0"),
])
def test_bad_direct_window_or_wait_names_the_field(mutate, field, words):
    doc = host_links()
    mutate(doc)
    with pytest.raises(PlannerError, match=words) as exc:
        load_links(doc)
    assert exc.value.field == field


@pytest.mark.parametrize("links, kw, field, words", [
    ("cpu-2core", {"shared": "nope"}, "shared", "must be one of none, trainer"),
    ("cpu-2core", {"trainer_device": "tpu"}, "trainer.device", "must be one of cpu, gpu"),
    ("h100-8gpu-400g", {"trainer_device": "gpu"}, "trainer.device", "host links file"),
    ("cpu-2core", {"trainer_device": "gpu"}, "links.d2h", "missing"),
    ("h200-host", {"trainer_device": "gpu", "shared": "trainer"}, "shared", "CUDA tensors"),
    ("h200-host", {"trainer_device": "gpu", "shared": "both"}, "shared", "CUDA tensors"),
])
def test_bad_shm_options_name_the_field(links, kw, field, words):
    with pytest.raises(PlannerError, match=words) as exc:
        Scenario(model=MODEL, links=load_links(links), trainer_gpus=1, replicas=1, **kw)
    assert exc.value.field == field
    assert isinstance(exc.value, ValueError)


def test_cli_options_and_their_errors(capsys):
    rc = main(["plan", "--model", "bench:synthetic-16MiB", "--links", "cpu-2core",
               "--strategies", "ring", "--shared", "receivers"])
    out, err = capsys.readouterr()
    assert rc == 0 and "shm push" in out and "in shared memory: receivers" in out
    rc = main(["plan", "--model", "bench:synthetic-16MiB", "--links", "h200-host",
               "--trainer-device", "gpu", "--strategies", "ring"])
    out, err = capsys.readouterr()
    assert rc == 0 and "GPU trainer" in out and "on their GPUs" in out
    rc = main(["plan", "--model", "bench:synthetic-16MiB", "--shared", "trainer",
               "--placement", "colocated", "--strategies", "ring"])
    out, err = capsys.readouterr()
    assert rc == 0 and "cuda_ipc zero-copy" in out
    rc = main(["plan", "--model", "bench:synthetic-16MiB", "--placement", "colocated",
               "--strategies", "ring", "--json", "-"])
    out, err = capsys.readouterr()
    assert rc == 0 and '"ring_sync"' not in out and "sync=host" not in out
    with pytest.raises(SystemExit) as exc:
        main(["plan", "--model", "bench:synthetic-16MiB", "--ring-sync", "host"])
    assert exc.value.code == 2 and "--ring-sync" in capsys.readouterr().err
    rc = main(["plan", "--model", "bench:synthetic-16MiB", "--trainer-device", "gpu"])
    out, err = capsys.readouterr()
    assert rc == 2 and "weightsync plan: error: trainer.device:" in err
    assert "Traceback" not in err
    with pytest.raises(SystemExit) as exc:
        main(["plan", "--model", "bench:synthetic-16MiB", "--shared", "bogus"])
    assert exc.value.code == 2
    with pytest.raises(PlannerError, match="links.d2h"):
        load_links("cpu-2core", {"device": "gpu", "links.nic": {"GBps": 1},
                                 "links.d2h": {"GBps": 1}})


def test_a_ring_of_two_slots_stalls_on_uneven_buckets():
    """The slot pipeline (``slot_pipeline``): equal buckets cost the fluid time plus one
    bucket; a full bucket behind a small one makes the trainer wait for the full one before
    it to drain, so full/small alternation runs at two full buckets per pair; a faster
    side (a GPU trainer's device-to-host copies) waits less."""
    r, full, small = 1e9, 1e6, 0.4e6
    assert slot_pipeline([full] * 10, r, r, 2, 0.0) == pytest.approx(11 * full / r)
    pairs = slot_pipeline([full, small] * 10, r, r, 2, 0.0)
    assert pairs == pytest.approx(10 * 2 * full / r + small / r)
    assert slot_pipeline([full, small] * 10, r, r, 3, 0.0) < 0.8 * pairs   # a third slot
    assert slot_pipeline([full, small] * 10, 4 * r, r, 2, 0.0) < 0.8 * pairs  # a fast filler
    # a message (publish or acknowledgement) lies on the path between every two buckets
    t, h = full / r, 1e-4
    assert slot_pipeline([full] * 10, r, r, 2, h) == pytest.approx(11 * t + 9 * h)


def test_a_side_alone_copies_at_its_own_rate_while_the_other_waits():
    """``slot_pipeline``'s ``fill_alone`` / ``drain_alone``: while one side waits, the other
    has the host's memory to itself. Hand-computed: two full buckets through one slot run
    one side at a time, each at the alone rate (2 x as fast: 2 buckets' time, not 4); with
    two slots the first fill and the last drain run alone and the middle pair side by
    side. The stall of full/small alternation then shrinks; without alone rates it is the
    shared-rate pipeline as before."""
    r, full, small = 1e9, 1e6, 0.4e6
    t = full / r
    assert slot_pipeline([full, full], r, r, 1, 0.0) == pytest.approx(4 * t)
    assert slot_pipeline([full, full], r, r, 1, 0.0, fill_alone=2 * r,
                         drain_alone=2 * r) == pytest.approx(2 * t)
    assert slot_pipeline([full, full], r, r, 2, 0.0, fill_alone=2 * r,
                         drain_alone=2 * r) == pytest.approx(0.5 * t + t + 0.5 * t)
    uneven, even = [full, small] * 10, [(full + small) / 2] * 20

    def stall(**alone):
        return slot_pipeline(uneven, r, r, 2, 0.0, **alone) - \
            slot_pipeline(even, r, r, 2, 0.0, **alone)
    assert 0 < stall(fill_alone=1.5 * r, drain_alone=1.5 * r) < 0.8 * stall()


def test_buckets_that_alternate_full_and_part_full_stall_the_two_slot_ring():
    """Tensors of one bucket and of 0.4 bucket in turn: buckets alternate full and 40 %
    full, and the two-slot ring stalls on every full one; the same bytes as tensors of 0.7
    bucket fill every bucket (each starts in the free space the one before left) and cost
    what the fluid model says."""
    even = model_from_tensors("mlp", [(f"w{i}", (7 * MiB // 10,)) for i in range(20)])
    uneven = model_from_tensors("mlp", [(f"w{i}", (MiB // 2 if i % 2 == 0 else MiB // 5,))
                                        for i in range(40)])       # bf16: 1 and 0.4 MiB
    assert even.params == uneven.params
    new = ring(host_links(), model=even, bucket_size=MiB)
    old = ring(host_links(), model=uneven, bucket_size=MiB)
    assert new.dest_reads[0] < old.dest_reads[0]                     # fewer buckets
    assert old.seconds > 1.1 * new.seconds
    assert "slots" in old.bottleneck.limit and "slots" not in new.bottleneck.limit
    # a third slot absorbs most of it (weightsync plan --num-slots, WEIGHTSYNC_NUM_SLOTS)
    three = ring(host_links(), model=uneven, bucket_size=MiB, num_slots=3)
    assert new.seconds <= three.seconds < old.seconds
    with pytest.raises(PlannerError, match="num_slots"):
        ring(host_links(), model=uneven, num_slots=0)
    rc = main(["plan", "--model", "bench:synthetic-16MiB", "--links", "cpu-2core",
               "--strategies", "ring", "--num-slots", "3"])
    assert rc == 0


# ------------------------------------------------------------- cuda_ipc on one GPU

def gpu_links(**software) -> dict:
    return {"name": "one-gpu", "device": "gpu", "gpus_per_node": 8,
            "links": {"nic": {"GBps": 50.0}, "intra": {"GBps": 400.0},
                      "device_mem": {"GBps": 100.0}},
            "software": {**ZERO_SW, **software}}


def gpu_ring(shared: str, **kw):
    sc = Scenario(model=MODEL, links=load_links(kw.pop("links", gpu_links())), trainer_gpus=1,
                  replicas=1, placement="colocated", bucket_size=16 * MiB,
                  strategies=("ring",), shared=shared, **kw)
    return predict(sc).results["ring"]


def test_zero_copy_batches_double_as_the_engine_announces_them():
    """ZeroCopyMixin._pack: the first batch goes out at the bucket size, each next one at
    twice the one before, at most MAX_REF_ENTRIES tensors each."""
    sizes = [16 * MiB] * 4 + [MiB] * 8
    assert zero_copy_batches(sizes, 16 * MiB) == [[16 * MiB], [16 * MiB] * 2,
                                                  [16 * MiB] + [MiB] * 8]
    assert zero_copy_batches([1] * 2050, 1 << 30) == [[1] * 1024, [1] * 1024, [1] * 2]
    assert zero_copy_batches([], MiB) == []


def test_cuda_ipc_zero_copy_and_pushes_move_each_byte_once():
    """On one GPU the ring copies every byte twice through its memory (into the slot, out
    of it) and fills its pipeline with one bucket; zero-copy (receivers read the trainer's tensors) and pushes (the trainer writes
    the receivers') once. A cast (bf16 -> FP8) keeps the tensors out of zero-copy."""
    total = BIG + SMALL
    ring_ = gpu_ring("none")
    # + the pipeline's fill: one bucket packed, then copied out, before the fluid phase
    assert ring_.seconds == pytest.approx((2 * total + 2 * 16 * MiB) / 100e9, rel=1e-9)
    zc = gpu_ring("trainer")
    assert zc.seconds == pytest.approx(total / 100e9, rel=1e-9)
    assert any("zero-copy" in n for n in zc.notes)
    assert zc.dest_reads == [3.0]                   # three announced batches, no bucket
    push = gpu_ring("receivers")
    assert push.seconds == pytest.approx(total / 100e9, rel=1e-9)
    assert any("pushes" in n for n in push.notes)
    assert gpu_ring("both").seconds == push.seconds
    cast = gpu_ring("trainer", dst_dtype="float8_e4m3fn")
    assert cast.seconds == pytest.approx(gpu_ring("none", dst_dtype="float8_e4m3fn").seconds,
                                         rel=1e-9)


def test_cuda_ipc_host_costs_of_zero_copy_and_pushes():
    """tensor_us 10: zero-copy's first copy waits for its first batch to be announced (1
    tensor), the trainer's 12 tensors and 3 batches are host work beside the copies; a push
    waits for its first held batch (an eighth of a bucket: the first 16 MiB tensor), and
    the receiver goes through the 12 pushed tensors after the copies."""
    links = gpu_links(tensor_us=10, bucket_us=100)
    total = BIG + SMALL
    copy = total / 100e9
    zc = gpu_ring("trainer", links=links)
    assert zc.seconds == pytest.approx(max(copy, 12 * 10e-6 + 3 * 100e-6) + 10e-6, rel=1e-9)
    push = gpu_ring("receivers", links=links)
    assert push.seconds == pytest.approx(copy + 10e-6 + 12 * 10e-6, rel=1e-9)


def test_a_cuda_ipc_ring_adds_each_buckets_handoff_one_after_another():
    """software.handoff_us: each bucket of the GPU ring adds its slot's trip from trainer to
    receiver and back, after the copies (not hidden by them); zero-copy and pushes have no
    bucket and add nothing; a host ring (shm) ignores it; absent it is 0."""
    plain = gpu_ring("none")
    handed = gpu_ring("none", links=gpu_links(handoff_us=300))
    buckets = plain.dest_reads[0]
    assert buckets >= 2
    assert handed.seconds - plain.seconds == pytest.approx(buckets * 300e-6, rel=1e-9)
    slow = gpu_ring("none", links=gpu_links(handoff_us=10_000))   # it outlasts the copies
    assert "handoff" in slow.bottleneck.limit, slow.bottleneck
    for shared in ("trainer", "receivers"):
        assert gpu_ring(shared, links=gpu_links(handoff_us=300)).seconds == \
            gpu_ring(shared).seconds
    host = host_links()
    host["software"]["handoff_us"] = 300
    assert ring(host).seconds == ring(host_links()).seconds       # shm: no handoff
    assert load_links(gpu_links()).software["handoff_us"] == 0.0
    with pytest.raises(PlannerError, match=">= 0") as exc:
        load_links(gpu_links(handoff_us=-5))
    assert exc.value.field == "links.software.handoff_us"


def test_a_cuda_ipc_ring_adds_the_syncs_end_once():
    """software.finish_us: a GPU ring's sync ends with the trainer's closing message and the
    receivers' last acknowledgement, once, whatever the number of buckets or of the FSDP2
    export's steps; zero-copy and pushes (no slot) and a host ring (shm) add nothing; absent
    it is 0, negative a PlannerError naming it."""
    def result(finish_us: float, shared: str = "none", **kw):
        kw = {"trainer_gpus": 1, "bucket_size": 16 * MiB, **kw}
        sc = Scenario(model=MODEL, links=load_links(gpu_links(finish_us=finish_us)),
                      replicas=1, placement="colocated", strategies=("ring",),
                      shared=shared, **kw)
        return predict(sc).results["ring"]

    def seconds(finish_us: float, shared: str = "none", **kw) -> float:
        return result(finish_us, shared, **kw).seconds

    for bucket in (4 * MiB, 16 * MiB, 64 * MiB):
        assert seconds(2000, bucket_size=bucket) - seconds(0, bucket_size=bucket) == \
            pytest.approx(2000e-6, rel=1e-9)
    assert any("export exchanges" in n for n in result(0, trainer_gpus=2).notes)
    assert seconds(2000, trainer_gpus=2) - seconds(0, trainer_gpus=2) == \
        pytest.approx(2000e-6, rel=1e-9)
    for shared in ("trainer", "receivers"):
        assert seconds(2000, shared) == seconds(0, shared)
    host = host_links()
    host["software"]["finish_us"] = 2000
    assert ring(host).seconds == ring(host_links()).seconds       # shm: no such end
    assert load_links(gpu_links()).software["finish_us"] == 0.0
    with pytest.raises(PlannerError, match=">= 0") as exc:
        load_links(gpu_links(finish_us=-1))
    assert exc.value.field == "links.software.finish_us"


def test_a_cuda_ipc_ring_is_ordered_by_events_only():
    """cuda_ipc orders each bucket's copies with CUDA events (its host-ordered ``sync`` is
    gone): the trainer's packs never join its host work, so where that work is the limit
    the sync takes what the host work takes, and the planner has no other ordering to
    ask for. A links file that still names software.pack_wait_x loads; the number is not
    used."""
    slow = gpu_links(tensor_us=2000)                  # the trainer's host work is the limit
    event = gpu_ring("none", links=slow)
    assert "software of trainer rank 0" in event.bottleneck.limit
    assert gpu_ring("none", links=gpu_links(tensor_us=2000, pack_wait_x=1.5)).seconds == \
        event.seconds
    assert "pack_wait_x" not in load_links(gpu_links(pack_wait_x=1.5)).software
    with pytest.raises(TypeError, match="ring_sync"):
        gpu_ring("none", ring_sync="host")
