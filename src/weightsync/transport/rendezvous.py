"""Set up a group of engines across processes with one call per process.

``connect`` does the whole lifecycle up to ``init_process_group`` through a small TCP
store hosted by trainer rank 0 at ``address``: every worker publishes its ``prepare()``
result, trainer rank 0 runs the backend's ``build_topology`` and publishes each worker's
keyword arguments, and every worker joins. All messages are JSON; every wait is bounded by
``timeout`` (``WEIGHTSYNC_TIMEOUT`` when not given, as for every engine).

Secure by default: the store binds to the interface of ``address`` only and refuses any
client without the job's token, which every process must be given (``token=`` or
``WEIGHTSYNC_TOKEN``; a random one, e.g. ``secrets.token_hex(16)``: a shorter one warns). There is no
built-in default token: what the store holds (the workers' store secrets, the topology
token) is readable by token holders only, and a worker with a wrong token joins nothing.
"""

from __future__ import annotations

import json
import logging
import warnings
from typing import Any, Optional

from weightsync.transport import CheckpointEngine, CheckpointEngineRegistry
from weightsync.transport.control.store import close_store, connect_store
from weightsync.transport.control.server import ControlClient, ControlServer, StoreTimeout
from weightsync.transport.base import validate_topology, worker_kwargs
from weightsync.core.config import env_value
from weightsync.core.errors import PeerFailed, SyncTimeout

__all__ = ["connect"]

logger = logging.getLogger(__name__)

MIN_TOKEN_CHARS = 16


def _parse(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"address must look like 'host:port', got {address!r}")
    return host, int(port)


def _job_token(token: Optional[str]) -> str:
    """The job's token: ``token=``, else ``WEIGHTSYNC_TOKEN``; none is a ``ValueError``."""
    if token is None:
        token = env_value("TOKEN", str, None)
    if not token:
        raise ValueError("connect() needs the job's token: pass token=... or set "
                         "WEIGHTSYNC_TOKEN to the same random string in every process of "
                         "the job (e.g. python -c 'import secrets; print(secrets.token_hex(16))')")
    if not isinstance(token, str):
        raise ValueError(f"the job's token must be a str, got {type(token).__name__}")
    if len(token) < MIN_TOKEN_CHARS:
        warnings.warn(f"a job token of fewer than {MIN_TOKEN_CHARS} characters is easy to "
                      "guess; use e.g. secrets.token_hex(16)", RuntimeWarning, stacklevel=3)
    return token


def _wait(store: ControlClient, keys: list[str], timeout: float, what: str) -> None:
    try:
        store.wait(keys, timeout)
    except ConnectionError as exc:  # trainer rank 0 (which hosts the store) went away
        raise PeerFailed(f"rendezvous: lost the store while waiting for {what} ({exc})",
                         peer="trainer rank 0", phase="rendezvous") from None
    except StoreTimeout:
        missing = [k.rsplit("/", 2)[-2:] for k in keys if not store.check([k])]
        raise SyncTimeout(f"rendezvous: {what} did not arrive within {timeout}s "
                          f"(missing: {missing[:8]})", phase="rendezvous",
                          peer="/".join(missing[0]) if missing else None) from None


def connect(backend: str, *, role: str, rank: int = 0, trainer_world_size: int = 1,
            rollout_world_size: int = 1, address: str = "127.0.0.1:29555",
            timeout: Optional[float] = None, token: Optional[str] = None,
            **engine_kwargs: Any) -> CheckpointEngine:
    """Create an engine of ``backend`` and join it to its group; returns it ready to sync.

    ``token`` (or ``WEIGHTSYNC_TOKEN``) is required: the same secret in every process.
    ``timeout`` defaults to ``WEIGHTSYNC_TIMEOUT`` (else 300 s), like the engine's own."""
    if role not in ("trainer", "rollout"):
        raise ValueError(f"role must be 'trainer' or 'rollout', got {role!r}")
    size = trainer_world_size if role == "trainer" else rollout_world_size
    if not isinstance(rank, int) or not 0 <= rank < size:
        raise ValueError(f"{role} rank {rank!r} out of range for world size {size}")
    host, port = _parse(address)
    token = _job_token(token)
    if timeout is not None:
        engine_kwargs["timeout"] = timeout
    engine = CheckpointEngineRegistry.new(backend, role=role, **engine_kwargs)
    timeout = engine.config.timeout      # keyword, else WEIGHTSYNC_TIMEOUT, else default
    store: Optional[ControlClient] = None
    try:
        if role == "trainer" and rank == 0:
            server = ControlServer(host, token.encode(), port=port)
            store = ControlClient(host, server.port, token.encode(), timeout, server=server)
        else:
            store = connect_store(host, port, token, timeout, peer="trainer rank 0",
                                  phase="rendezvous")
        _rendezvous(store, engine, backend, role, rank, trainer_world_size,
                    rollout_world_size, timeout)
    except BaseException:
        close_store(store)
        try:
            engine.finalize()
        except Exception:  # the original failure is what matters
            logger.debug("finalize after a failed connect failed", exc_info=True)
        raise
    close_store(store)
    return engine


def _rendezvous(store: ControlClient, engine: CheckpointEngine, backend: str, role: str,
                rank: int, trainer_world_size: int, rollout_world_size: int,
                timeout: float) -> None:
    """Publish ``prepare()``, (trainer rank 0:) build and publish the topology, join."""
    master = role == "trainer" and rank == 0
    prefix = f"weightsync/{backend}"
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
