"""Moved to ``tests/harness_verl.py`` of the weightsync repository: a test harness (verl's
manager driven on CPU), not part of the library."""

raise ImportError("weightsync.integrations.verl_harness moved to tests/harness_verl.py of the "
                  "weightsync repository (a test harness, not part of the library)")
