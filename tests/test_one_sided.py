"""One-sided verdicts: a receiver's consumer stalls past the timeout at the end of a sync
(every byte in, its confirmation not sent yet) and then resumes. The trainer gives up on
its confirmation (``SyncTimeout``) while that receiver still completes the version with
exact bytes. The trainer's error says which receivers confirmed the version
(``exc.confirmed``), and the manager reconciles it with the replicas' own outcomes: a
replica whose receive completed holds the version (not fenced, reported updated, listed
in ``report.late``); the next sync rebuilds the group."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from weightsync.core.errors import SyncTimeout
from weightsync.transport import CheckpointEngineRegistry
from weightsync.transport.base import worker_kwargs

T = 4.0


def _group(backend: str):
    kw = {"bucket_size": 1 << 16, "timeout": T}
    cls = CheckpointEngineRegistry.get(backend)
    tr = cls(role="trainer", **kw)
    rxs = [cls(role="rollout", **kw) for _ in range(2)]
    tk, rk = cls.build_topology(1, 2, [e.prepare() for e in [tr] + rxs])
    threads = [threading.Thread(target=e.init_process_group, kwargs=worker_kwargs(rk, j))
               for j, e in enumerate(rxs)]
    for t in threads:
        t.start()
    tr.init_process_group(**worker_kwargs(tk, 0))
    for t in threads:
        t.join()
    return tr, rxs


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", ["collective", "shm"])
def test_trainer_error_lists_the_receivers_that_confirmed(backend):
    tr, rxs = _group(backend)
    items = [(f"t{i}", torch.randn(2048)) for i in range(24)]
    out: dict = {}

    def receive(j):
        async def run():
            got = {}
            async for name, t in rxs[j].receive_weights(version=1):
                got[name] = t.clone()
                if j == 1 and len(got) == len(items):
                    await asyncio.sleep(1.5 * T)      # every byte in, not confirmed yet
            return got
        try:
            out[j] = asyncio.run(run())
        except Exception as exc:  # noqa: BLE001 - checked below
            out[j] = exc

    threads = [threading.Thread(target=receive, args=(j,)) for j in range(2)]
    for t in threads:
        t.start()
    with pytest.raises(SyncTimeout) as info:
        asyncio.run(tr.send_weights(iter(items), version=1))
    for t in threads:
        t.join()
    assert info.value.confirmed == (0,), info.value
    assert "rollout ranks [0] confirmed" in str(info.value)
    for j in range(2):          # both hold the version, exactly: the stalled one too
        assert isinstance(out[j], dict), out[j]
        assert all(torch.equal(out[j][n], t) for n, t in items)
    for e in [tr] + rxs:
        e.finalize()


def test_blame_reads_a_late_confirmation_with_the_replicas_own_outcomes():
    """The rules behind the manager's verdict: a replica the trainer did not hear confirm,
    but whose own receive completed, is late (not a culprit, the trainer not at fault);
    one that did not complete is a culprit; ``confirmed`` lets every late one be listed,
    not only the rank the error names; the error survives pickling with its list."""
    import pickle

    from weightsync.orchestration.calls import Outcome
    from weightsync.orchestration.isolation import blame

    owners = {0: "replica-0", 1: "replica-1", 2: "replica-2"}
    err = SyncTimeout("rollout ranks [1, 2] did not acknowledge the sync in time",
                      peer="rollout rank 1", phase="send", version=2, confirmed=(0,))
    err = pickle.loads(pickle.dumps(err))
    assert err.confirmed == (0,) and "rollout ranks [0] confirmed the version" in str(err)
    ok = [Outcome(n, True, value={}) for n in owners.values()]
    v = blame([Outcome("trainer rank 0", False, error=err)], ok, owners)
    assert not v.failed and set(v.late) == {"replica-1", "replica-2"}
    hung = SyncTimeout("replica-2 did not answer in time", peer="replica-2")
    v = blame([Outcome("trainer rank 0", False, error=err)],
              ok[:2] + [Outcome("replica-2", False, error=hung)], owners)
    assert v.culprits.keys() == {"replica-2"} and set(v.late) == {"replica-1"}
    assert v.trainer_fault is None
    v = blame([Outcome("trainer rank 0", False, error=err)],
              [ok[0], Outcome("replica-1", False, error=hung), ok[2]], owners)
    assert "replica-1" in v.culprits and not v.late.keys() & {"replica-1"}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("backend", ["collective", "shm"])
def test_manager_keeps_a_replica_that_completed_after_the_trainer_gave_up(backend):
    """Under ``CheckpointEngineManager``: the stalled replica completed the version, so it
    is neither fenced nor isolated; it is reported updated (``report.late`` names it), and
    the next sync (on a rebuilt group) is exact on every replica."""
    pytest.importorskip("transformers")
    from faultworkers import FaultyRollout
    from syncchecks import assert_matches
    from weightsync.integrations.ray.workers import HFRolloutWorker, ToyTrainerWorker
    from weightsync.orchestration.manager import CheckpointEngineManager
    from weightsync.testing.toymodel import random_prompts, tiny_qwen2_config

    cfg = tiny_qwen2_config(vocab_size=1001, hidden_size=64, intermediate_size=128)
    prompts = random_prompts(2, 6, vocab_size=1001)
    trainer = ToyTrainerWorker()
    trainer.build(cfg, lr=0.05)
    replicas = [HFRolloutWorker(cfg, seed=5), FaultyRollout(cfg, seed=6)]
    count = len(trainer.ws_describe("full"))
    with CheckpointEngineManager(backend, [trainer], replicas, bucket_size=64 << 10,
                                 timeout=T) as manager:
        trainer.train_step(1)
        assert manager.update_weights(1).ok
        replicas[1].arm("stall", version=2, after=count, stall_s=1.5 * T)
        trainer.train_step(2)
        report = manager.update_weights(2)
        ref = trainer.reference(prompts, 5)
        assert report.ok and not report.isolated, report.summary()
        assert report.late == ["replica-1"], report.late
        assert manager.failed_replicas() == {}
        for r in replicas:            # both serve version 2, exactly, unfenced
            assert_matches(r.generate(prompts, max_new_tokens=5, return_logits=True), ref, 2)
        trainer.train_step(3)
        report = manager.update_weights(3)
        assert report.ok and report.rebuilt and not report.late, report.summary()
        ref = trainer.reference(prompts, 5)
        for r in replicas:
            assert_matches(r.generate(prompts, max_new_tokens=5, return_logits=True), ref, 3)
