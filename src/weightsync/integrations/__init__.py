"""Adapters that plug weightsync into RL frameworks.

Each submodule needs its framework installed and is imported explicitly, e.g.
``weightsync.integrations.verl`` (verl's ``custom_backend_module``).
"""
