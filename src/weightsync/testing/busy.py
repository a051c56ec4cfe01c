"""Moved to ``tests/busytrainer.py`` of the weightsync repository: ``BusyTrainer`` is a
test double of the project's own elastic-join tests, not part of the library."""

raise ImportError("weightsync.testing.busy (BusyTrainer) moved to tests/busytrainer.py of the "
                  "weightsync repository (a test double, not part of the library)")
