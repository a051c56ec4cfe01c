"""weightsync under ms-swift's real CheckpointEngineManager (ms-swift 4.6.0), over Ray on CPU.

One Ray cluster for the module (`tests/harness_swift.py`): 2 FSDP2
trainer ranks (rank 0 sends, rank -1 walks its collective export), 2 HF rollout replicas.
After every sync the rollouts' greedy tokens (and logits, bit for bit) equal the
reference built from the trainer's weights. The unit tests at the top need ms-swift but no
cluster; the fault tests come last (they kill a rollout).
"""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
import threading
import time

import pytest

pytest.importorskip("swift.ray.megatron.checkpoint_engine",
                    reason="ms-swift is not installed (make swift)")
pytest.importorskip("ray")

import torch  # noqa: E402
from swift.ray.megatron.checkpoint_engine import CheckpointEngineMixin  # noqa: E402
from swift.ray.megatron.checkpoint_engine import MasterMetadata, NCCLCheckpointEngine  # noqa: E402

from weightsync.core.errors import TopologyError  # noqa: E402
from weightsync.integrations import swift as ws  # noqa: E402
from weightsync.transport.registry import CheckpointEngineRegistry  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.timeout(600)]

TIMEOUT = 20.0
BACKENDS = [b for b in ("shm", "collective", "nixl") if b in CheckpointEngineRegistry.names()]


# -- without a cluster ----------------------------------------------------------------------

def test_an_early_report_no_receive_took_does_not_hold_the_next_sync():
    """A rollout's call reported (``begin_receive``) and then ended before its receive ran,
    while trainer rank 0 never answered (it never sent): the report is ended at once, not
    after its bound (2 x timeout + grace), and the next ``prepare`` does not wait either."""
    class Slow(ws.WeightsyncCheckpointMixin):
        weightsync_backend = "shm"
        weightsync_options = {"timeout": 30.0}

    trainer, rollout = Slow(), Slow()
    meta = trainer.prepare_checkpoint_engine(True)
    rollout.prepare_checkpoint_engine(False)
    rollout.init_checkpoint_process_group(rank=1, world_size=2, master_metadata=meta)
    engine = rollout._get_or_create_checkpoint_engine()
    engine.expect(adapter_only=False)
    call = engine.begin_receive()
    time.sleep(0.3)                      # the report is out, waiting for rank 0's answer
    assert call is not None and not call.report.done()
    start = time.monotonic()
    engine.end_receive(call)
    rollout.prepare_checkpoint_engine(False)
    took = time.monotonic() - start
    assert took < 30.0 / 4, took
    assert call.report.done() and engine.group is None
    for actor in (trainer, rollout):
        actor._get_or_create_checkpoint_engine().close()


def test_a_peft_config_that_fitted_is_not_checked_again():
    """The rollout's peft check runs before its report goes out, on every adapter sync:
    a config that fitted this engine's model is not checked again; another config is,
    and one that does not fit is checked (and refused) every time."""
    from weightsync.integrations.swift.mixin import _before_receive

    class Rollout(ws.WeightsyncCheckpointMixin):
        weightsync_backend = "shm"
        calls = 0

        def get_model_param_names(self):
            Rollout.calls += 1
            return ["m.q_proj.weight", "m.v_proj.weight"]

    actor, good = Rollout(), {"r": 4, "target_modules": ["q_proj"]}
    for _ in range(3):
        assert _before_receive(actor, True, good).intent["error"] is None
    assert Rollout.calls == 1
    other = dict(good, target_modules=["v_proj"])
    assert _before_receive(actor, True, other).intent["error"] is None and Rollout.calls == 2
    bad = dict(good, target_modules=["w_nope"])
    for n in (3, 4):
        assert "w_nope" in _before_receive(actor, True, bad).intent["error"]
        assert Rollout.calls == n
    actor.configure_weightsync("shm")       # a new engine checks afresh
    _before_receive(actor, True, good)
    assert Rollout.calls == 5
    actor._get_or_create_checkpoint_engine().close()


def _rollout_in_a_call(timeout: float, round_: int, report: object) -> tuple:
    """A rollout actor (``shm``, ``timeout``) whose receive call of ``round_`` took its
    report (``report``: None = go, else the refusal) and has not ended."""
    from weightsync.integrations.swift import engine as engine_mod

    class Quick(ws.WeightsyncCheckpointMixin):
        weightsync_backend = "shm"
        weightsync_options = {"timeout": timeout}

    rollout = Quick()
    rollout.prepare_checkpoint_engine(False)
    engine = rollout._get_or_create_checkpoint_engine()
    call = engine_mod._Call(round_)
    call.taken = True
    call.report.set_result(report)
    engine._call = call
    return rollout, engine, call


def test_a_last_call_that_never_ends_is_a_clear_error_at_the_next_prepare(monkeypatch):
    """The last round's call took its report and then hangs in the actor (neither moving
    bytes nor ending): the next ``prepare`` waits for it only up to its bound and says
    which round still runs, instead of starting the new round beside it."""
    from weightsync.core.errors import SyncTimeout
    from weightsync.integrations.swift import engine as engine_mod
    monkeypatch.setattr(engine_mod, "GRACE", 0.0)

    rollout, engine, call = _rollout_in_a_call(1.0, 7, None)
    start = time.monotonic()
    with pytest.raises(SyncTimeout, match="round 7 is still running"):
        rollout.prepare_checkpoint_engine(False)
    assert 0.9 < time.monotonic() - start < 5.0
    engine.end_receive(call)                 # once it ends, the next prepare goes ahead
    rollout.prepare_checkpoint_engine(False)
    engine.close()


def test_a_refused_last_call_that_ends_late_keeps_the_group():
    """The last round's call took its report, which trainer rank 0 refused (nothing moved),
    and the call is still on its way out when the next ``prepare`` comes (ms-swift's
    manager gives a sync up at its first failed call): ``prepare`` waits for it to end and
    keeps the group, as it does when the refused call ended first (CI caught a re-join)."""
    rollout, engine, call = _rollout_in_a_call(5.0, 3, "refused by trainer rank 0")
    engine.group, engine.members = "kept", ["a", "b"]
    engine._refused()                        # what the refused receive did
    ender = threading.Timer(0.3, engine.end_receive, args=(call,))
    ender.start()
    start = time.monotonic()
    rollout.prepare_checkpoint_engine(False)
    ender.join()
    assert time.monotonic() - start >= 0.25  # it waited for the call to end
    assert engine.group == "kept" and engine.stats["releases"] == 0
    engine.close()


def test_import_without_swift_names_the_fix():
    code = "import sys; sys.modules['swift'] = None; import weightsync.integrations.swift"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "needs ms-swift" in proc.stderr
    assert "pip install --no-deps ms-swift==4.6.0" in proc.stderr


class _Actor(ws.WeightsyncCheckpointMixin):
    weightsync_backend = "shm"
    weightsync_options = {"timeout": 5.0}


def test_host_auto_as_a_keyword_or_the_variable_is_this_nodes_ip(monkeypatch):
    from weightsync.integrations.swift import engine as swift_engine
    monkeypatch.setattr(swift_engine, "_node_ip", lambda: "10.1.2.3")   # what Ray would say
    monkeypatch.setenv("WEIGHTSYNC_HOST", "auto")
    for kw in ({}, {"host": "auto"}):
        e = ws.WeightsyncSwiftEngine("shm", **kw)
        try:
            assert e.host == "10.1.2.3" and e.options["host"] == "10.1.2.3"
        finally:
            e.close()


def test_call_shape_and_bad_input_before_anything_moves():
    assert NCCLCheckpointEngine.build_topology(2, 3, ["m"]) == \
        ws.WeightsyncSwiftEngine.build_topology(2, 3, ["m"])
    trainer, rollout = _Actor(), _Actor()
    meta = trainer.prepare_checkpoint_engine(True)       # ms-swift's own mixin methods
    assert rollout.prepare_checkpoint_engine(False) is None
    assert meta["round"] == 1 and meta["backend"] == "shm"
    with pytest.raises(ValueError, match="outside world_size 3"):
        rollout.init_checkpoint_process_group(rank=3, world_size=3, master_metadata=meta)
    with pytest.raises(ValueError, match="only it takes rank 0"):
        rollout.init_checkpoint_process_group(rank=0, world_size=3, master_metadata=meta)
    with pytest.raises(TopologyError, match="not weightsync's"):
        rollout.init_checkpoint_process_group(rank=1, world_size=3,
                                              master_metadata=MasterMetadata("127.0.0.1", 1))
    other = _Actor()
    other.configure_weightsync("collective")
    other.prepare_checkpoint_engine(False)
    with pytest.raises(TopologyError, match="configure both sides alike"):
        other.init_checkpoint_process_group(rank=1, world_size=3, master_metadata=meta)
    async def consume():
        async for _ in rollout._get_or_create_checkpoint_engine().receive_weights():
            pass
    with pytest.raises(RuntimeError, match="needs init_process_group"):
        asyncio.run(consume())
    lone = _Actor()                # a rank -1 trainer outside rank 0's torch.distributed world
    lone.prepare_checkpoint_engine(False)
    with pytest.raises(TopologyError, match="sends from its 2 torch.distributed ranks, but "
                                            "this rank -1 trainer is rank 0 of 1"):
        lone.init_checkpoint_process_group(rank=-1, world_size=3,
                                           master_metadata=dict(meta, trainers=2))
    with pytest.raises(TopologyError, match="gives 0 sending trainer ranks"):
        lone.init_checkpoint_process_group(rank=-1, world_size=3,
                                           master_metadata=dict(meta, trainers=0))
    for actor in (trainer, rollout, other, lone):
        actor._get_or_create_checkpoint_engine().close()
    with pytest.raises(ValueError, match="senders must be one of"):
        ws.WeightsyncSwiftEngine("shm", senders="some")
    with pytest.raises(ValueError, match="role"):
        ws.WeightsyncSwiftEngine("shm", role="trainer")
    with pytest.raises(ValueError, match="unknown backend"):
        ws.WeightsyncSwiftEngine("nccl")


def test_install_gives_ms_swift_classes_the_engine():
    from swift.ray.megatron.rollout.vllm_server import VllmServer

    class Plain(CheckpointEngineMixin):
        pass

    before = VllmServer.receive_checkpoint_weights
    ws.install()
    try:
        ws.install()   # idempotent
        engine = Plain()._get_or_create_checkpoint_engine()
        assert isinstance(engine, ws.WeightsyncSwiftEngine) and engine.backend == "collective"
        assert VllmServer.receive_checkpoint_weights.__wrapped__ is before
        assert VllmServer.weightsync_check_peft_config is not None
        assert VllmServer.weightsync_check_weights is not None
        engine.close()
    finally:
        ws.uninstall()
    assert VllmServer.receive_checkpoint_weights is before
    assert not hasattr(VllmServer, "weightsync_check_peft_config")
    assert not hasattr(VllmServer, "weightsync_check_weights")


def test_peft_config_problems():
    names = ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.gate_up_proj.weight"]
    assert ws.peft_config_problems({"r": 8, "target_modules": ["q_proj", "up_proj"]}, names) == []
    assert ws.peft_config_problems({"r": 8, "target_modules": "all-linear"}, names) == []
    assert ws.peft_config_problems({"r": 8, "target_modules": r".*\.q_proj"}, names) == []
    bad = ws.peft_config_problems({"r": 0, "target_modules": ["q_proj", "w9"]}, names)
    assert len(bad) == 2 and "r=0" in bad[0] and "['w9']" in bad[1]
    assert ws.peft_config_problems("x", names)


# -- through ms-swift's manager over Ray ------------------------------------------------------

@pytest.fixture(scope="module")
def cluster():
    from harness_swift import SwiftCluster
    c = SwiftCluster("shm", timeout=TIMEOUT, bucket_size=1 << 20)
    yield c
    c.shutdown()


def _lora():
    from weightsync.testing.toymodel import lora_config
    return lora_config(r=4, alpha=8)


def _check(cluster, prompts, lora_mode="merged", version=None) -> None:
    """Every rollout's greedy generation equals the trainer's reference, bit for bit."""
    ref = cluster.reference(prompts, 8, lora_mode=lora_mode)
    for i, gen in enumerate(cluster.generations(prompts, 8)):
        assert gen["tokens"] == ref["tokens"], f"rollout {i}: {gen['tokens']} != {ref['tokens']}"
        for got, want in zip(gen["logits"], ref["logits"]):
            assert torch.equal(got, want), f"rollout {i}: logits differ"
        if version is not None:
            assert gen["version"] == version
    assert ref["trainer_max_abs_diff"] < 1e-4   # the FSDP2 model itself agrees


def _trainer_log(cluster) -> list:
    import ray
    return ray.get(cluster.trainers[0].call_log.remote())


def _full_syncs(cluster, n: int):
    """``n`` full syncs of fresh weights through ms-swift's manager, each checked."""
    cluster.build(None)
    manager, prompts = cluster.manager(), cluster.prompts()
    for step in range(n):
        manager.sync_weights(merge_and_sync=True)
        _check(cluster, prompts, version=step + 1)
        cluster.train(step)
    return manager


@pytest.mark.parametrize("backend", BACKENDS)
def test_full_syncs_through_ms_swift_manager(cluster, backend):
    cluster.use_backend(backend, bucket_size=1 << 20, senders="all")
    manager = _full_syncs(cluster, 3)
    assert manager.base_sync_done
    stats = cluster.stats()
    assert [s["rank"] for s in stats] == [0, -1, 1, 2]
    for s in stats:                     # joined once; later syncs kept the group, and
        # their check used the reports that came with the hellos (one store round trip)
        assert (s["joins"], s["reuses"], s["releases"], s["syncs"], s["reported"]) == \
            (1, 2, 0, 3, 2), s
    # senders="all": the rank -1 trainer is in the group and sends its share, as rank 0
    sent = [s["sent_bytes"] for s in stats[:2]]
    assert min(sent) > 0.3 * sum(sent), sent


def test_a_rollout_reports_to_rank_0_before_it_gets_ready_to_load(cluster):
    """The mixin's wrapper sends the rollout's report (join + check) as the call begins, so
    a server that takes long to get ready (1 s here) does not hold rank 0 at its check once
    the rollouts accepted the layout (the second sync checks it: that check waits until
    the server is ready to load, its model no longer changing)."""
    cluster.use_backend("shm", bucket_size=1 << 20)
    cluster.build(None)
    manager, prompts = cluster.manager(), cluster.prompts()
    for step in range(2):
        manager.sync_weights(merge_and_sync=True)
        cluster.train(step)
    cluster._all("set_load_delay", cluster.rollouts, 1.0)
    manager.sync_weights(merge_and_sync=True)
    _check(cluster, prompts, version=3)
    rank0 = cluster.stats()[0]
    assert rank0["reported"] == 2 and rank0["check_s"] < 0.5, rank0
    cluster._all("set_load_delay", cluster.rollouts, 0.0)


def test_a_sync_right_after_a_refused_one_waits_for_a_rollouts_last_call(cluster):
    """ms-swift's manager gives a sync up at its first failed call, so the next sync's
    ``prepare`` can reach a rollout whose refused call still runs (here: still getting
    ready to load, 1 s). That call must not take the new round's report: ``prepare`` waits
    for it (bounded), and the next sync is exact."""
    import ray
    cluster.use_backend("shm", bucket_size=1 << 20)
    cluster.build(_lora())
    manager, prompts = cluster.manager(), cluster.prompts()
    manager.sync_weights(merge_and_sync=False)
    cluster.train(0)
    manager.sync_weights(merge_and_sync=False)
    bad = dict(ray.get(cluster.trainers[0].get_peft_config_dict.remote()),
               target_modules=["q_proj", "w_nope"])
    ray.get(cluster.trainers[0].set_peft_override.remote(bad))
    cluster._all("set_load_delay", cluster.rollouts[-1:], 1.0)
    try:
        cluster.train(1)
        with pytest.raises(Exception, match=r"target_modules \['w_nope'\]"):
            manager.sync_weights(merge_and_sync=False)
    finally:
        ray.get(cluster.trainers[0].set_peft_override.remote(None))
    manager.sync_weights(merge_and_sync=False)      # at once: the slow call still runs
    cluster._all("set_load_delay", cluster.rollouts, 0.0)
    _check(cluster, prompts, lora_mode="adapter", version=4)


def test_senders_master_is_ms_swift_topology(cluster):
    """``senders="master"`` (the default): trainer rank 0 alone sends (ms-swift's own
    topology); the rank -1 trainer walks its export and joins nothing."""
    cluster.use_backend("shm", bucket_size=1 << 20)
    _full_syncs(cluster, 2)
    stats = cluster.stats()
    assert stats[1]["syncs"] == stats[1]["joins"] == 0 and stats[0]["syncs"] == 2
    assert stats[0]["sent_bytes"] > 0 and stats[1]["sent_bytes"] == 0


def test_lora_merge_and_sync(cluster):
    cluster.use_backend("shm", bucket_size=1 << 20)
    cluster.build(_lora())
    manager, prompts = cluster.manager(), cluster.prompts()
    for step in range(2):
        cluster.train(step)
        manager.sync_weights(merge_and_sync=True)
        _check(cluster, prompts, lora_mode="merged")
    log = [x for x in _trainer_log(cluster) if not x.startswith("train")]
    assert log == ["merge_lora", "send:full", "unmerge_lora"] * 2
    assert not any(s["adapter"] for s in cluster.states())


def test_lora_adapter_only_after_base_sync(cluster):
    cluster.use_backend("collective", bucket_size=1 << 20)
    cluster.build(_lora())
    manager, prompts = cluster.manager(), cluster.prompts()
    manager.sync_weights(merge_and_sync=False)          # first: the base weights
    _check(cluster, prompts, lora_mode="merged")        # (LoRA B starts at zero)
    base = [s["last"]["bytes"] for s in cluster.states()]
    for step in range(2):
        cluster.train(step)
        manager.sync_weights(merge_and_sync=False)      # then adapter-only
        _check(cluster, prompts, lora_mode="adapter")
    states = cluster.states()
    assert all(s["adapter"] and s["last"]["kind"] == "adapter" for s in states)
    assert all(s["last"]["bytes"] < b / 10 for s, b in zip(states, base))
    log = [x for x in _trainer_log(cluster) if not x.startswith("train")]
    assert log == ["send:base", "send:adapter", "send:adapter"]


def test_colocated_sleep_wake_tags_and_level_cap(cluster):
    import ray
    cluster.use_backend("shm", bucket_size=1 << 20)
    cluster.build(None)
    manager, prompts = cluster.manager(colocated=True, sleep_level=2), cluster.prompts()
    assert manager.sleep_level == 1                     # ms-swift caps it when colocated
    for step in range(2):
        cluster.train(step)
        manager.sync_weights()                          # sleep(1), wake weights, sync
        assert all(s["sleeping"] == {"weights": False, "kv_cache": True}
                   for s in cluster.states())
        for actor in cluster.rollouts:                  # generation needs the KV cache too
            with pytest.raises(Exception, match="asleep"):
                ray.get(actor.generate.remote(prompts, 4))
        manager.wake_up_rollout(tags=["kv_cache"])      # what ms-swift does to generate
        _check(cluster, prompts)
        manager.sleep_rollout()
    for s in cluster.states():
        log = [x for x in s["log"] if x.startswith(("sleep", "wake"))]
        assert log == ["sleep:1", "wake_up:weights", "wake_up:kv_cache"] * 2 + ["sleep:1"], log


def test_adapter_only_before_any_base_sync_is_refused(cluster):
    cluster.use_backend("shm", bucket_size=1 << 20)
    cluster.build(_lora())                              # fresh rollouts: no base weights
    manager, prompts = cluster.manager(), cluster.prompts()
    manager.base_sync_done = True                       # as if the rollouts had restarted
    start = time.monotonic()
    with pytest.raises(Exception, match="adapter-only sync before any base sync") as err:
        manager.sync_weights(merge_and_sync=False)
    assert time.monotonic() - start < TIMEOUT
    assert "ms-swift rank 1" in str(err.value) and "ms-swift rank 2" in str(err.value)
    assert all(s["version"] is None and not s["last"] for s in cluster.states())  # no byte
    manager.base_sync_done = False
    manager.sync_weights(merge_and_sync=False)          # base, then adapter: fine
    cluster.train(0)
    manager.sync_weights(merge_and_sync=False)
    _check(cluster, prompts, lora_mode="adapter")
    stats = cluster.stats()
    assert stats[0]["refused"] == 1 and stats[0]["joins"] == 1   # the group survived it


def test_peft_config_that_does_not_fit_is_refused(cluster):
    import ray
    cluster.use_backend("shm", bucket_size=1 << 20)
    cluster.build(_lora())
    manager, prompts = cluster.manager(), cluster.prompts()
    manager.sync_weights(merge_and_sync=False)
    cluster.train(0)
    manager.sync_weights(merge_and_sync=False)
    before = [s["version"] for s in cluster.states()]
    bad = dict(ray.get(cluster.trainers[0].get_peft_config_dict.remote()),
               target_modules=["q_proj", "w_nope"])
    ray.get(cluster.trainers[0].set_peft_override.remote(bad))
    try:
        cluster.train(1)
        with pytest.raises(Exception, match=r"target_modules \['w_nope'\]"):
            manager.sync_weights(merge_and_sync=False)
        assert [s["version"] for s in cluster.states()] == before   # nothing loaded
    finally:
        ray.get(cluster.trainers[0].set_peft_override.remote(None))
    manager.sync_weights(merge_and_sync=False)
    _check(cluster, prompts, lora_mode="adapter")


# -- names, shapes and dtypes checked before bytes (issue 18, item 3) -------------------------

def _layout_entries():
    return [["b.weight", [4, 2], "float32"], ["a.weight", [3], "float32"],
            ["c.idx", [2], "int64"]]


def _tensors():
    return [("b.weight", torch.zeros(4, 2)), ("a.weight", torch.zeros(3)),
            ("c.idx", torch.zeros(2, dtype=torch.int64))]


def test_layout_digest_and_cast():
    from weightsync.integrations.swift.layout import Layout
    a = Layout.of(_layout_entries(), None)
    b = Layout.of(list(reversed(_layout_entries())), None)
    assert a.digest == b.digest and a.entries[0][0] == "a.weight"      # order-free
    assert Layout.of(_layout_entries(), None, previous=a) is a           # reused when equal
    parts = [Layout(e, "described") for e in (_layout_entries()[:2], _layout_entries()[1:])]
    both = Layout.union(parts)          # every sender's part; a name from two ranks once
    assert both.digest == a.digest and both.source == "described"
    with pytest.raises(ValueError, match=r"trainer ranks yield 'a.weight' as \[\[3\]"):
        Layout.union([a, Layout([["a.weight", [4], "float32"]], "recorded")])
    half = Layout.of(_layout_entries(), torch.bfloat16)                  # the engine's cast
    assert half.by_name["a.weight"][2] == "bfloat16" and half.by_name["c.idx"][2] == "int64"
    assert half.digest != a.digest
    with pytest.raises(ValueError, match="twice"):
        Layout.of(_layout_entries() + [["a.weight", [3], "float32"]], None)
    with pytest.raises(ValueError, match="want \\[name, shape, dtype\\]"):
        Layout.of([["a.weight", [3]]], None)


@pytest.mark.parametrize("edit, match", [
    ({"op": "rename", "name": "a.weight", "to": "z.weight"},
     "'z.weight' which the checked layout does not have"),
    ({"op": "drop", "name": "a.weight"}, "'a.weight' nowhere: the export ended without it"),
    ({"op": "add", "name": "x.weight", "shape": [2]}, "'x.weight' which the checked layout"),
    ({"op": "reshape", "name": "b.weight"}, r"'b.weight' with shape \(8,\), the checked "
                                            r"layout has \(4, 2\)"),
    ({"op": "retype", "name": "a.weight", "dtype": "int32"},
     "'a.weight' with dtype int32, the checked layout has float32"),
])
def test_layout_feed_holds_the_export_to_the_checked_layout(edit, match):
    from weightsync.core.errors import PlanMismatch
    from weightsync.integrations.swift.layout import Layout, LayoutFeed
    from harness_swift import edit_export, edit_layout
    expected = Layout.of(_layout_entries(), None)
    feed = LayoutFeed(iter(_tensors()), expected, None, version=3)
    assert [n for n, _ in feed] == ["b.weight", "a.weight", "c.idx"]
    assert feed.layout() is expected and not feed.deviated
    recorded = LayoutFeed(iter(_tensors()), None, None)
    for _ in recorded:
        pass
    assert recorded.layout().digest == expected.digest and recorded.layout().source == "recorded"
    bad = LayoutFeed(edit_export(iter(_tensors()), edit), expected, None, version=3)
    with pytest.raises(PlanMismatch, match=match) as err:
        for _ in bad:
            pass
    assert bad.deviated and bad.layout() is None
    assert err.value.phase == "send" and err.value.version == 3
    # the harness edits a description the same way it edits the export
    assert Layout.of(edit_layout(_layout_entries(), edit), None).entries == sorted(
        [n, list(t.shape), str(t.dtype).replace("torch.", "")]
        for n, t in edit_export(iter(_tensors()), edit))

    async def consume():                     # an async export is held to it alike
        async def gen():
            for item in edit_export(iter(_tensors()), edit):
                yield item
        async for _ in LayoutFeed(gen(), expected, None):
            pass
    with pytest.raises(PlanMismatch, match=match):
        asyncio.run(consume())


def test_default_check_of_a_vllm_server_reads_its_checkpoint(tmp_path):
    """ms-swift's VllmServer has no weightsync replica: its layout check reads the
    safetensors headers of the local folder its RayVllmEngine was started from."""
    from types import SimpleNamespace
    from transformers import AutoModelForCausalLM, Qwen2Config
    from weightsync.integrations.swift.layout import default_check_weights
    from weightsync.testing.toymodel import tiny_qwen2_config
    from weightsync.trainer.digests import describe_export
    config = tiny_qwen2_config(vocab_size=128, hidden_size=32)
    model = AutoModelForCausalLM.from_config(Qwen2Config(**config))
    model.save_pretrained(tmp_path)
    server = SimpleNamespace(_engine=SimpleNamespace(model_id=str(tmp_path)))
    good = describe_export(model, "full")
    assert default_check_weights(server, good, False, None) == []
    bad = [[n, s[::-1] if n.endswith("mlp.up_proj.weight") else s, d] for n, s, d in good[1:]]
    problems = default_check_weights(server, bad, False, None)
    assert ["model.embed_tokens.weight", "the model has it, the sync would not send it"] \
        in problems
    assert any(n == "model.layers.1.mlp.up_proj.weight" and "shape" in why
               for n, why in problems)
    hub = SimpleNamespace(_engine=SimpleNamespace(model_id="Qwen/Qwen2.5-0.5B"))
    assert default_check_weights(hub, good, False, None) is None      # cannot tell: unchecked


_LATE = "model.layers.1.mlp.down_proj.weight"      # late in the export: earlier ones would move
_EDITS = {
    "rename": ({"op": "rename", "name": _LATE, "to": "model.layers.1.mlp.down.weight"},
               r"model\.layers\.1\.mlp\.down\.weight \(sent, but the model has no such"),
    "drop": ({"op": "drop", "name": _LATE}, rf"{_LATE} \(the model has it, the sync would not"),
    "add": ({"op": "add", "name": "model.layers.9.extra.weight", "shape": [4]},
            r"model\.layers\.9\.extra\.weight \(sent, but the model has no such"),
    "reshape": ({"op": "reshape", "name": _LATE}, rf"{_LATE} \(shape \(22528,\) sent"),
    "retype": ({"op": "retype", "name": _LATE, "dtype": "int32"}, rf"{_LATE} \(dtype int32"),
}


def _digests(cluster, kind="full"):
    import ray
    return ray.get([a.weights_digest.remote(kind) for a in cluster.rollouts], timeout=60)


def _on_trainers(cluster, method, *args):
    import ray
    ray.get([getattr(t, method).remote(*args) for t in cluster.trainers], timeout=60)


@pytest.mark.parametrize("case", sorted(_EDITS))
def test_wrong_export_is_refused_before_any_byte(cluster, case):
    """Trainer rank 0 describes its weights (metadata only): a tensor renamed, missing,
    extra, reshaped or of a dtype the rollout cannot take is refused for every rollout,
    naming it, before any byte moves; the rollouts keep their weights."""
    edit, match = _EDITS[case]
    cluster.use_backend("shm", bucket_size=1 << 20)
    cluster.build(None)
    _on_trainers(cluster, "set_describe", True)
    manager, prompts = cluster.manager(), cluster.prompts()
    manager.sync_weights()
    cluster.train(0)                        # what a partial sync would change
    before, states = _digests(cluster), cluster.states()
    _on_trainers(cluster, "set_export_edit", edit)
    start = time.monotonic()
    with pytest.raises(Exception, match=match) as err:
        manager.sync_weights()
    assert time.monotonic() - start < TIMEOUT
    text = str(err.value)
    assert "PlanMismatch" in text and "refused before any byte moved" in text
    assert "ms-swift rank 1" in text and "ms-swift rank 2" in text and "phase=validate" in text
    assert _digests(cluster) == before                              # not a byte
    assert [s["version"] for s in cluster.states()] == [s["version"] for s in states]
    _on_trainers(cluster, "set_export_edit", None)
    manager.sync_weights()                  # the group survived; the layout checked once
    _check(cluster, prompts)
    stats = cluster.stats()
    assert stats[0]["layout"] == "described" and stats[0]["refused"] == 1
    assert [s["checks"] for s in stats[2:]] == [2, 2]     # the good layout, then the bad one


def test_wrong_adapter_is_refused_before_any_byte(cluster):
    import ray
    cluster.use_backend("shm", bucket_size=1 << 20)
    cluster.build(_lora())
    _on_trainers(cluster, "set_describe", True)
    manager, prompts = cluster.manager(), cluster.prompts()
    manager.sync_weights(merge_and_sync=False)          # base
    cluster.train(0)
    manager.sync_weights(merge_and_sync=False)          # adapter
    names = [e[0] for e in ray.get(cluster.trainers[0].weightsync_describe_weights.remote(True))]
    late = [n for n in names if n.endswith("lora_B.weight")][-1]
    cluster.train(1)
    before = _digests(cluster, "adapter")
    _on_trainers(cluster, "set_export_edit", {"op": "reshape", "name": late})
    with pytest.raises(Exception, match=rf"{late.replace('.', '[.]')} \(shape"):
        manager.sync_weights(merge_and_sync=False)
    assert _digests(cluster, "adapter") == before
    _on_trainers(cluster, "set_export_edit", None)
    manager.sync_weights(merge_and_sync=False)
    _check(cluster, prompts, lora_mode="adapter")


def test_rollout_of_another_model_is_refused_before_any_byte(cluster):
    """No description (as ms-swift's MegatronWorker): trainer rank 0 checks against what
    its last complete send yielded; a rollout of another model is refused, naming the
    tensors, before any byte moves; rollouts that accepted the layout are not asked again."""
    import ray
    cluster.use_backend("shm", bucket_size=1 << 20)
    cluster.build(None)
    manager, prompts = cluster.manager(), cluster.prompts()
    manager.sync_weights()                              # first pass: records the layout
    assert cluster.stats()[0]["layout"] is None
    manager.sync_weights()                              # checked by both rollouts
    other = dict(cluster.config, intermediate_size=cluster.config["intermediate_size"] + 8)
    ray.get(cluster.rollouts[1].reset.remote(config=other))
    cluster.train(0)
    before = _digests(cluster)
    with pytest.raises(Exception, match=r"mlp\.up_proj\.weight \(shape \(352, 64\) sent") as err:
        manager.sync_weights()
    assert "ms-swift rank 2" in str(err.value) and "refused before any byte moved" in str(err.value)
    assert _digests(cluster) == before
    ray.get(cluster.rollouts[1].reset.remote(config=cluster.config))
    manager.sync_weights()
    manager.sync_weights()
    _check(cluster, prompts)
    stats = cluster.stats()
    assert stats[0]["layout"] == "recorded"
    assert [s["checks"] for s in stats[2:]] == [1, 1]     # each rollout engine checked once


def test_export_that_changes_after_its_check_fails_naming_the_tensor(cluster):
    """Without a description, a trainer whose export changes between syncs is caught at
    the first tensor that differs from the checked layout (bytes before it have moved);
    the next sync learns the new layout."""
    cluster.use_backend("shm", bucket_size=1 << 20)
    cluster.build(None)
    manager, prompts = cluster.manager(), cluster.prompts()
    manager.sync_weights()
    new = "model.layers.1.mlp.down.weight"
    _on_trainers(cluster, "set_export_edit", {"op": "rename", "name": _LATE, "to": new})
    with pytest.raises(Exception, match=rf"export yields '{new}' which the checked layout "
                                        "does not have"):
        manager.sync_weights()
    _on_trainers(cluster, "set_export_edit", None)
    manager.sync_weights()                              # unchecked first pass again
    manager.sync_weights()
    _check(cluster, prompts)


# -- every trainer rank sends (senders="all") ------------------------------------------------

def _shares(cluster):
    import ray
    return [[e[0] for e in ray.get(t.weightsync_describe_weights.remote(False), timeout=60)]
            for t in cluster.trainers]


def test_wrong_export_of_a_rank_minus_1_sender_is_refused_before_any_byte(cluster):
    """The rank -1 trainer describes its own share; one of its tensors reshaped is refused
    for every rollout, naming it, before any byte moves (rank 0 checks every sender's
    part); the next good sync lands."""
    import ray
    cluster.use_backend("shm", bucket_size=1 << 20, senders="all")
    cluster.build(None)
    _on_trainers(cluster, "set_describe", True)
    manager, prompts = cluster.manager(), cluster.prompts()
    manager.sync_weights()
    mine0, mine1 = _shares(cluster)
    assert mine1 and not set(mine0) & set(mine1)        # each name from one rank
    late = mine1[-1]
    cluster.train(0)
    before = _digests(cluster)
    ray.get(cluster.trainers[1].set_export_edit.remote({"op": "reshape", "name": late}))
    with pytest.raises(Exception, match=rf"{re.escape(late)} \(shape") as err:
        manager.sync_weights()
    assert "refused before any byte moved" in str(err.value)
    assert _digests(cluster) == before
    ray.get(cluster.trainers[1].set_export_edit.remote(None))
    manager.sync_weights()
    _check(cluster, prompts)


def test_rank_minus_1_export_that_changes_after_its_check_fails_naming_it(cluster):
    """No description: every sender is held to what its last complete send yielded; a
    tensor of the rank -1 trainer renamed fails the sync naming that trainer and tensor;
    the next syncs learn the layout again and land."""
    import ray
    cluster.use_backend("shm", bucket_size=1 << 20, senders="all")
    cluster.build(None)
    manager, prompts = cluster.manager(), cluster.prompts()
    manager.sync_weights()
    _on_trainers(cluster, "set_describe", True)
    late = _shares(cluster)[1][-1]
    _on_trainers(cluster, "set_describe", False)
    new = late + "_renamed"
    ray.get(cluster.trainers[1].set_export_edit.remote({"op": "rename", "name": late,
                                                        "to": new}))
    with pytest.raises(Exception, match=rf"trainer rank 1's export yields '{re.escape(new)}' "
                                        "which the checked layout does not have"):
        manager.sync_weights()
    ray.get(cluster.trainers[1].set_export_edit.remote(None))
    manager.sync_weights()
    manager.sync_weights()
    _check(cluster, prompts)


# -- faults last (they kill a rollout) -------------------------------------------------------

def test_killed_rollout_actor_is_named_within_the_timeout(cluster):
    import ray
    cluster.use_backend("shm", bucket_size=1 << 20)
    cluster.build(None)
    manager = cluster.manager()
    manager.sync_weights()
    ray.get(cluster.rollouts[1].set_die_after.remote(3))   # dies inside the next sync
    cluster.train(0)
    start = time.monotonic()
    with pytest.raises(Exception) as err:
        manager.sync_weights()
    took = time.monotonic() - start
    assert took < TIMEOUT + 15, took
    assert "SwiftRollout" in str(err.value)             # Ray names the dead actor
    deadline = time.monotonic() + TIMEOUT + 15          # and trainer rank 0 is not left hanging:
    stats = cluster.trainers[0].weightsync_stats
    while not (error := ray.get(stats.remote(), timeout=TIMEOUT + 15)["last_error"]):
        assert time.monotonic() < deadline, "trainer rank 0 is still sending"
        time.sleep(0.5)
    assert "rollout rank 1 = ms-swift rank 2 (SwiftRollout" in error, error
    start = time.monotonic()
    with pytest.raises(Exception, match="SwiftRollout|died|dead") as err:   # dead before it
        manager.sync_weights()
    assert time.monotonic() - start < TIMEOUT + 15

