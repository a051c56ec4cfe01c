"""Device operations of the ``cuda_ipc`` engine: buffers, IPC descriptors, stream waits.

The engine's protocol logic only talks to an ``IpcOps`` object, so the same logic runs
with CUDA IPC on a GPU and, in the CPU test suite, with an in-process stand-in.

A *descriptor* is the text that lets another process map a CUDA allocation: the GPU's
UUID, the size, the offset inside the cudaMalloc block, PyTorch's cross-process
reference counter (so the exporting process keeps the memory until every importer let
go), and the IPC handle, all as plain fields (hex for bytes). It travels inside JSON
control messages; nothing is unpickled. Each ``export`` call hands out one reference per
importer: give every receiver its own descriptor.
"""

from __future__ import annotations

import logging
import re
import string
from typing import Any, Callable

import torch

from weightsync.core.errors import BackendUnavailable
from weightsync.transport.tensors import resolve_device

__all__ = ["IpcOps", "CudaIpcOps", "GraphedCopies", "storage_bytes", "parse_descriptor",
           "format_descriptor", "spread"]

logger = logging.getLogger(__name__)

_PREFIX = "cudaipc1"
_HEX = frozenset(string.hexdigits)
_UUID_RE = re.compile(r"^[A-Za-z0-9-]{1,64}$")
_MAX_HANDLE = 8192          # bytes of an IPC handle (expandable segments carry more)


def storage_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 tensor over the whole storage behind ``tensor`` (no copy)."""
    storage = tensor.untyped_storage()
    return torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(
        storage, 0, (storage.nbytes(),), (1,))


def _hex(data: bytes) -> str:
    return data.hex()


def _unhex(text: str, what: str) -> bytes:
    if len(text) % 2 or len(text) > 2 * _MAX_HANDLE or not set(text) <= _HEX:
        raise ValueError(f"descriptor field {what} is not hex")
    return bytes.fromhex(text)


def format_descriptor(uuid: str, share: tuple) -> str:
    """Descriptor text from ``UntypedStorage._share_cuda_()``'s 8-tuple."""
    _device, handle, size, offset, ref_handle, ref_offset, _ev, _ev_required = share
    if handle is None or ref_handle is None:
        raise ValueError("cannot export an empty storage")
    return "|".join([_PREFIX, uuid, str(int(size)), str(int(offset)), str(int(ref_offset)),
                     _hex(bytes(handle)), _hex(bytes(ref_handle))])


def parse_descriptor(text: str) -> dict[str, Any]:
    """Strict inverse of :func:`format_descriptor`; ``ValueError`` for anything off."""
    if not isinstance(text, str) or len(text) > 4 * _MAX_HANDLE:
        raise ValueError("descriptor must be a str of bounded length")
    parts = text.split("|")
    if len(parts) != 7 or parts[0] != _PREFIX:
        raise ValueError(f"not a {_PREFIX} descriptor")
    _, uuid, size, offset, ref_offset, handle, ref_handle = parts
    if not _UUID_RE.match(uuid):
        raise ValueError("bad GPU uuid in descriptor")
    nums = []
    for name, value in (("size", size), ("offset", offset), ("ref_offset", ref_offset)):
        if not value.isdigit() or len(value) > 19:
            raise ValueError(f"descriptor field {name} is not a non-negative int")
        nums.append(int(value))
    if nums[0] == 0:
        raise ValueError("descriptor of an empty buffer")
    ref = _unhex(ref_handle, "ref_handle")
    if not ref or b"\0" in ref:
        raise ValueError("bad reference-counter name in descriptor")
    return {"uuid": uuid, "size": nums[0], "offset": nums[1], "ref_offset": nums[2],
            "handle": _unhex(handle, "handle"), "ref_handle": ref}


class IpcOps:
    """Interface (and documentation) of the device operations the engine uses."""

    device: torch.device

    def alloc(self, nbytes: int) -> torch.Tensor:
        """A flat uint8 buffer, allocated once."""
        raise NotImplementedError

    def export(self, tensor: torch.Tensor, count: int) -> list[str]:
        """``count`` descriptors of the storage behind ``tensor`` (one per importer)."""
        raise NotImplementedError

    def open(self, descriptor: str) -> torch.Tensor:
        """Map a descriptor: a flat uint8 tensor over the exported storage."""
        raise NotImplementedError

    def current_stream(self) -> Any:
        return None

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: Any) -> None:
        """Queue ``dst.copy_(src)`` on ``stream`` (None: the current stream; done when an
        event recorded after it is, or after ``sync(stream)``; the CPU test stand-in
        really applies it late)."""
        dst.copy_(src, non_blocking=True)

    def copy_many(self, pairs: list, stream: Any) -> None:
        """``copy(dst, src, stream)`` for each ``(dst, src)`` of ``pairs``, in order."""
        for dst, src in pairs:
            self.copy(dst, src, stream)

    def copy_runner(self, branches: int = 1) -> Callable[[Callable[[], list]], None]:
        """A callable that queues ``copy_many(pairs(), current stream)`` for a receiver's
        replayed copy program; it is handed the same pairs (same memory) on every call,
        so a device may replay them without looking at them again (``branches``: how
        many independent chains a device may run them in, see :class:`GraphedCopies`)."""
        def run(pairs: Callable[[], list]) -> None:
            self.copy_many(pairs(), self.current_stream())
        return run

    def run_copies(self, runner: Callable[[Callable[[], list]], None],
                   pairs: Callable[[], list], stream: Any) -> None:
        """Run a :meth:`copy_runner` with ``stream`` current (the trainer's fill programs
        run on the caller's stream from the engine's own thread). Here, with no device
        streams to switch, the runner queues on :meth:`current_stream`."""
        runner(pairs)

    def sync(self, stream: Any) -> None:
        """Block until the work queued on ``stream`` is done."""

    def idle(self, stream: Any) -> bool:
        """Whether every piece of work queued on ``stream`` is done (no wait)."""
        return True

    def new_stream(self) -> Any:
        """A stream of this device's own (work queued on it runs beside the caller's)."""
        return self.current_stream()

    def wait_event(self, stream: Any, event: Any) -> None:
        """Queue on ``stream`` a wait for the work ``event`` last marked (no host wait);
        the event may be another process's (``open_event``)."""

    def keep_for(self, tensor: torch.Tensor, stream: Any) -> None:
        """The allocator must not hand ``tensor``'s memory out again, once freed, before
        the work queued on ``stream`` up to then is done."""

    def new_event(self) -> Any:
        """An event other processes can open (``event_handle``) and query."""
        return None

    def event_handle(self, event: Any) -> str:
        return ""

    def open_event(self, handle: str) -> Any:
        return None

    def record(self, event: Any, stream: Any) -> None:
        """Mark the work queued on ``stream`` so far; ``done`` turns true when it is."""

    def done(self, event: Any) -> bool:
        return True

    def collect(self) -> None:
        """Free exported memory that importers released (best effort)."""


class CudaIpcOps(IpcOps):
    """CUDA IPC through PyTorch's own sharing machinery (reference counted)."""

    def __init__(self, device: str) -> None:
        dev = torch.device(device)
        if dev.type != "cuda":
            raise ValueError(f"cuda_ipc moves CUDA tensors; device {device!r} is not a CUDA "
                             "device (use shm for CPU tensors)")
        if not torch.cuda.is_available():
            raise BackendUnavailable("cuda_ipc needs CUDA, and torch.cuda.is_available() "
                                     "is False here")
        torch.cuda.init()
        index = resolve_device(dev).index
        if not 0 <= index < torch.cuda.device_count():
            raise ValueError(f"device {device!r} does not exist here")
        self.device = torch.device("cuda", index)
        self.uuid = self._uuid(index)
        self._index_of: dict[str, int] = {}

    @staticmethod
    def _uuid(index: int) -> str:
        uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
        text = str(uuid) if uuid is not None else f"index-{index}"
        return text if _UUID_RE.match(text) else f"index-{index}"

    def _local_index(self, uuid: str) -> int:
        if not self._index_of:
            self._index_of = {self._uuid(i): i for i in range(torch.cuda.device_count())}
        try:
            return self._index_of[uuid]
        except KeyError:
            raise ValueError(f"GPU {uuid} of the exporting process is not visible here "
                             "(CUDA_VISIBLE_DEVICES?)") from None

    def alloc(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def export(self, tensor: torch.Tensor, count: int) -> list[str]:
        storage = tensor.untyped_storage()
        with torch.cuda.device(tensor.device):
            return [format_descriptor(self._uuid(tensor.device.index), storage._share_cuda_())
                    for _ in range(count)]

    def open(self, descriptor: str) -> torch.Tensor:
        d = parse_descriptor(descriptor)
        index = self._local_index(d["uuid"])
        # No event wait: the exporter synchronizes before it publishes anything to read.
        storage = torch.UntypedStorage._new_shared_cuda(
            index, d["handle"], d["size"], d["offset"], d["ref_handle"], d["ref_offset"],
            b"", False)
        return torch.empty(0, dtype=torch.uint8, device=torch.device("cuda", index)).set_(
            storage, 0, (d["size"],), (1,))

    def current_stream(self) -> Any:
        return torch.cuda.current_stream(self.device)

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: Any) -> None:
        if stream is None:                 # the caller's current stream
            dst.copy_(src, non_blocking=True)
            return
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)

    def copy_many(self, pairs: list, stream: Any) -> None:
        with torch.cuda.stream(stream):   # one stream switch for a bucket's copies
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)

    def copy_runner(self, branches: int = 1) -> Callable[[Callable[[], list]], None]:
        return GraphedCopies(self.device, branches)

    def run_copies(self, runner: Callable[[Callable[[], list]], None],
                   pairs: Callable[[], list], stream: Any) -> None:
        with torch.cuda.stream(stream):
            runner(pairs)

    def sync(self, stream: Any) -> None:
        stream.synchronize()

    def idle(self, stream: Any) -> bool:
        return stream.query()

    def new_stream(self) -> Any:
        return torch.cuda.Stream(self.device)

    def wait_event(self, stream: Any, event: Any) -> None:
        stream.wait_event(event)

    def keep_for(self, tensor: torch.Tensor, stream: Any) -> None:
        tensor.record_stream(stream)

    def new_event(self) -> Any:
        with torch.cuda.device(self.device):
            event = torch.cuda.Event(interprocess=True)
            event.ipc_handle()  # creates it on this device
        return event

    def event_handle(self, event: Any) -> str:
        return bytes(event.ipc_handle()).hex()

    def open_event(self, handle: str) -> Any:
        if len(handle) != 128:
            raise ValueError("an event handle has 64 bytes")
        return torch.cuda.Event.from_ipc_handle(self.device, _unhex(handle, "event"))

    def record(self, event: Any, stream: Any) -> None:
        event.record(stream)

    def done(self, event: Any) -> bool:
        return event.query()

    def collect(self) -> None:
        try:
            torch.cuda.ipc_collect()
        except RuntimeError:
            logger.debug("ipc_collect failed", exc_info=True)


def spread(sizes: list[int], lanes: int) -> list[int]:
    """The lane of each copy of ``sizes`` bytes, in order: each goes to the lane with the
    fewest bytes so far (ties: the lowest lane), so the lanes end close together."""
    load = [0] * max(1, lanes)
    out = []
    for n in sizes:
        lane = min(range(len(load)), key=load.__getitem__)
        out.append(lane)
        load[lane] += n
    return out


class GraphedCopies:
    """A receiver's replayed copies on the current stream. The first call queues them one
    by one; the second captures them once as a CUDA graph, and every call from then on
    replays it: one launch, no per-tensor host work. With ``branches`` > 1 the graph forks
    into that many independent chains of copies (balanced by bytes) that join at its end,
    so one copy's last, partly idle wave overlaps the next copy's start; the graph as a
    whole is still one unit of the current stream, before and after which everything stays
    ordered. The caller guarantees the pairs cover the same memory on every call, and no
    two write the same bytes. If capture fails, copies go one by one."""

    def __init__(self, device: torch.device, branches: int = 1) -> None:
        if isinstance(branches, bool) or not isinstance(branches, int) or branches < 1:
            raise ValueError(f"branches must be an int >= 1, got {branches!r}")
        self.device = device
        self.branches = branches
        self.graph: Any = None
        self.calls = 0
        self.capturable = True

    def __call__(self, pairs: Callable[[], list]) -> None:
        self.calls += 1
        if self.graph is None and self.capturable and self.calls >= 2:
            self.graph = self._capture(pairs())
            self.capturable = self.graph is not None
        if self.graph is not None:
            self.graph.replay()          # on the current stream
            return
        for dst, src in pairs():
            dst.copy_(src, non_blocking=True)

    def _capture(self, pairs: list) -> Any:
        graph = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream(self.device)
        n = min(self.branches, len(pairs))
        lanes = [side] + [torch.cuda.Stream(self.device) for _ in range(n - 1)]
        which = spread([d.numel() * d.element_size() for d, _ in pairs], n)
        try:
            with torch.cuda.stream(side):
                # thread-local: the pump threads poll events while this captures
                graph.capture_begin(capture_error_mode="thread_local")
                try:
                    if n > 1:            # fork: the other lanes join the capture
                        fork = torch.cuda.Event()
                        fork.record(side)
                        for lane in lanes[1:]:
                            lane.wait_event(fork)
                    for (dst, src), lane in zip(pairs, which):
                        with torch.cuda.stream(lanes[lane]):
                            dst.copy_(src, non_blocking=True)
                    for lane in lanes[1:]:   # join: the graph ends after every lane
                        joined = torch.cuda.Event()
                        joined.record(lane)
                        side.wait_event(joined)
                finally:
                    graph.capture_end()
        except (RuntimeError, TypeError) as exc:
            logger.info("cuda_ipc: copies not captured as a CUDA graph (%s); queued one by "
                        "one", exc)
            return None
        return graph
