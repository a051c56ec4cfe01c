"""The orchestration layer: :class:`~.manager.CheckpointEngineManager` and what it uses
(replica records and group set-up, calls with timeouts, isolation rules, checks, reports).
Reaches transports only through the registry.
"""
