"""A rollout that fails before it reads (its loader refuses, its check raises) does not
hold the trainer for the timeout, on every path that drives a sync: weightsync's own
manager, ms-swift's (test_swift_integration.py has the cluster run), verl's engine and
vLLM's native weight transfer. The failing rollout tells the group (``abort_receive``)
and every peer of that sync ends at once, with an error naming that rollout and carrying
its text."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("transformers")

from faultworkers import REFUSAL, FaultyRollout  # noqa: E402
from syncchecks import assert_matches  # noqa: E402
from weightsync.orchestration.manager import CheckpointEngineManager  # noqa: E402
from weightsync.integrations.ray.workers import HFRolloutWorker, ToyTrainerWorker  # noqa: E402
from weightsync.testing.toymodel import random_prompts, tiny_qwen2_config  # noqa: E402

CFG = tiny_qwen2_config(vocab_size=1001, hidden_size=64, intermediate_size=128)
PROMPTS = random_prompts(2, 6, vocab_size=1001)
T = 30.0          # engine timeout: a trainer left to wait for it fails the bounds below


def _gen(worker):
    return worker.generate(PROMPTS, max_new_tokens=5, return_logits=True)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("backend", ["shm", "collective"])
def test_manager_replica_that_fails_before_reading_is_isolated_at_once(backend):
    trainer = ToyTrainerWorker()
    trainer.build(CFG, lr=0.05)
    replicas = [HFRolloutWorker(CFG, seed=5), FaultyRollout(CFG, seed=6),
                HFRolloutWorker(CFG, seed=7)]
    with CheckpointEngineManager(backend, [trainer], replicas, bucket_size=64 << 10,
                                 timeout=T) as manager:
        trainer.train_step(1)
        assert manager.update_weights(1).ok
        replicas[1].arm("refuse")
        trainer.train_step(2)
        start = time.monotonic()
        report = manager.update_weights(2)
        took = time.monotonic() - start
        ref = trainer.reference(PROMPTS, 5)
        assert report.isolated == ["replica-1"], report.summary()
        (failed,) = report.failed
        assert REFUSAL in failed.error, failed.error
        assert report.completed == ["replica-0", "replica-2"]
        for r in (replicas[0], replicas[2]):
            assert_matches(_gen(r), ref, 2)
        # the trainer learnt of it from the rollout, not from its timeout (the re-run for
        # the other replicas included)
        assert took < T / 3, took


@pytest.mark.timeout(120)
def test_verl_stream_dropped_before_reading_ends_the_update_at_once():
    """verl's worker hands the stream to its server adapter, whose ``update_weights`` may
    fail before it reads (the server is gone): the stream, dropped with that failed call
    (or, if something still holds it, at the rollout's next ``prepare``), tells the
    trainer rank, and the next update (re-joined, as verl's cycle does) is exact."""
    import asyncio
    import threading

    import torch
    pytest.importorskip("verl.checkpoint_engine", reason="verl is not installed (make verl)")
    from verl.checkpoint_engine import CheckpointEngineRegistry as VerlRegistry

    import weightsync.integrations.verl  # noqa: F401 - registers weightsync-* in verl

    kw = {"bucket_size": 1 << 20, "timeout": T}
    trainer = VerlRegistry.new("weightsync-shm", is_master=True, **kw)
    rollouts = [VerlRegistry.new("weightsync-shm", **kw) for _ in range(2)]
    weights = [(f"w{i}", torch.full((64,), float(i))) for i in range(8)]

    async def update_weights(stream, fail):   # verl's server adapter, as it consumes it
        if fail:
            raise ConnectionError("the rollout server is gone")
        return {n: t.clone() async for n, t in stream}

    def update(step, fail):
        engines = [trainer] + rollouts
        tk, rk = type(trainer).build_topology(1, 2, [e.prepare() for e in engines])
        threads = [threading.Thread(target=e.init_process_group,
                                    kwargs={k: v[j] for k, v in rk.items()})
                   for j, e in enumerate(rollouts)]
        for t in threads:
            t.start()
        trainer.init_process_group(**{k: v[0] for k, v in tk.items()})
        for t in threads:
            t.join()
        out = {}

        def receive(j):
            try:
                out[j] = asyncio.run(update_weights(rollouts[j].receive_weights(step),
                                                    fail and j == 1))
            except Exception as exc:  # noqa: BLE001 - what each side saw is checked
                out[j] = (type(exc), str(exc))    # the failed call's frames are dropped
                if fail:          # verl's next update begins with prepare() everywhere
                    rollouts[j].prepare()

        threads = [threading.Thread(target=receive, args=(j,)) for j in range(2)]
        for t in threads:
            t.start()
        start = time.monotonic()
        try:
            asyncio.run(trainer.send_weights(iter(weights), global_steps=step))
            sent = None
        except Exception as exc:  # noqa: BLE001
            sent = exc
        took = time.monotonic() - start
        for t in threads:
            t.join()
        for e in engines:
            e.finalize()
        return sent, took, out

    try:
        sent, took, out = update(1, fail=True)
        assert sent is not None and "rollout rank 1" in str(sent), sent
        assert "dropped the weight stream" in str(sent), sent
        assert took < T / 3, took
        assert out[1][0] is ConnectionError and "rollout rank 1" in out[0][1], out
        sent, _, out = update(2, fail=False)
        assert sent is None, sent
        for j in range(2):
            assert all(torch.equal(out[j][n], t) for n, t in weights), j
    finally:
        for e in [trainer] + rollouts:
            e.close()


# -- ms-swift's manager, its actors in this process -------------------------------------------

class _Remote:
    """A stand-in for a Ray actor handle: each call runs on the actor's one thread (as a
    Ray actor runs its calls) and ``.remote()`` returns its future."""

    def __init__(self, obj):
        import concurrent.futures
        self.obj = obj
        self._pool = concurrent.futures.ThreadPoolExecutor(1)

    def __getattr__(self, name):
        import types
        method = getattr(self.obj, name)
        return types.SimpleNamespace(remote=lambda *a, **kw: self._pool.submit(method, *a, **kw))

    @property
    def primary(self):          # ms-swift's RolloutReplica
        return self


def _ray_get(refs):
    """``ray.get`` of a list: the values, or the first failure as soon as it is known."""
    import concurrent.futures
    done, _ = concurrent.futures.wait(refs, return_when=concurrent.futures.FIRST_EXCEPTION)
    for f in refs:
        if f in done and f.exception() is not None:
            raise f.exception()
    return [f.result() for f in refs]


def _swift_actors():
    import asyncio

    import torch
    from swift.ray.megatron.checkpoint_engine import CheckpointEngineMixin

    from weightsync.integrations.swift import WeightsyncCheckpointMixin

    weights = {f"layer{i}.weight": torch.full((32, 8), float(i)) for i in range(6)}

    class Megatron(CheckpointEngineMixin):    # what ms-swift's MegatronWorker does
        def send_checkpoint_weights(self, adapter_only=False):
            engine = self._get_or_create_checkpoint_engine()
            asyncio.run(engine.send_weights(iter(list(weights.items()))))

    class Trainer(WeightsyncCheckpointMixin, Megatron):
        weightsync_backend = "shm"
        weightsync_options = {"timeout": T}

        def weightsync_describe_weights(self, adapter_only):
            return [[n, list(t.shape), "float32"] for n, t in weights.items()]

        def merge_lora(self):     # no LoRA here
            pass

        unmerge_lora = merge_lora

        def stats(self):
            return self._get_or_create_checkpoint_engine().stats

    class VllmServer(CheckpointEngineMixin):  # what ms-swift's VllmServer does
        refuse = False
        got: dict = {}

        def receive_checkpoint_weights(self, base_sync_done=False, peft_config=None):
            engine = self._get_or_create_checkpoint_engine()
            stream = engine.receive_weights()
            if self.refuse:               # the loader refuses before it reads a byte
                raise RuntimeError(REFUSAL)

            async def load():
                return {n: t.clone() async for n, t in stream}

            self.got = asyncio.run(load())

    class Rollout(WeightsyncCheckpointMixin, VllmServer):
        weightsync_backend = "shm"
        weightsync_options = {"timeout": T}

        def weightsync_check_weights(self, offered, adapter_only, peft_config):
            return None               # every layout fits

    return weights, Trainer, Rollout


@pytest.mark.timeout(180)
@pytest.mark.parametrize("checked", [True, False], ids=["layout-check", "no-check"])
def test_swift_rollout_that_fails_before_reading_does_not_hold_trainer_rank_0(
        monkeypatch, checked):
    """ms-swift's real ``CheckpointEngineManager`` (its actors here, one thread each): a
    rollout whose ``receive_checkpoint_weights`` raises before it reads. ``sync_weights``
    raises at once (ms-swift's ``ray.get``), and trainer rank 0 is free right after too,
    with an error naming that rollout and carrying its text: where rank 0 waits for the
    rollouts' layout check, and where it already sends. The next sync is exact."""
    pytest.importorskip("swift.ray.megatron.checkpoint_engine",
                        reason="ms-swift is not installed (make swift)")
    import types

    import torch
    from swift.ray.megatron.checkpoint_engine import manager as swift_manager

    monkeypatch.setattr(swift_manager, "ray", types.SimpleNamespace(get=_ray_get))
    weights, Trainer, Rollout = _swift_actors()
    trainer, rollouts = Trainer(), [Rollout(), Rollout()]
    handles = [_Remote(a) for a in [trainer] + rollouts]
    if not checked:   # no description: rank 0 checks nothing and sends at once
        Trainer.weightsync_describe_weights = lambda self, adapter_only: None
    manager = swift_manager.CheckpointEngineManager(
        handles[:1], handles[1:], weight_sync_mode="weightsync", train_group=None)
    try:
        manager.sync_weights()
        rollouts[1].refuse = True
        start = time.monotonic()
        with pytest.raises(RuntimeError, match=REFUSAL):
            manager.sync_weights()
        error = trainer.stats()["last_error"]
        deadline = start + T
        while error is None and time.monotonic() < deadline:    # rank 0 still busy?
            time.sleep(0.05)
            error = trainer.stats()["last_error"]
        took = time.monotonic() - start
        assert error is not None and REFUSAL in error, error
        assert "ms-swift rank 2" in error, error
        assert took < T / 4, took
        rollouts[1].refuse = False
        manager.sync_weights()            # the group re-joins; the sync is exact
        for r in rollouts:
            assert all(torch.equal(r.got[n], t) for n, t in weights.items())
    finally:
        for a in [trainer] + rollouts:
            a._get_or_create_checkpoint_engine().close()


@pytest.mark.vllm
@pytest.mark.timeout(600)
def test_manager_vllm_replica_that_fails_before_reading_is_isolated_at_once(monkeypatch):
    """A vLLM replica whose worker fails before it reads (here: picking its loader) tells
    the group from the worker, so the manager isolates it at once and the HF replica
    gets the version."""
    pytest.importorskip("vllm")
    import weightsync.rollout.vllm.apply as apply
    from weightsync.integrations.ray.vllm_workers import VLLMRolloutWorker
    from weightsync.rollout.vllm.replica import VLLMOptions

    cfg = {**tiny_qwen2_config(vocab_size=1000), "max_position_embeddings": 512,
           "initializer_range": 0.2}
    prompts = random_prompts(2, 6, vocab_size=1000)
    trainer = ToyTrainerWorker()
    trainer.build(cfg, lr=0.05)
    vllm = VLLMRolloutWorker(cfg, seed=11, name="vllm-inproc",
                             options=VLLMOptions(multiprocess=False))
    hf = HFRolloutWorker(cfg, seed=5)
    try:
        with CheckpointEngineManager("shm", [trainer], [vllm, hf], bucket_size=64 << 10,
                                     timeout=T) as manager:
            trainer.train_step(1)
            assert manager.update_weights(1).ok

            def refuse(*args, **kwargs):
                raise RuntimeError(REFUSAL)

            monkeypatch.setattr(apply, "pick_loader", refuse)
            trainer.train_step(2)
            start = time.monotonic()
            report = manager.update_weights(2)
            took = time.monotonic() - start
            assert report.isolated == ["replica-0"], report.summary()
            assert REFUSAL in report.failed[0].error, report.failed[0].error
            assert_matches(hf.generate(prompts, max_new_tokens=5, return_logits=True),
                           trainer.reference(prompts, 5), 2)
            assert took < T / 3, took
    finally:
        vllm.close()
