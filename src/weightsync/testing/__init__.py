"""For authors of a backend or a replica: test it the way weightsync tests its own.

:mod:`~weightsync.testing.harness` runs real multi-process syncs and checks them byte for
byte (weightsync's conformance suite runs every backend through it: register yours and
call :func:`run_group` with a :class:`GroupSpec`); :mod:`~weightsync.testing.toymodel`
builds a small Qwen2 from a config, with LoRA, prompts and batches, no download (``weightsync
demo`` runs on it). The project's own test harnesses (verl, ms-swift) live in its
``tests/`` folder.
"""

from weightsync.testing.harness import GroupSpec, expected_tensors, make_tensors, run_group, same_bytes

__all__ = ["make_tensors", "expected_tensors", "run_group", "GroupSpec", "same_bytes"]
