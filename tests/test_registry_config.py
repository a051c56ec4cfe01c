import os

import pytest
import torch

from weightsync import (BackendUnavailable, CheckpointEngineRegistry, EngineConfig,
                        TopologyError)
from weightsync.transport.base import CheckpointEngine


def test_names_and_lazy_import_error_is_kept():
    assert {"inproc", "shm", "collective"} <= set(CheckpointEngineRegistry.names())
    CheckpointEngineRegistry.register_lazy("broken_test_backend", "weightsync._no_such_module")
    assert "broken_test_backend" not in CheckpointEngineRegistry.names()
    with pytest.raises(BackendUnavailable, match="_no_such_module"):
        CheckpointEngineRegistry.get("broken_test_backend")
    with pytest.raises(ValueError, match="unknown backend"):
        CheckpointEngineRegistry.get("nope")


def test_register_decorator_and_new():
    @CheckpointEngineRegistry.register("dummy_test_backend")
    class Dummy(CheckpointEngine):
        def prepare(self): return {}
        @classmethod
        def build_topology(cls, a, r, m): return [{}] * a, [{}] * r
        def init_process_group(self, **kw): pass
        async def send_weights(self, named_tensors, version=None): return {}
        async def receive_weights(self, version=None):
            if False:
                yield None
        def finalize(self): pass

    e = CheckpointEngineRegistry.new("dummy_test_backend", bucket_size=1024)
    assert isinstance(e, Dummy) and e.config.bucket_size == 1024
    with pytest.raises(ValueError, match="already registered"):
        CheckpointEngineRegistry.register("dummy_test_backend")(type("Other", (Dummy,), {}))
    with pytest.raises(ValueError, match="unknown option"):
        CheckpointEngineRegistry.new("dummy_test_backend", bucket_sise=1024)


@pytest.mark.parametrize("kwargs", [
    {"bucket_size": 1000}, {"bucket_size": 0}, {"bucket_size": True}, {"timeout": 0},
    {"timeout": "x"}, {"dtype": torch.int8}, {"num_slots": 0}, {"role": "boss"},
    {"device": "warp"}, {"host": ""},
])
def test_config_rejects_bad_values(kwargs):
    with pytest.raises(ValueError):
        EngineConfig(**kwargs)


def test_config_reads_env_at_construction(monkeypatch):
    monkeypatch.setenv("WEIGHTSYNC_BUCKET_SIZE", str(1 << 20))
    monkeypatch.setenv("WEIGHTSYNC_TIMEOUT", "7.5")
    cfg = EngineConfig()
    assert cfg.bucket_size == 1 << 20 and cfg.timeout == 7.5
    assert EngineConfig(bucket_size=4096).bucket_size == 4096  # keyword wins
    monkeypatch.setenv("WEIGHTSYNC_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="WEIGHTSYNC_TIMEOUT"):
        EngineConfig()
    assert EngineConfig(timeout=3, dtype="bfloat16").dtype == torch.bfloat16


def test_build_topology_checks_sizes():
    cls = CheckpointEngineRegistry.get("shm")
    with pytest.raises(TopologyError, match="expected 1 trainer \\+ 2 rollout"):
        cls.build_topology(1, 2, [{}])
    with pytest.raises(TopologyError, match="hosts no store"):
        cls.build_topology(1, 1, [{"role": None}, {"role": "rollout"}])
    with pytest.raises(TopologyError, match="one host"):
        cls.build_topology(1, 1, [{"host": "h", "port": 1, "auth": "t", "hostname": "a"},
                                  {"hostname": "b"}])
    with pytest.raises(ValueError):
        cls.build_topology(0, 1, [{}])
