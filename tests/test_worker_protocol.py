"""The manager's worker protocol is typed once (weightsync.orchestration.workers): the
names, the Protocol classes and the Ray mixins that implement them agree."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

from weightsync.integrations.ray.mixins import RolloutWorkerMixin, TrainerWorkerMixin
from weightsync.orchestration import workers

SRC = Path(workers.__file__).resolve().parents[1]


def members(proto) -> set[str]:
    return {n for n in vars(proto) if n.startswith("ws_")}


def params(fn) -> list:
    """A call's parameters, less the ``_ray_trace_ctx`` keyword that Ray adds to the
    methods of a class once the class has been made an actor in this process."""
    return [p for p in inspect.signature(fn).parameters.values() if p.name != "_ray_trace_ctx"]


@pytest.mark.parametrize("proto, calls, mixin", [
    (workers.TrainerWorker, workers.TRAINER_CALLS, TrainerWorkerMixin),
    (workers.RolloutWorker, workers.ROLLOUT_CALLS, RolloutWorkerMixin),
])
def test_names_protocols_and_mixins_agree(proto, calls, mixin):
    assert members(proto) == set(calls)
    assert len(set(calls)) == len(calls)
    assert isinstance(mixin(), proto)
    for name in calls:
        assert params(getattr(mixin, name)) == params(getattr(proto, name)), name
        assert inspect.getdoc(getattr(proto, name)), f"{name} is undocumented"


def test_every_constant_is_a_call_of_some_side():
    names = {v for k, v in vars(workers).items() if k.isupper() and isinstance(v, str)}
    assert names == set(workers.TRAINER_CALLS) | set(workers.ROLLOUT_CALLS)


def test_an_object_missing_a_call_is_not_a_worker():
    class Partial(TrainerWorkerMixin):
        ws_send = None

    assert not isinstance(Partial(), workers.TrainerWorker)
    assert not isinstance(object(), workers.TrainerWorker)
    assert not isinstance(RolloutWorkerMixin(), workers.TrainerWorker)


def test_no_module_spells_the_call_names_itself():
    """Call sites use the constants; only workers.py holds the strings."""
    pattern = re.compile(r"""["']ws_[a-z_]+["']""")
    found = [f"{p.relative_to(SRC)}:{i}" for p in SRC.rglob("*.py") if p.name != "workers.py"
             or p.parent.name != "orchestration"
             for i, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert not found, found
