"""Moved to ``tests/harness_swift.py`` of the weightsync repository: a test harness
(ms-swift's manager driven on CPU), not part of the library."""

raise ImportError("weightsync.integrations.swift_harness moved to tests/harness_swift.py of "
                  "the weightsync repository (a test harness, not part of the library)")
