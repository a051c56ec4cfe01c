"""The planner's one error type: bad input, named by the field it came from.

Owns :class:`PlannerError`; every module of :mod:`weightsync.tools.planner` raises it for
input it cannot plan (unknown architecture, a layout whose sizes do not divide, a links
file with a missing or negative number). ``weightsync plan`` prints it and exits 2.
"""

from __future__ import annotations

__all__ = ["PlannerError"]


class PlannerError(ValueError):
    """Input the planner cannot use; ``field`` names where it came from (e.g.
    ``links.nic.GBps``, ``rollout.tp``, ``model``)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message
