"""Topology shared by the store-based engines (``shm``, ``collective``).

Each trainer rank hosts a small TCPStore in ``prepare()`` (a free port on the configured
interface, loopback by default) that carries its stream's control messages.
``build_topology`` hands every worker the addresses of all trainer stores and a fresh
random token; every key of the job lives under that token, and each new topology gets a
new one, so messages of an old group can never reach a new one.
"""

from __future__ import annotations

import os
import secrets
import socket
from typing import Any, Optional

from weightsync.core.errors import TopologyError
from weightsync.transport.control.store import (DRAIN_S, Inbox, close_store, connect_store,
                                                host_store, new_token)
from weightsync.transport.control.server import ControlClient
from weightsync.transport.protocol.ownership import Ownership
from weightsync.transport.base import check_topology, per_worker

__all__ = ["StoreGroupMixin"]


class StoreGroupMixin:
    """prepare / build_topology / joining for engines whose trainers host a store."""

    _server: Optional[ControlClient] = None

    def prepare(self) -> dict[str, Any]:
        meta = {"role": self.config.role, "hostname": socket.gethostname(), "pid": os.getpid(),
                "backend": self.backend_name}
        if self.config.role == "trainer":
            if self._server is None:
                self._auth = new_token()
                self._server = host_store(self.config.host, self.config.timeout, self._auth)
            meta.update(host=self.config.host, port=self._server.port, auth=self._auth)
        return meta

    @classmethod
    def _check_hosts(cls, metadata: list[dict[str, Any]]) -> None:
        """A backend without the ``multi_host`` capability needs every worker on one host."""
        hosts = {m.get("hostname") for m in metadata if isinstance(m, dict)}
        if "multi_host" not in cls.capabilities and len(hosts) > 1:
            raise TopologyError(f"{cls.backend_name or cls.__name__} needs every worker on one "
                                f"host, got {sorted(map(str, hosts))}", phase="build_topology")

    def init_process_group(self, **kwargs: Any) -> None:
        """Join the group, then set up this rank's side (``_init_sender``/``_init_receiver``)."""
        self._join(**kwargs)
        if self.config.role == "trainer":
            self._init_sender()
        else:
            self._init_receiver()

    @classmethod
    def build_topology(cls, trainer_world_size: int, rollout_world_size: int,
                       metadata: list[dict[str, Any]]):
        name = cls.backend_name or cls.__name__
        check_topology(name, trainer_world_size, rollout_world_size, metadata)
        for i, meta in enumerate(metadata[:trainer_world_size]):
            if not isinstance(meta, dict) or "port" not in meta or "auth" not in meta:
                raise TopologyError(
                    f"{name}: trainer rank {i} hosts no store; construct trainer engines "
                    "with role='trainer'", peer=f"trainer rank {i}", phase="build_topology")
        cls._check_hosts(list(metadata))
        common = {
            "world": trainer_world_size,
            "num_receivers": rollout_world_size,
            "streams": [[m["host"], int(m["port"]), m["auth"]]
                        for m in metadata[:trainer_world_size]],
            "token": secrets.token_hex(16),
        }
        trainers = [dict(common, role="trainer", rank=i) for i in range(trainer_world_size)]
        rollouts = [dict(common, role="rollout", rank=j) for j in range(rollout_world_size)]
        return per_worker(trainers), per_worker(rollouts)

    def _join(self, *, role: str, rank: int, world: int, num_receivers: int,
              streams: list, token: str) -> None:
        """Validate this worker's topology entry and open its control channels."""
        if role not in ("trainer", "rollout"):
            raise ValueError(f"role must be 'trainer' or 'rollout', got {role!r}")
        if self.config.role not in (None, role):
            raise ValueError(f"engine built with role={self.config.role!r} got a {role} entry")
        if not (isinstance(world, int) and world >= 1 and len(streams) == world):
            raise ValueError(f"world={world!r} does not match {len(streams)} stream addresses")
        bound = world if role == "trainer" else num_receivers
        if not (isinstance(rank, int) and 0 <= rank < bound):
            raise ValueError(f"{role} rank {rank!r} out of range [0, {bound})")
        if not isinstance(token, str) or len(token) < 16:
            raise ValueError("token must be the random string from build_topology")
        if self._rank >= 0:
            self._release()
        self.config.role = role
        self._rank, self._world, self._num_receivers = rank, world, num_receivers
        self._seq = 0
        self._errors_ahead: dict = {}   # receivers' reports of the old group
        self._token = token
        self._clients: list[ControlClient] = []
        self.reset_plan()
        t = self.config.timeout
        if role == "trainer":
            if self._server is None:
                raise TopologyError("init_process_group before prepare() on a trainer",
                                    phase="init")
            self._tx_inbox = Inbox(self._server, self._prefix(rank), "t", t,
                                   host=f"trainer rank {rank}")
            self._ownership = None
            if world > 1:
                store0 = self._server if rank == 0 else connect_store(
                    *streams[0], t, peer="trainer rank 0", phase="init")
                self._clients.append(store0)
                self._ownership = Ownership(store0, f"ws/{token}", rank, world, t)
            return
        self._rx_push, self._rx_pop = {}, {}
        for s, (host, port, auth) in enumerate(streams):
            store = connect_store(host, port, auth, t, peer=f"trainer rank {s}", phase="init")
            self._clients.append(store)
            self._rx_push[s] = Inbox(store, self._prefix(s), f"r{rank}", t,
                                     host=f"trainer rank {s}")
            self._rx_pop[s] = Inbox(store, self._prefix(s), f"r{rank}", t,
                                    host=f"trainer rank {s}")

    def _prefix(self, stream: int) -> str:
        return f"ws/{self._token}/s{stream}"

    # Per-bucket messages go over an engine's direct control links (``_hub`` on the
    # trainer, ``_links`` on receivers) when it opened them, else through the store.
    _hub: Any = None
    _links: dict = {}

    def _tx_control(self) -> Any:
        return self._hub if self._hub is not None else self._tx_inbox

    def _rx_control(self, stream: int) -> Any:
        return self._links.get(stream) or self._rx_push[stream]

    def _rx_pump_inbox(self, stream: int) -> Any:
        return self._links.get(stream) or self._rx_pop[stream]

    def _leave(self) -> None:
        """Close control channels (the store server survives until ``close_server``)."""
        inboxes = [getattr(self, "_tx_inbox", None)]
        inboxes += list(getattr(self, "_rx_push", {}).values())
        inboxes += list(getattr(self, "_rx_pop", {}).values())
        for inbox in inboxes:
            if inbox is not None:
                inbox.close()
        if getattr(self, "_ownership", None) is not None:
            # rank 0 hosts the store: let the other trainer ranks finish reading it first
            self._ownership.drain(min(self.config.timeout, DRAIN_S))
            self._ownership.close()
        for client in getattr(self, "_clients", []):
            if client is not self._server:
                client.close()
        self._tx_inbox, self._rx_push, self._rx_pop, self._clients = None, {}, {}, []
        self._ownership = None
        self._rank = -1

    def close_server(self) -> None:
        close_store(self._server)
        self._server = None
