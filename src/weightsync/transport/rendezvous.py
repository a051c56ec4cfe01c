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

import hashlib
import json
import logging
import time
import warnings
from typing import Any, Optional

from weightsync.transport import CheckpointEngine, CheckpointEngineRegistry
from weightsync.transport.control.store import close_store, connect_store, new_token
from weightsync.transport.control.server import ControlClient, ControlServer, StoreTimeout
from weightsync.transport.base import validate_topology, worker_kwargs
from weightsync.core.config import env_value
from weightsync.core.errors import PeerFailed, SyncTimeout

__all__ = ["connect", "RolloutRelay", "group_id", "TAKEN_OVER"]

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


def _key(backend: str, what: str, role: str, rank: int) -> str:
    """The store key of one worker's ``what`` (``meta``: its ``prepare()``, ``kw``: its
    ``init_process_group`` keywords, ``joined``)."""
    return f"weightsync/{backend}/{what}/{role}/{rank}"


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
    ``delta=True|False|"auto"`` and ``quantize="fp8-block"|"fp8-tensor"|None`` (or
    ``WEIGHTSYNC_DELTA`` / ``WEIGHTSYNC_QUANTIZE``) put the codec layer over ``backend``
    (``"shm"`` with ``delta=True`` is ``"delta+shm"``); every process must agree.
    ``timeout`` defaults to ``WEIGHTSYNC_TIMEOUT`` (else 300 s), like the engine's own.
    The other keywords go to the engine: :class:`~weightsync.core.config.EngineConfig`'s
    and the backend's options, as keywords (``zero_copy=True``) or as one object
    (``options=CudaIpcOptions(zero_copy=True)``; a list may add a ``CodecOptions``)."""
    if role not in ("trainer", "rollout"):
        raise ValueError(f"role must be 'trainer' or 'rollout', got {role!r}")
    size = trainer_world_size if role == "trainer" else rollout_world_size
    if not isinstance(rank, int) or not 0 <= rank < size:
        raise ValueError(f"{role} rank {rank!r} out of range for world size {size}")
    host, port = _parse(address)
    token = _job_token(token)
    if timeout is not None:
        engine_kwargs["timeout"] = timeout
    from weightsync.transport.codec import CodecOptions, resolve_backend, split_backend_name
    backend, codec_kw = resolve_backend(backend, delta=engine_kwargs.pop("delta", None),
                                        quantize=engine_kwargs.pop("quantize", "unset"),
                                        options=engine_kwargs.get("options"))
    objects = engine_kwargs.get("options")
    if isinstance(objects, (list, tuple)) and not split_backend_name(backend)[0]:
        # a plain transport after all: codec options that asked for nothing are dropped
        objects = [o for o in objects if not isinstance(o, CodecOptions)]
        engine_kwargs["options"] = objects[0] if len(objects) == 1 else (objects or None)
    elif isinstance(objects, CodecOptions) and not split_backend_name(backend)[0]:
        engine_kwargs["options"] = None
    engine = CheckpointEngineRegistry.new(backend, role=role, **engine_kwargs, **codec_kw)
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
    store.set(_key(backend, "meta", role, rank), json.dumps(engine.prepare()))
    workers = [("trainer", i) for i in range(trainer_world_size)] + \
              [("rollout", j) for j in range(rollout_world_size)]
    if master:
        keys = [_key(backend, "meta", r, i) for r, i in workers]
        _wait(store, keys, timeout, "prepare() results")
        metas = [json.loads(store.get(k)) for k in keys]
        tk, rk = type(engine).build_topology(trainer_world_size, rollout_world_size, metas)
        validate_topology(backend, "trainer", tk, trainer_world_size)
        validate_topology(backend, "rollout", rk, rollout_world_size)
        for r, i in workers:
            kw = worker_kwargs(tk if r == "trainer" else rk, i)
            store.set(_key(backend, "kw", r, i), json.dumps(kw))
    _wait(store, [_key(backend, "kw", role, rank)], timeout, "the topology")
    kwargs = json.loads(store.get(_key(backend, "kw", role, rank)))
    store.set(_key(backend, "joined", role, rank), b"1")
    engine.init_process_group(**kwargs)
    if master:  # keep the store up until everybody has read its entry
        _wait(store, [_key(backend, "joined", r, i) for r, i in workers], timeout, "joins")


#: How a receiver whose group another client replaced refuses a sync of the old group.
TAKEN_OVER = "another client re-initialized this receiver's weight transfer"


def group_id(token: str) -> str:
    """A name for the group joined with ``token`` that does not reveal the token (a
    receiver that joined through a relay can be asked which group it is in)."""
    return hashlib.sha256(f"weightsync-group:{token}".encode()).hexdigest()[:24]


class RolloutRelay:
    """The store side of :func:`connect` for rollout workers whose group someone else builds.

    A process that cannot call ``prepare`` / ``init_process_group`` on its receiving
    engines itself (they live in another process it reaches only through a call that runs
    ``connect(role="rollout", rank=j, rollout_world_size=len(ranks), address=self.address,
    token=self.token)`` there, e.g. a ``vllm serve`` process's weight-transfer backend)
    hosts this store instead of trainer rank 0: :meth:`metas` returns the workers'
    ``prepare()`` results (for the caller's own ``build_topology``, e.g. the manager's),
    :meth:`publish` hands each worker its ``init_process_group`` keywords, and the workers
    then join the caller's group. ``ranks`` is the number of workers that join here
    (their ranks in ``connect`` are 0..ranks-1). Every wait is bounded; the store binds
    ``host`` only and checks a random per-relay token; :meth:`close` makes every worker
    still waiting fail at once (``PeerFailed``: the store went away).
    """

    def __init__(self, backend: str, ranks: int, *, timeout: float,
                 host: str = "127.0.0.1") -> None:
        if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1:
            raise ValueError(f"ranks must be an int >= 1, got {ranks!r}")
        if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or timeout <= 0:
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        self.backend, self.ranks, self.timeout = backend, ranks, float(timeout)
        self.token = new_token()
        server = ControlServer(host, self.token.encode())
        self._store: Optional[ControlClient] = ControlClient(host, server.port,
                                                             self.token.encode(),
                                                             self.timeout, server=server)
        self.address = f"{host}:{server.port}"

    def _keys(self, what: str) -> list[str]:
        return [_key(self.backend, what, "rollout", j) for j in range(self.ranks)]

    def _client(self) -> ControlClient:
        if self._store is None:
            raise RuntimeError("the relay is closed")
        return self._store

    def _wait_for(self, what: str, keys: list[str], timeout: float, abort: Any) -> None:
        """Wait (bounded) for ``keys``, in slices; ``abort()`` raising stops early."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                self._client().wait(keys, min(0.2, max(0.0, deadline - time.monotonic())))
                return
            except StoreTimeout:
                if abort is not None:
                    abort()
                if time.monotonic() >= deadline:
                    missing = [k.rsplit("/", 1)[-1] for k in keys if not self._client().check([k])]
                    raise SyncTimeout(f"rendezvous: {what} of rollout rank(s) {missing} did not "
                                      f"arrive within {timeout:.0f} s", phase="rendezvous",
                                      peer=f"rollout rank {missing[0]}" if missing else None
                                      ) from None

    def metas(self, timeout: Optional[float] = None, abort: Any = None) -> list[dict]:
        """Every worker's ``prepare()`` result, in rank order (bounded by ``timeout``)."""
        keys = self._keys("meta")
        self._wait_for("prepare() results", keys, self.timeout if timeout is None else timeout,
                       abort)
        return [json.loads(self._client().get(k)) for k in keys]

    def publish(self, kwargs_list: list, timeout: Optional[float] = None,
                abort: Any = None) -> None:
        """Hand worker ``j`` its ``init_process_group`` keywords ``kwargs_list[j]`` and wait
        (bounded) until every worker has read them."""
        if not isinstance(kwargs_list, (list, tuple)) or len(kwargs_list) != self.ranks:
            raise ValueError(f"publish needs {self.ranks} keyword dicts (one per worker), "
                             f"got {kwargs_list!r:.200}")
        for key, kw in zip(self._keys("kw"), kwargs_list):
            self._client().set(key, json.dumps(dict(kw)))
        self._wait_for("joins", self._keys("joined"),
                       self.timeout if timeout is None else timeout, abort)

    def close(self) -> None:
        store, self._store = self._store, None
        close_store(store)
