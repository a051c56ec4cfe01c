import os
import tempfile

import pytest

os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
# vLLM loads only weightsync's plugin, not the test venv's other vllm.general_plugins
# (ms-swift's takes seconds to import in every vLLM process and is not under test there)
os.environ.setdefault("VLLM_PLUGINS", "weightsync")


def pytest_collection_modifyitems(config, items):
    try:
        import torch
        has_cuda = torch.cuda.is_available()
    except Exception:  # pragma: no cover
        has_cuda = False
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(skip_gpu)


@pytest.fixture
def shm_segments():
    """Names of weightsync segments in /dev/shm (for leak checks)."""
    def list_them():
        try:
            return sorted(f for f in os.listdir("/dev/shm") if f.startswith("weightsync-"))
        except OSError:
            return []
    return list_them
