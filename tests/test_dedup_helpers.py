"""The helpers that replaced copies: ``execute_on_engine`` (every
``execute_checkpoint_engine``), ``SyncFence`` as the one "may this replica generate"
(``blocked``, with ``torn`` for the vLLM replica), and the shared direct-tensor predicate
and bookkeeping (``DirectTensors``) of ``shm`` and ``collective``. In-process, no peers."""

import types

import pytest
import torch

from weightsync.core.aio import AsyncRunner
from weightsync.rollout.protocol import SyncFence, execute_on_engine
from weightsync.transport.protocol.sender import DirectTensors


class _Engine:
    config = types.SimpleNamespace(timeout=5.0)

    def plain(self, x, *, y=1):
        return x + y

    async def coro(self, x):
        return 2 * x

    async def stream(self):
        yield 1

    def _private(self):
        return "no"


def test_execute_on_engine_calls_public_methods_and_runs_coroutines():
    runner = AsyncRunner("test-exec")
    try:
        eng = _Engine()
        assert execute_on_engine(eng, "plain", [1], {"y": 2}, runner) == 3
        assert execute_on_engine(eng, "coro", (4,), {}, runner, peer="p") == 8
        for bad in ("_private", "missing", "config", 3):
            with pytest.raises(ValueError, match="no public method"):
                execute_on_engine(eng, bad, (), {}, runner)
        with pytest.raises(ValueError, match="async iterator"):
            execute_on_engine(eng, "stream", (), {}, runner)
    finally:
        runner.close()


def test_sync_fence_without_torn_is_the_protocol_reason():
    fence = SyncFence()
    assert fence.blocked is None
    fence.begin(1, ["base", "adapter"])
    assert "in progress" in fence.blocked
    assert fence.round_done(1, "base") is False and "lacks" in fence.blocked
    assert fence.round_done(1, "adapter") is True and fence.blocked is None
    fence.start_round(2, "full")
    assert "did not complete" in fence.blocked
    fence.fence("digest mismatch")
    assert fence.blocked == "digest mismatch" and fence.torn is None
    fence.reason = None          # what the reliability tests' bypass does
    assert fence.blocked is None


def test_sync_fence_torn_wins_and_applied_clears_it():
    fence = SyncFence()
    fence.tear("half loaded")
    assert fence.blocked == "half loaded"
    fence.begin(3, ["full"])
    assert fence.blocked == "half loaded"          # torn first, then the protocol
    previous = fence.torn
    fence.tear("v3 did not complete")
    fence.tear(previous)                            # a failure that left weights intact
    assert fence.blocked == "half loaded"
    fence.tear(None)
    assert "in progress" in fence.blocked           # still waiting for version 3
    fence.tear("v3 did not complete")
    assert fence.applied(3, "full") is True
    assert fence.blocked is None and fence.torn is None


class _Direct(DirectTensors):
    def __init__(self, on, minimum):
        self.on, self._direct_min, self._rank, self.sent = on, minimum, 0, []

    def _direct_on(self):
        return self.on

    def _direct_deliver(self, state, msg, tensor):
        self.sent.append((msg.entries[0].name, msg.index, msg.nbytes))


def test_direct_tensors_predicate_and_bookkeeping():
    big = torch.zeros(256)                     # 1 KiB of float32
    eng = _Direct(True, 1024)
    state = types.SimpleNamespace(seq=7, version="v", tensors=0, nbytes=0)

    def ok(engine, tensor, dtype):
        return engine._tx_direct_ok(state, "t", tensor, dtype)
    assert ok(eng, big, torch.float32)
    assert not ok(eng, big, torch.bfloat16)              # needs a cast
    assert not ok(eng, big[::2], torch.float32)          # not contiguous
    assert not ok(eng, torch.zeros(255), torch.float32)  # too small
    assert not ok(_Direct(False, 0), big, torch.float32)
    eng._tx_direct(state, "a", big, torch.float32)
    eng._tx_direct(state, "b", big, torch.float32)
    (_, i1, n1), (_, i2, _) = eng.sent
    assert i2 == i1 + 1 and n1 == 1024 and (state.tensors, state.nbytes) == (2, 2048)
