"""The link model: bytes on shared links, how long they take, and what limits a phase.

Owns :class:`Loads` (what one phase puts on every resource) and :class:`PhaseResult`.
Resources are per device (``nic_out``/``nic_in``, ``intra_out``/``intra_in``: each
direction of its NIC or NVLink/PCIe/cross-memory path; ``device_mem``: bytes it copies;
``d2h``: a host's GPU writing into host memory), per node (``host_mem``: every copy through
host memory, on ``host`` links) and per
broadcast stream (``stream``: the collective's per-stream cap, e.g. gloo's TCP). A phase
takes ``max(load / rate over resources, busy seconds of any actor) + latency``: a fluid
model in which everything of a phase runs concurrently and only shared links (and each
actor's own software time) serialize it. On a host whose links give ``cores``, copies,
gloo's broadcasts and every actor's software time are one load on those cores. The
fabric between NICs is taken as non-blocking (only endpoints contend). The resource or
actor giving that maximum is the phase's bottleneck.
"""

from __future__ import annotations

import heapq
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from weightsync.tools.planner.scenario import Device, Placement

__all__ = ["Loads", "PhaseResult", "LINK_OF"]

#: resource kind -> the link of the links file that sets its rate
LINK_OF = {"nic_out": "nic", "nic_in": "nic", "intra_out": "intra", "intra_in": "intra",
           "device_mem": "device_mem", "host_mem": "host_mem", "d2h": "d2h"}


@dataclass
class PhaseResult:
    name: str
    seconds: float
    limit: str                 # what set it: a resource or an actor
    limit_seconds: float
    latency: float
    top: list[dict] = field(default_factory=list)   # the busiest resources

    def to_dict(self) -> dict:
        return {"phase": self.name, "seconds": self.seconds, "limited_by": self.limit,
                "limit_seconds": self.limit_seconds, "latency_s": self.latency,
                "busiest": self.top}


class Loads:
    """Bytes per resource and busy seconds per actor of one phase."""

    def __init__(self, placement: Placement, stream_cap: float | None = None) -> None:
        self.p = placement
        self.bytes: dict[tuple[str, Any], float] = defaultdict(float)
        self.busy: dict[str, float] = defaultdict(float)
        self.latency = 0.0
        self.stream_cap = stream_cap
        self._rates: dict[tuple[str, Any], float] = {}
        self._times: dict[tuple[str, Any], float] | None = None

    # -- what moves -----------------------------------------------------------------------
    def copy(self, dev: Device, nbytes: float, threads: int = 1) -> None:
        """``dev`` copies ``nbytes`` in its own memory (through host memory on a host, and
        on its cores where the links give them). ``threads``: the copy is split over that
        many threads of the process (``fastcopy``'s split copies), each at ``device_mem``'s
        one-thread rate, so the process copies ``threads`` x as fast; the bytes through host
        memory and the core-seconds are the same as on one thread."""
        if nbytes:
            self.bytes[("device_mem", dev)] += nbytes / max(1, threads)
            if self.p.host:
                self.bytes[("host_mem", dev[0])] += nbytes
                self.cpu(dev[0], nbytes)

    def d2h(self, dev: Device, nbytes: float) -> None:
        """A host's GPU (the trainer process ``dev``'s) writes ``nbytes`` into host memory
        with its copy engine (``links.d2h``, pinned memory). No core works on it. Host
        memory carries half of a copy's load for it: ``host_mem`` is priced in bytes
        *copied*, each read and written once through DRAM, and a DMA write only writes."""
        if nbytes:
            self.bytes[("d2h", dev)] += nbytes
            self.bytes[("host_mem", dev[0])] += nbytes / 2

    def cpu(self, node: int, nbytes: float) -> None:
        """Work for a host's shared cores, in bytes of one core's copy (``device_mem``):
        the resource ``cores`` runs ``cores x`` that rate. Nothing where no cores are given."""
        if nbytes and self.p.node_links[node].cores:
            self.bytes[("cores", node)] += nbytes

    def move(self, src: Device, dst: Device, nbytes: float) -> None:
        """``nbytes`` from ``src``'s memory into ``dst``'s (a READ, a send)."""
        if not nbytes:
            return
        if src == dst:
            self.copy(dst, nbytes)
        elif src[0] == dst[0]:
            if not self.p.host:
                self.bytes[("intra_out", src)] += nbytes
            self.bytes[("intra_in", dst)] += nbytes
            if self.p.host:
                self.bytes[("host_mem", dst[0])] += nbytes
        else:
            self.bytes[("nic_out", src)] += nbytes
            self.bytes[("nic_in", dst)] += nbytes

    def put(self, kind: str, where: Any, nbytes: float) -> None:
        if nbytes:
            self.bytes[(kind, where)] += nbytes

    def absorb(self, other: "Loads") -> None:
        """Add another phase's bytes (the per-link totals of a whole sync)."""
        for k, b in other.bytes.items():
            self.bytes[k] += b
        self._times = None

    def work(self, actor: str, seconds: float) -> None:
        """``seconds`` of ``actor``'s own software (host-side costs per tensor, bucket,
        READ, operation): serial within the actor. On a host the actors are processes of
        that host, so the same seconds are also work for its shared cores, beside the
        copies (:meth:`cpu`, converted at one core's copy rate)."""
        if seconds:
            self.busy[actor] += seconds
            if self.p.host:      # every rank is a process of the one host (node 0)
                self.cpu(0, seconds * self.rate("device_mem", (0, 0)))

    # -- how long -------------------------------------------------------------------------
    def rate(self, kind: str, where: Any) -> float:
        if kind == "stream":
            return self.stream_cap or float("inf")
        if kind == "cores":
            links = self.p.node_links[where]
            return links.cores * links.link("device_mem").rate
        node = where if kind == "host_mem" else where[0]
        key = (kind, node)
        if key not in self._rates:
            self._rates[key] = self.p.node_links[node].link(LINK_OF[kind]).rate
        return self._rates[key]

    def describe(self, kind: str, where: Any) -> str:
        if kind == "stream":
            return f"broadcast stream of {where}"
        if kind == "host_mem":
            return f"host_mem node {where}"
        if kind == "cores":
            return f"the {self.p.node_links[where].cores} cores of node {where} (bytes of " \
                   "one-core copies)"
        return f"{kind} {self.p.name(where)} ({self.p.who(where)})"

    def times(self) -> dict[tuple[str, Any], float]:
        """Seconds each resource is busy (computed once: call after the last load)."""
        if self._times is None:
            self._times = {k: b / self.rate(*k) for k, b in self.bytes.items()}
        return self._times

    def result(self, name: str, top: int = 5) -> PhaseResult:
        times = self.times()
        best_r = max(times.items(), key=lambda kv: kv[1], default=(None, 0.0))
        best_a = max(self.busy.items(), key=lambda kv: kv[1], default=(None, 0.0))
        if best_a[1] > best_r[1]:
            limit, secs = f"software of {best_a[0]}", best_a[1]
        elif best_r[0] is not None:
            limit, secs = self.describe(*best_r[0]), best_r[1]
        else:
            limit, secs = "nothing", 0.0
        busiest = heapq.nlargest(top, times.items(), key=lambda kv: kv[1])
        rows = [{"resource": self.describe(*k), "bytes": self.bytes[k], "seconds": t}
                for k, t in busiest]
        return PhaseResult(name, secs + self.latency, limit, secs, self.latency, rows)

    def per_kind(self) -> dict[str, dict]:
        """For each resource kind: the most loaded one (bytes, seconds, where)."""
        out: dict[str, dict] = {}
        for (kind, where), t in self.times().items():
            cur = out.get(kind)
            if cur is None or t > cur["seconds"]:
                out[kind] = {"bytes": self.bytes[(kind, where)], "seconds": t,
                             "where": self.describe(kind, where)}
        return out


@dataclass
class StrategyResult:
    """What one strategy predicts: phases run one after another (their sum is
    ``seconds``), bytes per source rank / destination worker, READs (or collective ops)
    per worker, the busiest link of each kind."""

    strategy: str
    seconds: float = 0.0
    phases: list[PhaseResult] = field(default_factory=list)
    links: dict[str, dict] = field(default_factory=dict)
    source_bytes: list[float] = field(default_factory=list)
    dest_bytes: list[float] = field(default_factory=list)
    dest_reads: list[float] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    applicable: bool = True
    reason: str = ""

    @property
    def bottleneck(self) -> PhaseResult | None:
        return max(self.phases, key=lambda p: p.seconds, default=None)

    def add_links(self, loads: Loads) -> None:
        for kind, row in loads.per_kind().items():
            cur = self.links.get(kind)
            if cur is None or row["seconds"] > cur["seconds"]:
                self.links[kind] = row
