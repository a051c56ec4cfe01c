"""Set up a group of engines across processes with one call per process.

``connect`` does the whole lifecycle up to ``init_process_group`` through a small TCP
store hosted by trainer rank 0 at ``address``: every worker publishes its ``prepare()``
result, trainer rank 0 runs the backend's ``build_topology`` and publishes each worker's
keyword arguments, and every worker joins. All messages are JSON; every wait is bounded by
``timeout``. The store binds to the interface of ``address`` only and refuses any client
without the job token (``token=`` or ``WEIGHTSYNC_TOKEN``; set one on shared machines).
"""

from __future__ import annotations

import json
import os
from typing import Any, Optional

from weightsync.transport import CheckpointEngine, CheckpointEngineRegistry
from weightsync.transport.control.store import close_store, connect_store
from weightsync.transport.control.server import ControlClient, ControlServer, StoreTimeout
from weightsync.transport.base import validate_topology, worker_kwargs
from weightsync.core.errors import SyncTimeout

__all__ = ["connect"]


def _parse(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"address must look like 'host:port', got {address!r}")
    return host, int(port)


def _wait(store: ControlClient, keys: list[str], timeout: float, what: str) -> None:
    try:
        store.wait(keys, timeout)
    except (StoreTimeout, ConnectionError):
        missing = [k.rsplit("/", 2)[-2:] for k in keys if not store.check([k])]
        raise SyncTimeout(f"rendezvous: {what} did not arrive within {timeout}s "
                          f"(missing: {missing[:8]})", phase="rendezvous",
                          peer="/".join(missing[0]) if missing else None) from None


def connect(backend: str, *, role: str, rank: int = 0, trainer_world_size: int = 1,
            rollout_world_size: int = 1, address: str = "127.0.0.1:29555",
            timeout: float = 300.0, token: Optional[str] = None,
            **engine_kwargs: Any) -> CheckpointEngine:
    """Create an engine of ``backend`` and join it to its group; returns it ready to sync."""
    if role not in ("trainer", "rollout"):
        raise ValueError(f"role must be 'trainer' or 'rollout', got {role!r}")
    size = trainer_world_size if role == "trainer" else rollout_world_size
    if not isinstance(rank, int) or not 0 <= rank < size:
        raise ValueError(f"{role} rank {rank!r} out of range for world size {size}")
    host, port = _parse(address)
    token = token or os.environ.get("WEIGHTSYNC_TOKEN") or "weightsync-local"
    master = role == "trainer" and rank == 0
    if master:
        server = ControlServer(host, token.encode(), port=port)
        store = ControlClient(host, server.port, token.encode(), timeout, server=server)
    else:
        store = connect_store(host, port, token, timeout, peer="trainer rank 0",
                              phase="rendezvous")
    prefix = f"weightsync/{backend}"
    engine = CheckpointEngineRegistry.new(backend, role=role, timeout=timeout, **engine_kwargs)
    store.set(f"{prefix}/meta/{role}/{rank}", json.dumps(engine.prepare()))
    workers = [("trainer", i) for i in range(trainer_world_size)] + \
              [("rollout", j) for j in range(rollout_world_size)]
    if master:
        keys = [f"{prefix}/meta/{r}/{i}" for r, i in workers]
        _wait(store, keys, timeout, "prepare() results")
        metas = [json.loads(store.get(k)) for k in keys]
        tk, rk = type(engine).build_topology(trainer_world_size, rollout_world_size, metas)
        validate_topology(backend, "trainer", tk, trainer_world_size)
        validate_topology(backend, "rollout", rk, rollout_world_size)
        for r, i in workers:
            kw = worker_kwargs(tk if r == "trainer" else rk, i)
            store.set(f"{prefix}/kw/{r}/{i}", json.dumps(kw))
    _wait(store, [f"{prefix}/kw/{role}/{rank}"], timeout, "the topology")
    kwargs = json.loads(store.get(f"{prefix}/kw/{role}/{rank}"))
    store.set(f"{prefix}/joined/{role}/{rank}", b"1")
    engine.init_process_group(**kwargs)
    if master:  # keep the store up until everybody has read its entry
        _wait(store, [f"{prefix}/joined/{r}/{i}" for r, i in workers], timeout, "joins")
    close_store(store)
    return engine
