"""``weightsync plan``: predict a weight sync on a cluster you do not have.

The prediction is built from the plan code the backends run -- the compiled transfer
plan of the ``nixl`` backend (:func:`weightsync.core.xferplan.compile_plan`) for
point-to-point pulls, the bucket plan (:func:`weightsync.core.plan.build_plan`) and the
trainer export's ownership and exchanges for broadcast and ring -- plus a link model
(bandwidth, latency, contention on each GPU's NIC and NVLink/PCIe, device and host
memory, host-side software costs). Modules:

* :mod:`.model` names and shapes from a config (meta device), :mod:`.rules` what each
  rollout worker keeps (the TP/EP slicing table, FP8 blocks);
* :mod:`.links` links files and presets, :mod:`.scenario` inputs and placement;
* :mod:`.compiled` compile_plan per distinct tensor layout, aggregated;
* :mod:`.linkmodel` the link model, :mod:`.p2p` and :mod:`.bucketed` the strategies,
  :mod:`.delta` any of them under the delta codec (``Scenario.delta``);
* :mod:`.predict` one prediction (JSON schema ``weightsync.plan/1``), :mod:`.report`
  table and plot, :mod:`.fit` a links file from your own ``weightsync bench --json`` run,
  :mod:`.cli` the subcommand.

Example::

    from weightsync.tools.planner import plan
    p = plan("kimi-k2", links="h100-8gpu-400g", trainer_gpus=256, replicas=8, tp=8, ep=2,
             dst_dtype="fp8")
    print(p.results["p2p"].seconds, p.bound["seconds"])
"""

from __future__ import annotations

from typing import Any, Optional

from weightsync.tools.planner.errors import PlannerError
from weightsync.tools.planner.fit import fit_links
from weightsync.tools.planner.links import Links, load_links, preset_names
from weightsync.tools.planner.model import ModelSpec, load_model, model_from_tensors, model_presets
from weightsync.tools.planner.predict import SCHEMA, Prediction, predict
from weightsync.tools.planner.report import format_table, plot
from weightsync.tools.planner.rules import TABLE
from weightsync.tools.planner.scenario import STRATEGIES, Scenario

__all__ = ["plan", "predict", "Scenario", "Prediction", "PlannerError", "ModelSpec",
           "load_model", "model_from_tensors", "model_presets", "Links", "load_links",
           "preset_names", "format_table", "plot", "TABLE", "STRATEGIES", "SCHEMA", "fit_links"]


def plan(model: str | ModelSpec, *, links: str | Links = "h100-8gpu-400g",
         rollout_links: Optional[str | Links] = None, overrides: Optional[dict] = None,
         **kwargs: Any) -> Prediction:
    """Predict one sync: ``model`` (preset, config folder/JSON, config class name, or a
    :class:`ModelSpec`), ``links`` (preset, file or :class:`Links`), and the other
    :class:`Scenario` fields as keywords (``trainer_gpus``, ``replicas``, ``tp``, ``ep``,
    ``src_dtype``, ``dst_dtype``, ``strategies``, ...)."""
    spec = model if isinstance(model, ModelSpec) else load_model(model, overrides)
    lk = links if isinstance(links, Links) else load_links(links)
    rl = None if rollout_links is None else (
        rollout_links if isinstance(rollout_links, Links) else load_links(rollout_links))
    return predict(Scenario(model=spec, links=lk, rollout_links=rl, **kwargs))
