"""What weightsync's own tests use, importable by anyone testing a backend or a replica.

:mod:`~weightsync.testing.harness` runs real multi-process syncs and checks them byte for
byte (the conformance suite runs on it); :mod:`~weightsync.testing.toymodel` builds a
small Qwen2 from a config, with LoRA, prompts and batches, no download.
"""

from weightsync.testing.harness import GroupSpec, expected_tensors, make_tensors, run_group, same_bytes

__all__ = ["make_tensors", "expected_tensors", "run_group", "GroupSpec", "same_bytes"]
