"""The links file: what each link of a cluster carries, and the presets.

Owns :class:`Links` (parsed and checked) and :func:`load_links` (a preset name, or a
YAML/JSON file). A links file describes one kind of node:

* ``device``: ``gpu`` (devices are GPUs) or ``host`` (devices are processes on one host,
  as on this CPU box); ``gpus_per_node``; ``max_nodes`` (``null``: any); on a host,
  optionally ``cores``: the processes share that many cores, so their copies and a
  CPU-bound collective (gloo) are also priced as work on them;
* ``links``: ``nic`` (per device, each direction: what crosses nodes), ``intra`` (per
  device, each direction, within a node: NVLink, PCIe, or cross-memory reads between
  processes), ``device_mem`` (per device: bytes *copied* per second, e.g. HBM) and
  ``host_mem`` (per node, shared by every copy through host memory); each with ``GBps``
  (line rate, 1e9 bytes/s), ``latency_us`` and ``efficiency`` (the fraction of the line
  rate a transfer reaches; the line-rate bound uses the line rate); on a host, optionally
  ``d2h``: one GPU's pinned device-to-host copy (PCIe), for a trainer whose tensors are on
  a GPU of that host (``Scenario.trainer_device="gpu"``, the ``shm`` backend's CUDA path);
* ``collective``: ``algo`` (``ring``: pipelined like NCCL; ``star``: the root sends every
  receiver its own copy, like gloo), optional ``GBps`` (a cap per broadcast stream);
* ``ring``: ``direct_min_bytes`` / ``direct_max_receivers`` (shm reads tensors that big
  straight from the trainer when there are at most that many receivers; 0: never),
  ``direct_GBps`` (what all those cross-memory reads of a host reach together) and
  optionally ``direct_window`` (default 2, the engine's direct window:
  how many direct tensors the trainer leaves unread before it waits; 1: it waits for each
  read before it asks for the next item, as the engine does for tensors whose storage does
  not outlive their item, e.g. a trainer that yields fresh tensors every sync);
* ``software``: host-side costs in microseconds: ``tensor_us`` (per tensor a rank packs or
  applies), ``bucket_us`` (per bucket), ``read_us`` (per READ a receiver posts),
  ``control_us`` (one control-message round trip per sync), ``op_us`` (per collective op),
  and optionally ``direct_wait_us``: what each direct read the trainer waits for adds
  (``direct_window`` 1: the receivers' acknowledgement reaches the trainer, which asks for
  its next item and sends its header; default ``control_us + tensor_us``) and
  ``handoff_us``: what each bucket of a ``cuda_ipc`` ring adds that its copies do not hide
  (a slot handed from trainer to receiver and back: the header, the receiver's event wait,
  its release; default 0), ``finish_us``: what a ``cuda_ipc`` ring's sync adds once at its
  end beyond the last bucket's copies (the trainer's closing message and the receivers'
  last acknowledgement; default 0);
* ``codec`` (optional; needed by delta, ``Scenario.delta``): per side, a rate and/or a
  cost per changed element: ``encode_GBps`` (bytes of weights a trainer rank diffs into
  records per second) and ``encode_ns`` (what each changed element adds: gathering it,
  its index, its digest), ``apply_GBps`` (bytes of weights a receiver checks and patches per
  second) and ``apply_ns``; at least one of each side. The diff reads every byte, so the
  rate sets the pace on CPUs and GPUs alike; each changed element adds a little.

Every number is required where its link is used, and must be >= 0 (``GBps`` > 0,
``efficiency`` in (0, 1]); a bad one is a :class:`~.errors.PlannerError` naming it.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

from weightsync.tools.planner.errors import PlannerError

__all__ = ["Link", "Links", "load_links", "preset_names", "PRESET_DIR"]

PRESET_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "presets")
_LINKS = {"gpu": ("nic", "intra", "device_mem"), "host": ("intra", "device_mem", "host_mem")}
_SOFTWARE = ("tensor_us", "bucket_us", "read_us", "control_us", "op_us")


@dataclass(frozen=True)
class Link:
    """One kind of link: ``rate`` is what a transfer gets, ``line_rate`` the nominal."""

    name: str
    GBps: float
    latency_us: float = 0.0
    efficiency: float = 1.0
    type: str = ""
    source: str = ""

    @property
    def line_rate(self) -> float:
        return self.GBps * 1e9

    @property
    def rate(self) -> float:
        return self.GBps * 1e9 * self.efficiency

    @property
    def latency(self) -> float:
        return self.latency_us * 1e-6


@dataclass(frozen=True)
class Links:
    name: str
    device: str
    gpus_per_node: int
    links: Mapping[str, Link]
    collective_algo: str
    collective_cap: Optional[float]        # bytes/s per broadcast stream, or None
    direct_min_bytes: int
    direct_max_receivers: int
    direct_rate: Optional[float]           # bytes/s of all direct reads of a host, or None
    software: Mapping[str, float]          # seconds
    direct_window: int = 2                 # direct tensors left unread before the trainer waits
    max_nodes: Optional[int] = None
    cores: Optional[int] = None            # a host's cores shared by its processes
    codec: Mapping[str, float] = field(default_factory=dict)   # delta: B/s and s a change
    description: str = ""
    raw: Mapping[str, Any] = field(default_factory=dict, compare=False)

    def link(self, name: str) -> Link:
        if name not in self.links:
            raise PlannerError(f"links.{name}", f"missing in links file {self.name!r} "
                                                f"(needed by this layout)")
        return self.links[name]

    def sw(self, key: str) -> float:
        return self.software[key]


def _num(d: Mapping, key: str, where: str, *, positive: bool = False,
         default: Optional[float] = None, upto: Optional[float] = None) -> float:
    if key not in d or d[key] is None:
        if default is not None:
            return default
        raise PlannerError(f"{where}.{key}", "missing (a number is required)")
    v = d[key]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise PlannerError(f"{where}.{key}", f"must be a number, got {v!r}")
    if v < 0 or (positive and v == 0):
        raise PlannerError(f"{where}.{key}", f"must be {'> 0' if positive else '>= 0'}, got {v}")
    if upto is not None and v > upto:
        raise PlannerError(f"{where}.{key}", f"must be <= {upto}, got {v}")
    return float(v)


def _section(d: Mapping, key: str, where: str, required: bool = True) -> Mapping:
    v = d.get(key)
    if v is None and not required:
        return {}
    if not isinstance(v, Mapping):
        raise PlannerError(f"{where}.{key}", "missing (a mapping is required)" if v is None
                           else f"must be a mapping, got {type(v).__name__}")
    return v


def _link(d: Mapping, name: str) -> Link:
    where = f"links.{name}"
    eff = _num(d, "efficiency", where, positive=True, default=1.0, upto=1.0)
    return Link(name=name, GBps=_num(d, "GBps", where, positive=True),
                latency_us=_num(d, "latency_us", where, default=0.0), efficiency=eff,
                type=str(d.get("type", name)), source=str(d.get("source", "")))


def _codec(doc: Mapping) -> dict[str, float]:
    """``links.codec``: per side (``encode``, ``apply``) a rate in bytes of weights a second
    (``<side>_GBps``), a cost per changed element (``<side>_ns``), or both; {} if absent."""
    if not doc:
        return {}
    out: dict[str, float] = {}
    for side in ("encode", "apply"):
        if doc.get(f"{side}_GBps") is None and doc.get(f"{side}_ns") is None:
            raise PlannerError(f"links.codec.{side}_GBps", f"missing (give {side}_GBps, "
                                                           f"{side}_ns or both)")
        rate = doc.get(f"{side}_GBps")
        out[side] = math.inf if rate is None else \
            _num(doc, f"{side}_GBps", "links.codec", positive=True) * 1e9
        out[f"{side}_ns"] = _num(doc, f"{side}_ns", "links.codec", default=0.0) * 1e-9
    return out


def parse_links(doc: Any, name: str = "links") -> Links:
    """Check a parsed links document; :class:`PlannerError` names the first bad field."""
    if not isinstance(doc, Mapping):
        raise PlannerError("links", f"a links file holds a mapping, got {type(doc).__name__}")
    device = doc.get("device", "gpu")
    if device not in _LINKS:
        raise PlannerError("links.device", f"must be one of {sorted(_LINKS)}, got {device!r}")
    gpn = _num(doc, "gpus_per_node", "links", positive=True)
    if gpn != int(gpn):
        raise PlannerError("links.gpus_per_node", f"must be an integer, got {gpn}")
    raw_links = _section(doc, "links", "links")
    links = {}
    for key, value in raw_links.items():
        if not isinstance(value, Mapping):
            raise PlannerError(f"links.{key}", f"must be a mapping, got {value!r}")
        links[key] = _link(value, key)
    for key in _LINKS[device]:
        if key not in links:
            raise PlannerError(f"links.{key}", f"missing (a {device} links file needs "
                                               f"{', '.join(_LINKS[device])})")
    if "d2h" in links and device != "host":
        raise PlannerError("links.d2h", "a host links file's GPU (a trainer process on a GPU "
                                        "of the host); on a gpu links file every rank is a GPU")
    coll = _section(doc, "collective", "links", required=False)
    algo = coll.get("algo", "ring")
    if algo not in ("ring", "star"):
        raise PlannerError("links.collective.algo", f"must be 'ring' or 'star', got {algo!r}")
    cap = coll.get("GBps")
    cap = None if cap is None else _num(coll, "GBps", "links.collective", positive=True) * 1e9
    ring = _section(doc, "ring", "links", required=False)
    sw = _section(doc, "software", "links")
    software = {k: _num(sw, k, "links.software") * 1e-6 for k in _SOFTWARE}
    software["direct_wait_us"] = _num(sw, "direct_wait_us", "links.software", default=(
        software["control_us"] + software["tensor_us"]) * 1e6) * 1e-6
    software["handoff_us"] = _num(sw, "handoff_us", "links.software", default=0.0) * 1e-6
    software["finish_us"] = _num(sw, "finish_us", "links.software", default=0.0) * 1e-6
    window = _num(ring, "direct_window", "links.ring", positive=True, default=2)
    if window != int(window):
        raise PlannerError("links.ring.direct_window",
                           f"must be a whole number >= 1, got {window}")
    max_nodes = doc.get("max_nodes")
    if max_nodes is not None:
        max_nodes = int(_num(doc, "max_nodes", "links", positive=True))
    cores = doc.get("cores")
    if cores is not None:
        cores = _num(doc, "cores", "links", positive=True)
        if cores != int(cores) or device != "host":
            raise PlannerError("links.cores", f"a whole number, on a host links file only; "
                                              f"got {cores} on {device}")
        cores = int(cores)
    codec = _codec(_section(doc, "codec", "links", required=False))
    return Links(name=str(doc.get("name", name)), device=device, gpus_per_node=int(gpn),
                 links=links, collective_algo=algo, collective_cap=cap,
                 direct_min_bytes=int(_num(ring, "direct_min_bytes", "links.ring", default=0)),
                 direct_max_receivers=int(_num(ring, "direct_max_receivers", "links.ring",
                                               default=0)),
                 direct_rate=(_num(ring, "direct_GBps", "links.ring", positive=True) * 1e9
                              if ring.get("direct_min_bytes") else None),
                 software=software, direct_window=int(window), max_nodes=max_nodes,
                 cores=cores, codec=codec,
                 description=str(doc.get("description", "")), raw=dict(doc))


def preset_names() -> list[str]:
    return sorted(f[:-5] for f in os.listdir(PRESET_DIR) if f.endswith(".json"))


def _read(path: str) -> Any:
    try:
        with open(path) as f:
            text = f.read()
    except OSError as exc:
        raise PlannerError("links", f"cannot read {path}: {exc.strerror}") from None
    if path.endswith((".yaml", ".yml")):
        try:
            import yaml
        except ImportError:
            raise PlannerError("links", f"{path} is YAML but PyYAML is not installed "
                                        "(pip install pyyaml, or write the file as JSON)") from None
        try:
            return yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise PlannerError("links", f"{path} is not valid YAML: {exc}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise PlannerError("links", f"{path} is not valid JSON: {exc}") from None


def _override(doc: dict, overrides: Mapping[str, Any]) -> dict:
    """``{"links.nic.efficiency": 0.89}``: dotted paths into the document, set in a copy."""
    doc = json.loads(json.dumps(doc))
    for path, value in overrides.items():
        keys = path.split(".")
        node = doc
        for k in keys[:-1]:
            if not isinstance(node.get(k), dict):
                raise PlannerError(f"link-set.{path}", "no such section in the links file")
            node = node[k]
        node[keys[-1]] = value
    return doc


def load_links(spec: str | Mapping, overrides: Optional[Mapping[str, Any]] = None) -> Links:
    """A preset name (:func:`preset_names`), a path to a YAML/JSON file, or a mapping;
    ``overrides``: dotted fields to replace first (``{"links.nic.efficiency": 0.89}``)."""
    if isinstance(spec, Mapping):
        doc, name = dict(spec), str(spec.get("name", "links"))
    elif spec in preset_names():
        doc, name = _read(os.path.join(PRESET_DIR, spec + ".json")), spec
    elif not os.path.exists(spec):
        raise PlannerError("links", f"{spec!r} is neither a preset ({', '.join(preset_names())}) "
                                    "nor a file")
    else:
        doc, name = _read(spec), os.path.basename(spec)
    if overrides:
        if not isinstance(doc, Mapping):
            raise PlannerError("links", "a links file holds a mapping")
        doc = _override(dict(doc), overrides)
        changed = ", ".join(f"{k}={v}" for k, v in overrides.items())
        doc["name"] = f"{doc.get('name', name)} ({changed})"
    return parse_links(doc, name)
