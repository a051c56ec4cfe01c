"""griffe extension for the API reference: Sphinx roles in docstrings become code spans.

The docstrings cross-reference with Sphinx roles (``:class:`~weightsync.core.config.EngineConfig```);
Markdown shows them as ``EngineConfig`` in code, the last part only after ``~``.
"""

from __future__ import annotations

import re

from griffe import Extension, Object

ROLE = re.compile(r":(?:py:)?(?:class|func|meth|mod|attr|data|exc|obj|const):`(~?)([^`]+)`")


def _span(match: re.Match) -> str:
    target = match.group(2).strip()
    return f"`{target.rsplit('.', 1)[-1] if match.group(1) else target}`"


class SphinxRoles(Extension):
    """Rewrite every docstring's Sphinx roles once it is loaded."""

    def on_object(self, *, obj: Object, **kwargs) -> None:
        if obj.docstring is not None:
            obj.docstring.value = ROLE.sub(_span, obj.docstring.value)
