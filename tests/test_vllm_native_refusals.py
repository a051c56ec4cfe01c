"""vLLM's native weight transfer (``weightsync-<backend>``): a worker that refuses a version
never holds the trainer for the timeout. The weight set is checked in its own call before
the trainer sends a byte, and the loader runs only once the whole version arrived, so a
check that raises or a loader that refuses fails ``send_weights`` at once, with the
worker's error, and the old weights keep serving; the next sync lands on the same group."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("vllm")
pytest.importorskip("transformers")

from vllm.distributed.weight_transfer.base import ModuleSource  # noqa: E402

import weightsync.integrations.vllm_native.engine as native  # noqa: E402
from test_vllm_native import OPTS, _gen, _offline, _ref, _tokens, _trainer  # noqa: E402
from vllmhelpers import CFG, vllm_home  # noqa: E402
from weightsync.integrations.vllm_native import OfflineLLMClient  # noqa: E402
from weightsync.rollout.hf import build_causal_lm  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]
REFUSAL = "injected: the worker refuses this version"


def _refuse(*args, **kwargs):
    raise RuntimeError(REFUSAL)


def test_a_worker_that_refuses_fails_the_trainer_at_once(monkeypatch):
    with vllm_home(CFG, seed=1, prefix="wsvllm-refuse-") as folder:
        llm = _offline(folder, "weightsync-shm")
        try:
            client = OfflineLLMClient(llm)
            good = build_causal_lm(CFG, seed=2)
            engine = _trainer(client, ModuleSource(good))
            engine.send_weights(weight_version="good")
            before = _tokens(_gen(llm))
            assert before == _ref(good)
            for target in ("check_offered", "apply_weights"):   # the check, the loader
                good.load_state_dict(build_causal_lm(CFG, seed=3).state_dict())
                with monkeypatch.context() as patch:
                    patch.setattr(native, target, _refuse)
                    start = time.monotonic()
                    with pytest.raises(Exception, match=REFUSAL):
                        engine.send_weights(weight_version=f"refused-{target}")
                    assert time.monotonic() - start < OPTS["timeout"] / 3, target
                assert _tokens(_gen(llm)) == before and llm.get_weight_version() == "good"
            engine.send_weights(weight_version="again")
            assert _tokens(_gen(llm)) == _ref(good) and llm.get_weight_version() == "again"
            engine.shutdown()
        finally:
            llm.llm_engine.engine_core.shutdown()
