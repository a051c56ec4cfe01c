"""What is planned: the :class:`Scenario` (model, dtypes, layouts, links, strategies) and
where every rank sits (:class:`Placement`).

Owns the input checks of a scenario (each a :class:`~.errors.PlannerError` naming its
field) and the placement rule: trainer rank ``r`` on node ``r // gpus_per_node``, GPU
``r % gpus_per_node``; rollout workers (replica ``k``, worker ``g``; replicas back to
back, ``tp x max(ep, 1)`` GPUs each) by ``placement``: ``nodes`` on the nodes after the
trainer's, ``packed`` on the next free GPUs (sharing the trainer's last node), or
``colocated`` on the trainer's GPUs (worker ``i`` on trainer rank ``i``'s GPU). On a
``host`` links file every rank is a process of the one host.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from weightsync.core.config import DEFAULT_BUCKET_SIZE, DEFAULT_NUM_SLOTS
from weightsync.tools.planner.errors import PlannerError
from weightsync.tools.planner.links import Links
from weightsync.transport.backends.collective import COLLECTIVE_DIRECT_MIN
from weightsync.tools.planner.model import ModelSpec

__all__ = ["Scenario", "Placement", "Device", "STRATEGIES", "PLACEMENTS", "SHARED",
           "TRAINER_DEVICES"]

STRATEGIES = ("p2p", "broadcast", "ring")
PLACEMENTS = ("nodes", "packed", "colocated")
#: ring on a host (``shm``): whose tensors live in torch shared memory
#: (``model.share_memory()``): ``trainer``: receivers copy direct tensors out of a mapping
#: ("shared read"); ``receivers``: the trainer writes every tensor straight into each
#: receiver's memory ("push", no ring); ``both``: push (nothing is left to read).
#: Ring on GPUs (``cuda_ipc``): ``trainer``: zero-copy (receivers read every tensor sent
#: as it is kept straight from the trainer's memory); ``receivers`` / ``both``: pushes
#: (the trainer writes every tensor into each receiver's own, no ring)
SHARED = ("none", "trainer", "receivers", "both")
#: where a trainer process of a host links file keeps its tensors (``gpu``: on a GPU of
#: that host, copied device-to-host over ``links.d2h``)
TRAINER_DEVICES = ("cpu", "gpu")
Device = tuple[int, int]          # (node, index in node)


def _positive(v, field_name: str, low: int = 1) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < low:
        raise PlannerError(field_name, f"must be an integer >= {low}, got {v!r}")
    return v


@dataclass(frozen=True)
class Scenario:
    """One sync to predict. ``ep`` 0: no expert parallelism (experts TP-split); ``ep`` N:
    a replica is ``tp x N`` GPUs, experts split over all of them (see :mod:`.rules`).
    ``trainer_tp``/``trainer_ep``: the trainer's own tensor/expert parallelism, by the same
    rules; its ``trainer_gpus / (trainer_tp x max(trainer_ep, 1))`` data-parallel ranks
    chunk each shard's rows (``trainer_shard="fsdp"``) or each hold it (``"full"``)."""

    model: ModelSpec
    links: Links
    trainer_gpus: int
    replicas: int
    tp: int = 1
    ep: int = 0
    src_dtype: str = "bfloat16"
    dst_dtype: str = "bfloat16"
    fp8_at: str = "trainer"
    trainer_shard: str = "fsdp"
    trainer_tp: int = 1
    trainer_ep: int = 0
    placement: str = "nodes"
    rollout_links: Optional[Links] = None
    bucket_size: int = DEFAULT_BUCKET_SIZE
    max_read_bytes: Optional[int] = None
    pipelined: bool = True          # p2p: warm syncs stage and read at once (the engine's way)
    serve: str = "auto"             # p2p: WEIGHTSYNC_NIXL_SERVE ("auto" or "staging")
    #: p2p: TP/EP workers give ``receive_into`` tensors of their kept boxes' shapes, so
    #: slices land straight in them; False: the loader copies each slice (vLLM's)
    into_shards: bool = False
    strategies: tuple[str, ...] = STRATEGIES
    label: str = ""
    notes: tuple[str, ...] = field(default=())
    shared: str = "none"            # ring on a host (shm): see SHARED
    trainer_device: str = "cpu"     # host links: see TRAINER_DEVICES
    #: broadcast on a host (``collective`` on CPU): tensors of at least this many bytes go
    #: as their own broadcast, unpacked (the engine's ``direct_min_bytes``; 0: none)
    collective_direct_min: int = COLLECTIVE_DIRECT_MIN
    #: buckets of a trainer rank's ring (``WEIGHTSYNC_NUM_SLOTS``)
    num_slots: int = DEFAULT_NUM_SLOTS
    #: ``delta+<backend>`` (:mod:`.delta`): the fraction of each tensor's elements that
    #: changed since the last sync (e.g. 0.005), warm; None: dense (the default)
    delta: Optional[float] = None

    def __post_init__(self) -> None:
        _positive(self.trainer_gpus, "trainer.gpus")
        _positive(self.replicas, "rollout.replicas")
        _positive(self.tp, "rollout.tp")
        _positive(self.ep, "rollout.ep", 0)
        _positive(self.trainer_tp, "trainer.tp")
        _positive(self.trainer_ep, "trainer.ep", 0)
        if self.trainer_gpus % self.trainer_group:
            raise PlannerError("trainer.tp", f"trainer.gpus {self.trainer_gpus} is not divisible "
                                             f"by trainer.tp x trainer.ep = {self.trainer_group}")
        _positive(self.bucket_size, "bucket_size")
        _positive(self.collective_direct_min, "collective_direct_min", 0)
        _positive(self.num_slots, "num_slots")
        if self.max_read_bytes is not None:
            _positive(self.max_read_bytes, "max_read_bytes")
        if self.serve not in ("auto", "staging"):
            raise PlannerError("serve", f"must be 'auto' or 'staging', got {self.serve!r}")
        if self.trainer_shard not in ("fsdp", "full"):
            raise PlannerError("trainer.shard", f"must be 'fsdp' or 'full', got "
                                                f"{self.trainer_shard!r}")
        if self.placement not in PLACEMENTS:
            raise PlannerError("rollout.placement", f"must be one of {', '.join(PLACEMENTS)}, "
                               f"got {self.placement!r}")
        self._check_shm()
        if self.delta is not None and (isinstance(self.delta, bool) or not isinstance(
                self.delta, (int, float)) or not 0.0 <= self.delta <= 1.0):
            raise PlannerError("delta", f"the fraction of elements that change per sync, a "
                                        f"number in [0, 1]; got {self.delta!r}")
        bad = [s for s in self.strategies if s not in STRATEGIES]
        if bad or not self.strategies:
            raise PlannerError("strategies", f"choose from {', '.join(STRATEGIES)}, got "
                                             f"{', '.join(bad) or 'none'}")

    def _check_shm(self) -> None:
        """``shared`` and ``trainer_device`` describe the ``shm`` (host links file) and
        ``cuda_ipc`` (gpu links file) paths; on a host, shared reads only from a CPU
        trainer's storage, and a GPU trainer only on a host links file."""
        if self.shared not in SHARED:
            raise PlannerError("shared", f"must be one of {', '.join(SHARED)}, got "
                                         f"{self.shared!r}")
        if self.trainer_device not in TRAINER_DEVICES:
            raise PlannerError("trainer.device", f"must be one of {', '.join(TRAINER_DEVICES)}"
                                                 f", got {self.trainer_device!r}")
        host = self.links.device == "host"
        if self.trainer_device == "gpu":
            if not host:
                raise PlannerError("trainer.device", "gpu applies to a host links file (shm "
                                                     "from a GPU of the host); on a gpu links "
                                                     "file every trainer rank is a GPU already")
            if "d2h" not in self.links.links:
                raise PlannerError("links.d2h", f"missing in links file {self.links.name!r}: "
                                                "a GPU trainer copies device-to-host over it")
            if self.shared in ("trainer", "both"):
                raise PlannerError("shared", f"{self.shared}: the trainer's tensors are CUDA "
                                             "tensors (trainer.device gpu); receivers map "
                                             "only a CPU trainer's shared storage")

    @property
    def push(self) -> bool:
        """Pushes (shm, or cuda_ipc on GPUs): the trainer writes into every receiver's
        tensors (see SHARED)."""
        return self.shared in ("receivers", "both")

    @property
    def trainer_layout(self) -> str:
        """The trainer's layout in words (reports and notes)."""
        if self.trainer_group == 1:
            return "FSDP2 Shard(0)" if self.trainer_shard == "fsdp" else \
                "full tensors on every rank"
        ep = f" x EP {self.trainer_ep}" if self.trainer_ep else ""
        dp = "rows chunked by FSDP2" if self.trainer_shard == "fsdp" else \
            "replicated over data parallel"
        return f"TP {self.trainer_tp}{ep} shards, {dp}"

    @property
    def trainer_group(self) -> int:
        """Trainer ranks of one tensor-/expert-parallel group."""
        return self.trainer_tp * max(self.trainer_ep, 1)

    @property
    def replica_size(self) -> int:
        return self.tp * max(self.ep, 1)

    @property
    def workers(self) -> int:
        return self.replicas * self.replica_size


class Placement:
    """Devices of every trainer rank and rollout worker, and each node's links."""

    def __init__(self, sc: Scenario) -> None:
        tl, rl = sc.links, sc.rollout_links or sc.links
        if sc.placement != "nodes" and rl.name != tl.name:
            raise PlannerError("rollout.links", f"placement {sc.placement} puts rollout on "
                                                "the trainer's nodes: give no other links")
        if tl.device != rl.device:
            raise PlannerError("rollout.links", f"trainer links are {tl.device}, rollout "
                                                f"links {rl.device}: use one kind")
        self.host = tl.device == "host"
        gt, gr = tl.gpus_per_node, rl.gpus_per_node
        self.trainer = [(r // gt, r % gt) for r in range(sc.trainer_gpus)]
        t_nodes = -(-sc.trainer_gpus // gt)
        if self.host:
            if sc.placement == "colocated":
                raise PlannerError("rollout.placement", "on a host links file every rank "
                                                        "is its own process")
            self.trainer = [(0, r) for r in range(sc.trainer_gpus)]
            self.worker = [(0, sc.trainer_gpus + i) for i in range(sc.workers)]
            if sc.trainer_gpus + sc.workers > gt:
                raise PlannerError("links.gpus_per_node", f"{sc.trainer_gpus + sc.workers} "
                                   f"processes on one host of {tl.name}, at most {gt}")
        elif sc.placement == "nodes":
            self.worker = [(t_nodes + i // gr, i % gr) for i in range(sc.workers)]
        else:
            first = 0 if sc.placement == "colocated" else sc.trainer_gpus
            self.worker = [((first + i) // gt, (first + i) % gt) for i in range(sc.workers)]
        nodes = 1 + max(d[0] for d in self.trainer + self.worker)
        if tl.max_nodes is not None and nodes > tl.max_nodes:
            raise PlannerError("links.max_nodes", f"the layout needs {nodes} nodes, "
                                                  f"{tl.name} has {tl.max_nodes}")
        self.node_links = [tl if n < t_nodes or sc.placement != "nodes" else rl
                           for n in range(nodes)]
        self.replica_size = sc.replica_size
        self._who: dict[Device, list[str]] = {}
        for r, d in enumerate(self.trainer):
            self._who.setdefault(d, []).append(f"trainer rank {r}")
        for i, d in enumerate(self.worker):
            k, g = divmod(i, sc.replica_size)
            self._who.setdefault(d, []).append(f"replica {k} worker {g}")

    @property
    def nodes(self) -> int:
        return len(self.node_links)

    def links_of(self, dev: Device) -> Links:
        return self.node_links[dev[0]]

    def who(self, dev: Device) -> str:
        return " + ".join(self._who.get(dev, ["idle"]))

    def name(self, dev: Device) -> str:
        return f"p{dev[1]}" if self.host else f"n{dev[0]}.g{dev[1]}"
