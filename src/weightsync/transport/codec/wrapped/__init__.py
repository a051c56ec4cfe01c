"""One module per inner backend, each registering that backend's codec names when the
registry first asks for one of them (so a backend whose optional dependency is missing
makes only its own codec names unavailable, with its import error)."""
