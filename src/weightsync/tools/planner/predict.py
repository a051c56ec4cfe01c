"""One prediction: a :class:`Scenario` in, every strategy's figures and the bound out.

Owns :func:`predict` and :class:`Prediction` (with ``to_dict``, the JSON schema
``weightsync.plan/1``). The line-rate bound of a worker is the bytes it keeps (in its
dtype: FP8 weights and their scales) over the line rate of the links its bytes can
arrive on (its NIC when some trainer rank is on another node, plus its NVLink / cross-
memory path when one is on its node, plus its memory when one shares its device; from
a host's GPU trainers, their device-to-host links instead of the cross-memory path); the
bound of the sync is the largest over workers, and every strategy's ratio is its
predicted time over that bound.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from weightsync.tools.planner.bucketed import predict_bucketed
from weightsync.tools.planner.compiled import PullStats, pull_stats
from weightsync.tools.planner.delta import predict_delta, records
from weightsync.tools.planner.linkmodel import StrategyResult
from weightsync.tools.planner.p2p import predict_p2p
from weightsync.tools.planner.rules import kept_bytes, planned_tensors
from weightsync.tools.planner.scenario import Placement, Scenario

__all__ = ["predict", "Prediction", "SCHEMA"]

SCHEMA = "weightsync.plan/1"


@dataclass
class Prediction:
    scenario: Scenario
    placement: Placement
    results: dict[str, StrategyResult]
    bound: dict[str, Any]
    stats: PullStats | None
    seconds: float
    notes: list[str] = field(default_factory=list)
    #: per strategy, with ``Scenario.delta``: the records' figures (:func:`.delta.predict_delta`)
    delta: dict[str, dict] = field(default_factory=dict)

    def ratio(self, strategy: str) -> float | None:
        r = self.results[strategy]
        return r.seconds / self.bound["seconds"] if r.applicable and self.bound["seconds"] else None

    def to_dict(self) -> dict:
        return _to_dict(self)


def _bound(sc: Scenario, pl: Placement, pts) -> dict[str, Any]:
    kept = [sum(kept_bytes(pt, g) for pt in pts) for g in range(sc.replica_size)]
    best = {"seconds": 0.0}
    for i, dev in enumerate(pl.worker):
        links, rate, via = pl.links_of(dev), 0.0, []
        gpu = sc.trainer_device == "gpu"
        for name, hit in (("nic", any(t[0] != dev[0] for t in pl.trainer)),
                          ("intra", not gpu and any(t[0] == dev[0] and t != dev
                                                    for t in pl.trainer)),
                          ("device_mem", dev in pl.trainer)):
            if hit:
                rate += links.link(name).line_rate
                via.append(name)
        if gpu:     # a host's GPU trainers write into its memory, each over its own D2H link
            rate += len(pl.trainer) * links.link("d2h").line_rate
            via.append("d2h")
        secs = kept[i % sc.replica_size] / rate
        if secs > best["seconds"]:
            best = {"seconds": secs, "bytes": kept[i % sc.replica_size],
                    "ingress_GBps": rate / 1e9, "via": via, "worker": pl.who(dev)}
    return best


def predict(sc: Scenario) -> Prediction:
    """Predict every strategy of ``sc.strategies`` (see the package doc)."""
    t0 = time.perf_counter()
    pl = Placement(sc)
    pts, notes = planned_tensors(sc.model, sc.tp, sc.ep, sc.src_dtype, sc.dst_dtype, sc.fp8_at,
                                 sc.trainer_tp, sc.trainer_ep)
    stats, results, delta = None, {}, {}
    for strategy in sc.strategies:
        if sc.delta is not None and not (strategy == "p2p" and sc.trainer_device == "gpu"):
            results[strategy], delta[strategy] = predict_delta(sc, pl, pts, strategy)
        elif strategy == "p2p" and sc.trainer_device == "gpu":
            results[strategy] = StrategyResult(strategy, applicable=False, reason=(
                "p2p from a GPU trainer into processes of a host is not modelled "
                "(trainer.device gpu: ring, i.e. shm, only)"))
        elif strategy == "p2p":
            stats = pull_stats(pts, sc.trainer_gpus, sc.replica_size, sc.max_read_bytes,
                               sc.trainer_shard, sc.replicas)
            results[strategy] = predict_p2p(sc, pl, pts, stats)
        else:
            results[strategy] = predict_bucketed(sc, pl, pts, strategy)
    if sc.delta is not None:        # what each worker takes in: the records
        pts = records(pts, sc.delta, sc.replica_size)[0]
    return Prediction(sc, pl, results, _bound(sc, pl, pts), stats,
                      time.perf_counter() - t0, list(sc.notes) + notes, delta)


def _spread(values: list[float], who) -> dict[str, Any]:
    if not values:
        return {}
    top = max(range(len(values)), key=values.__getitem__)
    return {"min": min(values), "mean": sum(values) / len(values), "max": values[top],
            "max_at": who(top), "values": values}


def _strategy_dict(p: Prediction, name: str) -> dict:
    r, pl = p.results[name], p.placement
    if not r.applicable:
        return {"applicable": False, "reason": r.reason}
    b = r.bottleneck
    return {"applicable": True, "seconds": r.seconds, "ratio_to_bound": p.ratio(name),
            "bottleneck": {"phase": b.name, "limited_by": b.limit, "seconds": b.limit_seconds},
            "phases": [ph.to_dict() for ph in r.phases], "links": r.links,
            "bytes_per_source": _spread(r.source_bytes, lambda i: f"trainer rank {i}"),
            "bytes_per_dest": _spread(r.dest_bytes, lambda i: pl.who(pl.worker[i])),
            "reads_per_dest": _spread(r.dest_reads, lambda i: pl.who(pl.worker[i])),
            "reads_total": sum(r.dest_reads), "notes": r.notes,
            **({"delta": p.delta[name]} if name in p.delta else {})}


def _to_dict(p: Prediction) -> dict:
    sc, links = p.scenario, p.scenario.links
    plan = None
    if p.stats is not None:
        plan = {"compile_plan_calls": p.stats.compile_calls,
                "compile_seconds": p.stats.compile_seconds,
                "classes": [vars(c) for c in p.stats.classes]}
    return {
        "schema": SCHEMA,
        "scenario": {"label": sc.label, "model": sc.model.name, "params": sc.model.params,
                     "tensors": len(sc.model.tensors), "model_note": sc.model.note,
                     "src_dtype": sc.src_dtype, "dst_dtype": sc.dst_dtype, "fp8_at": sc.fp8_at,
                     "trainer": {"gpus": sc.trainer_gpus, "shard": sc.trainer_shard,
                                 "tp": sc.trainer_tp, "ep": sc.trainer_ep,
                                 "layout": sc.trainer_layout,
                                 "device": sc.trainer_device},
                     "shared": sc.shared, "delta": sc.delta,
                     "rollout": {"replicas": sc.replicas, "tp": sc.tp, "ep": sc.ep,
                                 "workers": sc.workers, "placement": sc.placement},
                     "links": links.name,
                     "rollout_links": (sc.rollout_links or links).name,
                     "nodes": p.placement.nodes, "bucket_size": sc.bucket_size,
                     "max_read_bytes": sc.max_read_bytes},
        "bound": p.bound, "plan": plan,
        "strategies": {name: _strategy_dict(p, name) for name in p.results},
        "notes": p.notes, "planning_seconds": p.seconds,
    }
