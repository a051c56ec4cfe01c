"""A NIXL agent as the ``nixl`` backend uses it: register memory once, read remote memory
with prepared, replayable transfers, every wait bounded.

NIXL (``pip install nixl``) is imported on first use; without it the backend is
:class:`~weightsync.core.errors.BackendUnavailable` with the install line. One agent per
engine; its metadata (the connection info peers need to read from it) travels base64 in a
:class:`~weightsync.core.wire.SourceMsg`, never pickled. A :class:`Reads` object is the
compiled plan's reads from one remote agent, turned into one NIXL transfer handle that
every sync re-posts (``transfer`` on a finished handle starts it again), so a warm sync
costs one call per source rank, not one per tensor.
"""

from __future__ import annotations

import base64
import logging
import os
import threading
import time
from typing import Any, Callable, Optional, Sequence

import torch

from weightsync.core.errors import BackendUnavailable, PeerFailed, SyncTimeout

__all__ = ["NixlAgent", "Poller", "Reads", "mem_type", "wait_all", "ucx_transports",
           "require_nixl"]

logger = logging.getLogger(__name__)


def mem_type(device: torch.device) -> str:
    """NIXL's name for where a tensor lives."""
    return "VRAM" if torch.device(device).type == "cuda" else "DRAM"


def require_nixl() -> None:
    """``BackendUnavailable`` (with the install line) when NIXL cannot be imported."""
    _import_nixl()


#: UCX's own pick on a host without RDMA devices is TCP even between two processes of one
#: host, about a third of the rate of shared memory and cross-memory attach. Used when
#: UCX_TLS is unset, no RDMA device exists and
#: ``NixlOptions.ucx_tls`` is ``auto``.
HOST_TLS = "tcp,cma,sm,self"


def _choose_transports(want: str = "auto") -> None:
    """Pick UCX transports before the first UCX context of this process, once: an explicit
    ``UCX_TLS`` wins, then ``want`` (``NixlOptions.ucx_tls``): ``ucx`` leaves UCX's own
    choice, ``auto`` uses :data:`HOST_TLS` only where there is no RDMA device (and so
    nothing faster to lose), anything else becomes ``UCX_TLS``."""
    want = want.strip()
    if "UCX_TLS" in os.environ or want == "ucx":
        return
    if want != "auto":
        os.environ["UCX_TLS"] = want
    elif not (os.path.isdir("/sys/class/infiniband") and os.listdir("/sys/class/infiniband")):
        os.environ["UCX_TLS"] = HOST_TLS + ",cuda_copy,cuda_ipc" if _has_cuda() else HOST_TLS
    if "UCX_TLS" in os.environ:
        logger.info("weightsync nixl: UCX_TLS=%s", os.environ["UCX_TLS"])


def _has_cuda() -> bool:
    return torch.cuda.is_available()


def _import_nixl() -> Any:
    try:
        from nixl._api import nixl_agent, nixl_agent_config
    except ImportError as exc:
        raise BackendUnavailable(
            f"the nixl backend needs NIXL: pip install 'weightsync[nixl]' ({exc})") from None
    return nixl_agent, nixl_agent_config


class NixlAgent:
    """One NIXL agent (UCX backend) of one engine.

    ``progress_thread``: NIXL's own progress thread, which polls UCX without pause (NIXL's
    Python config sets its delay to 0: one core busy for each agent, idle or not). Without it, UCX moves only when this agent is called: an agent
    that only reads (a receiver) does so as it polls its reads; one that is read from
    must call :meth:`progress` while it may be (at least until the reader's first read
    has connected). ``ucx_tls``: the UCX transports the process's first agent picks
    (``NixlOptions.ucx_tls``).
    """

    def __init__(self, name: str, *, progress_thread: bool = True, ucx_tls: str = "auto") -> None:
        nixl_agent, nixl_agent_config = _import_nixl()
        _choose_transports(ucx_tls)
        # NIXL logs every agent start at INFO through its own logger: keep ours readable
        logging.getLogger("nixl").setLevel(logging.WARNING)
        self.name = name
        self.progress_thread = bool(progress_thread)
        if progress_thread:
            conf = nixl_agent_config(backends=["UCX"])
        else:   # calls may then come from a poller thread too (serving): NIXL locks each
            from nixl._api import nixl_thread_sync_t
            conf = nixl_agent_config(enable_prog_thread=False, backends=["UCX"],
                                     sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT)
        self._agent = nixl_agent(name, conf)
        self._regs: list[Any] = []
        self._remotes: dict[str, str] = {}     # agent name -> NIXL's handle name

    def progress(self) -> None:
        """Let UCX move (connections, transfers) on an agent without a progress thread."""
        if self._agent is not None and not self.progress_thread:
            self._agent.get_new_notifs()

    # -- memory ---------------------------------------------------------------------------
    def register(self, tensor: torch.Tensor) -> Any:
        """Register a contiguous tensor's bytes until :meth:`deregister` (or :meth:`close`);
        returns the registration (``None`` for an empty tensor)."""
        if not tensor.is_contiguous():
            raise ValueError("only contiguous memory can be registered")
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes == 0:
            return None
        dev = (tensor.device.index or 0) if tensor.device.type == "cuda" else 0
        reg = self._agent.register_memory([(tensor.data_ptr(), nbytes, dev, "")],
                                          mem_type(tensor.device))
        self._regs.append(reg)
        return reg

    def deregister(self, reg: Any) -> None:
        if reg is None or self._agent is None:
            return
        self._regs = [r for r in self._regs if r is not reg]
        try:
            self._agent.deregister_memory(reg)
        except Exception:  # pragma: no cover - teardown is best effort
            logger.debug("nixl: deregister failed", exc_info=True)

    def deregister_all(self) -> None:
        for reg in list(self._regs):
            self.deregister(reg)

    # -- peers ----------------------------------------------------------------------------
    def metadata(self) -> str:
        return base64.b64encode(self._agent.get_agent_metadata()).decode("ascii")

    def add_remote(self, name: str, metadata: str, *, peer: str) -> None:
        if name in self._remotes:
            return
        try:
            raw = base64.b64decode(metadata.encode("ascii"), validate=True)
            got = self._agent.add_remote_agent(raw)
        except Exception as exc:
            raise PeerFailed(f"could not load the NIXL agent of {peer}: {exc}", peer=peer,
                             phase="init") from None
        self._remotes[name] = got.decode() if isinstance(got, bytes) else str(got)

    def remove_remote(self, name: str) -> None:
        got = self._remotes.pop(name, None)
        if got is not None:
            try:
                self._agent.remove_remote_agent(got)
            except Exception:  # pragma: no cover - best effort
                logger.debug("nixl: remove_remote_agent failed", exc_info=True)

    def reads(self, remote: str, local: Sequence[tuple[int, int]],
              remote_ranges: Sequence[tuple[int, int]], *, mem: str, remote_mem: str,
              device: int = 0, remote_device: int = 0, peer: str) -> "Reads":
        """A replayable READ of ``remote_ranges`` (address, nbytes) of agent ``remote`` into
        ``local`` (address, nbytes; pairwise the same sizes)."""
        if len(local) != len(remote_ranges):
            raise ValueError("local and remote descriptor lists differ in length")
        return Reads(self, remote, local, remote_ranges, mem, remote_mem, device,
                     remote_device, peer)

    def close(self) -> None:
        for name in list(self._remotes):
            self.remove_remote(name)
        self.deregister_all()
        self._agent = None


class Poller:
    """Progresses an agent that has no progress thread, from a thread of its own, every
    ``interval_s`` (it sleeps in between: a few wake-ups per millisecond, not a core),
    until :meth:`stop`, or until ``needed()`` (when given) says False. For an agent that is
    read from while its process does something else (one-sided reads on one host need it
    for their connection and notifications)."""

    def __init__(self, agent: NixlAgent, interval_s: float = 0.5e-3,
                 needed: Optional[Callable[[], bool]] = None) -> None:
        if agent.progress_thread:
            raise ValueError("Poller: the agent runs NIXL's progress thread already")
        if interval_s <= 0:
            raise ValueError(f"Poller: interval_s must be > 0, got {interval_s}")
        self._agent, self._interval, self._needed = agent, interval_s, needed
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"nixl-poll-{agent.name}",
                                        daemon=True)
        self._thread.start()

    def is_current(self) -> bool:
        """Whether the calling thread is this poller's (e.g. inside ``needed``)."""
        return threading.current_thread() is self._thread

    def _run(self) -> None:
        while not self._stop.is_set() and (self._needed is None or self._needed()):
            try:
                self._agent.progress()
            except Exception:  # a closed agent: nothing left to serve
                logger.debug("nixl: progress of a polled agent failed", exc_info=True)
                return
            self._stop.wait(self._interval)

    def stop(self, timeout: float = 5.0) -> None:
        """Stop and join the thread (bounded: it is between two short calls at most)."""
        self._stop.set()
        self._thread.join(timeout)


class Reads:
    """A prepared NIXL READ from one remote agent; :meth:`post` then :meth:`wait`."""

    def __init__(self, agent: NixlAgent, remote: str, local, remote_ranges, mem: str,
                 remote_mem: str, device: int, remote_device: int, peer: str) -> None:
        self.peer = peer
        self.nbytes = sum(n for _, n in local)
        self._agent = agent
        self._handle = None
        if not local:
            return
        a = agent._agent
        ldesc = a.get_xfer_descs([(addr, n, device) for addr, n in local], mem)
        rdesc = a.get_xfer_descs([(addr, n, remote_device) for addr, n in remote_ranges],
                                 remote_mem)
        try:
            self._handle = a.initialize_xfer("READ", ldesc, rdesc, agent._remotes[remote], b"")
        except Exception as exc:
            raise PeerFailed(f"could not prepare reads from {peer}: {exc}", peer=peer,
                             phase="receive") from None

    def _call(self, fn: Any, version: Any) -> str:
        """A NIXL call on the handle; NIXL's own exceptions (e.g. the remote agent
        disconnected) become ``PeerFailed`` naming the source."""
        try:
            return fn(self._handle)
        except Exception as exc:
            raise PeerFailed(f"reads from {self.peer} failed: {type(exc).__name__}: {exc}",
                             peer=self.peer, phase="receive", version=version) from None

    def post(self, *, version: Any) -> None:
        if self._handle is None:
            return
        state = self._call(self._agent._agent.transfer, version)
        if state == "ERR":
            raise PeerFailed(f"NIXL could not start the reads from {self.peer}", peer=self.peer,
                             phase="receive", version=version)

    def done(self, *, version: Any) -> bool:
        if self._handle is None:
            return True
        state = self._call(self._agent._agent.check_xfer_state, version)
        if state == "ERR":
            raise PeerFailed(f"reads from {self.peer} failed (the peer went away or its "
                             "memory was released)", peer=self.peer, phase="receive",
                             version=version)
        return state == "DONE"

    def release(self) -> None:
        if self._handle is not None and self._agent._agent is not None:
            try:
                self._agent._agent.release_xfer_handle(self._handle)
            except Exception:  # pragma: no cover - a handle still in flight at teardown
                logger.debug("nixl: release_xfer_handle failed", exc_info=True)
        self._handle = None


def wait_all(reads: Sequence[Reads], deadline: float, *, version: Any) -> None:
    """Poll every posted read until done; ``SyncTimeout`` naming the slowest source at the
    deadline. Polls back off from 20 us to 1 ms: no core is spun for long."""
    pending = [r for r in reads]
    pause = 20e-6
    while pending:
        pending = [r for r in pending if not r.done(version=version)]
        if not pending:
            return
        if time.monotonic() > deadline:
            raise SyncTimeout(f"reads from {pending[0].peer} did not finish in time",
                              peer=pending[0].peer, phase="receive", version=version)
        time.sleep(pause)
        pause = min(pause * 2, 1e-3)


def ucx_transports() -> str:
    """What UCX may use here (``UCX_TLS``; unset: UCX picks, e.g. cma/sysv for one host)."""
    return os.environ.get("UCX_TLS", "auto")
