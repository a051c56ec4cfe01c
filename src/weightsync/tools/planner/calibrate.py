"""Predicted vs measured: every recorded benchmark run the planner can model, predicted.

Owns :func:`run` (the cases and their rows), :func:`run_links` (the link rates a bench run
recorded beside a case), :func:`format_text` and :func:`format_markdown`. Measurements come
from ``benchmarks/results/`` of the checkout: the runs of :data:`CPU_RUNS` (``shm``,
``shm-buckets``, ``shm-direct``, ``collective``, and each one's ``@readme`` row (consumed as
the README shows: torch's default threads), read as the method, as is every method of a
run with ``--threads 0`` (:func:`_readme_run`); 1/2/4 receivers; the bench's own
workloads, :mod:`weightsync.tools.bench.workloads`, on the ``cpu-2core`` preset; with every
other recorded run of those methods, :data:`CPU_RUNS_MORE`, each with what its code set), the
``cpu-nixl-*`` runs of :data:`NIXL_RUNS` (``nixl``: the ``p2p`` strategy as the backend ran
then; the runs whose bench kept a core spinning beside them, :data:`SPUN_RAW`, shown apart
and not counted), ``gpu-h200-2026-11-29/bench_final.json`` and ``gpu-h200-2026-12-01`` (``cuda_ipc``
bucket ring, one H200: the ``ring`` strategy, colocated), ``multi-gpu-h200x2-2026-11-29``
and ``multi-gpu-h200x4-2026-11-29`` and ``multi-gpu-h200x2-2026-12-04`` (``collective`` on
NCCL: 1 -> 1, 1 -> 2, 2 senders -> 2; the ``broadcast`` strategy, packed on one node), and
that 12-04 run's ``nixl`` 1 -> 1 across two GPUs (the ``p2p`` strategy), ``nixl`` on CPU
from 2 trainer ranks into 2 TP-2 workers with and without box-by-box staging
(:data:`NIXL_TP_RUNS`, ``cpu-nixl-tp-2026-12-04``: ``p2p``, ``cut``), and the ``shm``
paths with torch shared memory on either side: the CPU runs ``cpu-2026-12-04-s16``
(``shm-shared``: ``ring`` with ``shared="trainer"``; ``shm-push``: ``shared="receivers"``)
and ``gpu-h200-2026-12-04-s16/shm_d2h.json`` and ``gpu-h100-2026-12-05/shm_d2h.json``
(:data:`SHM_D2H_RUNS`: a GPU trainer into a CPU receiver on one GPU host, ``h200-host``
with the run's own D2H and host-copy rates, ``trainer_device="gpu"``, through the pinned
ring or pushed). GPU model shapes are taken from the
benchmark scripts themselves (``benchmarks/gpu_bench.py``, ``benchmarks/multi_gpu.py``,
loaded by path).

A link model is judged given the link rates the box had during the run: every bench run
records its own limits beside the weightsync methods (:data:`RUN_LIMITS`: ``memcpy``,
``memcpy-parallel``, ``gloo-flat``, ``nixl-raw``, ``cma-raw`` where a run has it, and the
``memcpy`` over all cores paired with ``@readme`` steps, a ceiling of ``host_mem``, never
``device_mem``; the GPU scripts a flat D2D copy,
a raw NCCL broadcast, shm_d2h a pinned D2H copy and the receiver's host copy), so each case is predicted with the preset's links *set from the limits
its own run recorded* (paired with its steps where the bench paired them). Those rows are
the calibration (``rows``, counted against :data:`GOAL`). The same cases predicted with
the preset's fixed rates alone are kept apart (``preset_rows``, "preset vs this run's box":
printed, not counted). A case whose run recorded no limit is predicted with the preset and
counted. A run without ``cma-raw`` (before it existed) has its direct reads
(``ring.direct_GBps``) priced at its own ``memcpy`` rate (the two were 0.87-1.18 x apart
where a run recorded both), and a step with a paired ``memcpy`` at that one, over the run's
``cma-raw`` (timed at another moment, when the box may have been faster). What a run does not record (the ``software`` costs,
latencies) comes from the preset, whose file says which of those are measured and which are
assumed. The limits themselves are inputs, not calibration cases. ``cuda_ipc`` zero-copy
and pushes are the ``ring`` strategy with ``Scenario.shared`` ``"trainer"`` / ``"receivers"``
on the GPU preset, for the code of 12-04 on (whose host costs its timeline measured). Runs
whose ``shm`` trainer waited for each direct read (the code before the direct window, or
``WEIGHTSYNC_SHM_DIRECT_WINDOW=1``) are predicted with ``ring.direct_window`` 1
(:data:`WAITED`). Not modelled: zero-copy of older code, the verl-style baseline, Ray and
the other baselines, receivers consuming with ``receive_weights`` + ``copy_``.

Repeats (:data:`REPEATS`, :func:`repeat_groups`): a case measured in several runs that
BENCHMARKS.md documents as the same code and the same command is a group of repeats. Where
their measurements lie further apart than ``(1 + GOAL) / (1 - GOAL)`` (1.667 x for +-25 %),
no one number is within the goal of all of them: the group is ``noisy``. Its rows stay in
the count of rows; the summary says how many misses are in noisy groups, and how far apart
the repeats stay once each run's own limits are applied (``residual_spread``: measured /
predicted), which tells box noise the limits caught from noise they did not. Counted by
case (:func:`by_case`), a group is one case, judged by the median of its runs' errors: a
run that the box slowed (this 2-core box shares its cores with whatever else runs) is
then outvoted by repeats of the same code, instead of standing alone as a miss; the count
of rows, every run's miss included, is printed beside it.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import json
import math
import os
import sys
import statistics
from collections import defaultdict
from typing import Any, Callable, Mapping, Optional

from weightsync.tools.planner.errors import PlannerError
from weightsync.tools.planner.links import Links, load_links
from weightsync.tools.planner.model import ModelSpec, model_from_tensors
from weightsync.tools.planner.predict import predict
from weightsync.tools.planner.scenario import Scenario

__all__ = ["run", "run_links", "format_text", "format_markdown", "results_dir", "GOAL",
           "GROUPS", "RUN_LIMITS", "RunLimit", "REPEATS", "repeat_groups", "by_case"]

GOAL = 0.25
_ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "..", ".."))


def results_dir() -> str:
    path = os.path.join(_ROOT, "benchmarks", "results")
    if not os.path.isdir(path):
        raise PlannerError("calibrate", f"no benchmarks/results under {_ROOT}: run from a "
                                        "checkout of weightsync")
    return path


def _json(root: str, *parts: str) -> dict:
    path = os.path.join(root, *parts)
    with open(path) as f:
        return json.load(f)


def _script(name: str) -> Any:
    path = os.path.join(_ROOT, "benchmarks", name + ".py")
    spec = importlib.util.spec_from_file_location(f"weightsync_bench_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod        # dataclasses look their module up while it loads
    spec.loader.exec_module(mod)
    return mod


# ------------------------------------------------------------------ the run's own limits

@dataclasses.dataclass(frozen=True)
class RunLimit:
    """A limit the CPU bench records beside the weightsync methods (its ``method``,
    :mod:`weightsync.tools.bench.methods`) and the field of the links file it sets:
    ``bytes x (receivers if per_receiver else 1) / warm_median_s``, in GB/s, from the
    record of the same receiver count; with ``ceiling``, the highest such rate of any
    receiver count the run recorded (a per-node capacity: the most the host reached). With
    ``host`` (a property of the host, not of the workload), the median rate of all the
    run's records of it with two or more processes, every workload's: one workload's best
    record takes its luckiest one (the Qwen2 R=4 ``memcpy-parallel`` of session 27's run
    reached 16.5 GB/s where the run's other five records of 2+ processes had 11.8-13.8)."""

    method: str
    field: str
    per_receiver: bool
    what: str
    ceiling: bool = False
    host: bool = False


#: the ``memcpy`` the bench paired with the steps of its ``@readme`` methods: torch's
#: default threads in every process, the limit's too (one per core of the box)
_ALL_CORES = "memcpy@all-cores"
#: the bench's suffix of a method consumed the README's way
README = "@readme"

#: every limit the CPU bench records and the link it sets
RUN_LIMITS = (
    RunLimit(method="memcpy", field="links.device_mem.GBps", per_receiver=False,
             what="one flat copy in one process"),
    RunLimit(method="memcpy-parallel", field="links.host_mem.GBps", per_receiver=True,
             ceiling=True, host=True,
             what="R processes copying the bytes at once; host_mem is every copy of the node "
                  "together: the median over the run's records of 2+ processes (any R)"),
    RunLimit(method="gloo-flat", field="collective.GBps", per_receiver=True,
             what="one raw gloo broadcast of a flat buffer (gloo sends each receiver a copy)"),
    RunLimit(method="nixl-raw", field="links.intra.GBps", per_receiver=False,
             what="one raw NIXL READ of a flat region into each receiver"),
    RunLimit(method="cma-raw", field="ring.direct_GBps", per_receiver=True,
             what="every receiver reads the trainer's flat buffer at once with cross-memory "
                  "reads over its copy threads (what shm's direct reads can reach)"),
    RunLimit(method=_ALL_CORES, field="links.host_mem.GBps", per_receiver=False,
             ceiling=True, what="one flat memcpy over torch's default threads, every core of "
                                "the box (the memcpy the bench paired with its @readme steps): "
                                "a copy on all cores is the most the host's copies reach, as "
                                "memcpy-parallel's processes; the higher of the two"),
)


#: the link a run's ``memcpy`` sets, and the direct reads' rate it stands in for where the
#: run recorded no ``cma-raw`` (:func:`run_links`)
MEMCPY_FIELD = "links.device_mem.GBps"
DIRECT_FIELD = "ring.direct_GBps"


def _seconds(rec: Mapping, where: str) -> float:
    s = rec.get("warm_median_s")
    if isinstance(s, bool) or not isinstance(s, (int, float)) or not s > 0:
        raise PlannerError("calibrate", f"{where}: warm_median_s must be > 0, got {s!r}")
    return float(s)


def _rate(lim: RunLimit, rec: Mapping, seconds: float) -> float:
    return (rec["receivers"] if lim.per_receiver else 1) * rec["bytes"] / seconds / 1e9


def run_links(rec: Mapping, limits: Mapping[str, list]) -> tuple[dict[str, float],
                                                                 dict[str, str]]:
    """The link rates ``rec``'s steps had, from the :data:`RUN_LIMITS` the same run
    recorded for the same workload and dtype (``limits``: method -> its records, one per
    receiver count): the limit the bench paired with ``rec``'s steps (run right before
    each step, in the same processes) where it paired that one, else the limit's own
    record of the same receiver count (of any, for a ``ceiling``; for a ``host`` limit the
    median of the run's records of 2+ processes, none where it has none: one process
    copying alone is not the node's copies together). Returns the
    :func:`~.links.load_links` overrides and, per field, where it came from; both empty
    when the run recorded none of them. Without ``cma-raw``, or where the step has a paired
    ``memcpy``, the direct reads take the ``memcpy``'s rate."""
    paired = rec.get("paired") or {}
    if rec["method"].endswith(README) and paired.get("method") == "memcpy":
        # the bench ran that memcpy with torch's default threads too: a copy over every core
        # (:data:`_ALL_CORES`, a ceiling of host_mem), not one thread's rate
        paired = {}
    sets, where = {}, {}
    for lim in RUN_LIMITS:
        same = [r for r in limits.get(lim.method, ())
                if lim.ceiling or r["receivers"] == rec["receivers"]]
        if paired.get("method") == lim.method and not lim.ceiling:
            rate = _rate(lim, rec, _seconds(paired, f"{rec['method']} paired {lim.method}"))
            how = "paired"
        elif lim.host and limits.get(_host_key(lim.method)):
            pool = limits[_host_key(lim.method)]
            rate = statistics.median(_rate(lim, r, _seconds(r, lim.method)) for r in pool)
            how = f"median of the run's {len(pool)} records of 2+ processes"
        elif lim.host:
            continue    # one process copying (R=1) is not every copy of the node together
        elif same:
            best = max(same, key=lambda r: _rate(lim, r, _seconds(r, lim.method)))
            rate = _rate(lim, best, _seconds(best, lim.method))
            how = f"own run, R={best['receivers']}" if lim.per_receiver else "own run"
        else:
            continue
        if lim.ceiling and sets.get(lim.field, 0.0) >= rate:
            continue        # a ceiling: the most any limit of that field reached
        sets[lim.field], where[lim.field] = rate, f"{lim.method}, {how}"
    memcpy_paired = paired.get("method") == "memcpy" and MEMCPY_FIELD in sets
    if MEMCPY_FIELD in sets and (DIRECT_FIELD not in sets or memcpy_paired):
        # shm's direct reads (process_vm_readv, a copy the kernel makes) at the run's own
        # one-process memcpy rate rather than the preset's fixed rate where the run has no
        # cma-raw (where a run recorded both, cma-raw / memcpy was 0.87-1.18: 12-04b, s14),
        # and at the memcpy paired with the step over the run's cma-raw, timed at another
        # moment: in 12-04b the box ran the paired memcpy at 8.0-8.7 GB/s where its cma-raw
        # had 10.6-12.3 (and its other memcpy records 9.7-10.5), so the box as the step
        # found it is the better measure of both copies
        sets[DIRECT_FIELD] = sets[MEMCPY_FIELD]
        why = "paired with the step, over the run's cma-raw" if DIRECT_FIELD in where else \
            "the run has no cma-raw"
        where[DIRECT_FIELD] = f"= device_mem ({where[MEMCPY_FIELD]}; {why})"
    return sets, where


def _host_key(method: str) -> str:
    return f"{method}@host"


def _limits_by_case(results: list[dict]) -> dict[tuple, dict[str, list]]:
    """(workload, dtype) -> {limit method: its records} of one run; a ``host`` limit's
    records of 2+ processes of every workload also under :func:`_host_key` in each."""
    names = {lim.method for lim in RUN_LIMITS}
    out: dict[tuple, dict[str, list]] = defaultdict(lambda: defaultdict(list))
    for r in results:
        if r["status"] == "ok" and r["method"] in names:
            out[(r["workload"], r["dtype"])][r["method"]].append(r)
        paired = r.get("paired") or {}
        if r["status"] == "ok" and r["method"].endswith(README) and \
                paired.get("method") == "memcpy":
            out[(r["workload"], r["dtype"])][_ALL_CORES].append(
                {"method": _ALL_CORES, "receivers": r["receivers"], "bytes": r["bytes"],
                 "warm_median_s": paired["warm_median_s"]})
    for lim in RUN_LIMITS:
        if lim.host:
            pool = [r for r in results if r["status"] == "ok" and r["method"] == lim.method
                    and r["receivers"] >= 2]
            for key in list(out):
                out[key][_host_key(lim.method)] = pool
    return out


def _describe(sets: Mapping[str, float], where: Mapping[str, str]) -> str:
    """``device_mem 10.5 GB/s (memcpy, paired); ...; the rest preset``."""
    parts = []
    for k, v in sets.items():
        keys = [x for x in k.split(".") if x != "links"]
        if keys[-1] == "GBps":
            parts.append(f"{' '.join(keys[:-1])} {v:.3g} GB/s ({where[k]})")
        else:
            parts.append(f"{' '.join(keys)} {v:.3g} ({where[k]})")
    return "; ".join(parts) + "; the rest preset"


# ------------------------------------------------------------------ repeats

#: Runs of the same code and the same command (``folder/file`` -> the name of their set):
#: a case measured in more than one of a set is a group of repeats (:func:`repeat_groups`).
#: Only runs BENCHMARKS.md documents as such:
#: - ``cpu-2026-11-29`` and the two runs of ``cpu-2026-12-06-s25-1129code``: the code of
#:   11-29's run (``git archive dda6fe7 src``) run again on 12-06 with that run's bench
#:   command less the cases no calibration reads (Ray and the other baselines) and the
#:   0.25 GiB workload; every case's steps are paired with its own limits as on 11-29;
#: - ``cpu-calib-2026-12-03`` and the two runs of ``cpu-2026-12-06-s27-1203code``: the code
#:   at 4a44e05, the HEAD when 12-03's run started (its load average was 2.3 then), run again
#:   on 12-06 with that run's command less the 1 and 4 GiB workloads and ``collective``. The
#:   next commit to touch ``src/`` for the CPU path (354756b) changed ``shm`` only for GPU
#:   trainers (pinned ring) and receivers with 3 or more copy threads (2 on this box);
#: - ``cpu-lasting-2026-12-03``'s ``bench_1g`` (a loaded box) and the three runs of
#:   ``cpu-2026-12-06-s27-lastingcode``: the code of a958c09, that command less ``nixl``;
#: - ``cpu-calib-2026-12-04`` and ``-04b``: "two quiet-box runs of today's code ... the same
#:   command" (12-04b adds the ``cma-raw`` limit; between the two only the bench, the planner
#:   and nixl's plan compiler changed, none of ``shm`` / ``collective``);
#: - ``cpu-nixl-2026-12-01`` runs 1 and 2: the same command; run 2 came after the cold fix
#:   (no ``torch.distributed.tensor`` import on a cold sync), which warm syncs never ran.
#: - ``cpu-nixl-pipelined-2026-12-02/bench_1g_pipeline_off.json`` and the two runs of
#:   ``cpu-2026-12-06-s25-1202code``: the code of 1945088 (``git archive``), the same
#:   command under ``WEIGHTSYNC_NIXL_PIPELINE=0``, run again on 12-06.
#: - ``cpu-nixl-2026-12-06-s26``: the code of f7466f0, each command twice; ``ab/`` runs
#:   the bench of 60c2f4f (``_old_``) and of f7466f0 (``_new_``) over that engine code,
#:   alternating (``commands.txt``).
#: - ``cpu-2026-12-05-s17`` (before / after, two runs each) and ``cpu-2026-12-05-s22`` (each
#:   of its three commands before / after, two or three runs each), alternating in one
#:   script each (:data:`CPU_RUNS_MORE`);
#: - ``gpu-h100-2026-12-06-s26``: the ring codes of 11-29 and 12-01 on one held H100,
#:   :data:`S26_RING`;
#: - ``gpu-h200-2026-11-29``: the reported run and runs 6, 7 and 8 (:data:`H200_1129_RUNS`),
#:   whose ring is the committed ring;
#: - ``cpu-2026-12-04-s14``'s ``tuned`` and ``tuned_direct1m`` and session 27's runs of that
#:   code with the same two commands (``cpu-2026-12-06-s27-s14code``, :data:`CPU_RUNS_MORE`);
#: - ``cpu-shm-window-2026-12-06-s28``: session 28's code, three rounds of the direct window
#:   at 1 then at 2, each window's three runs a group;
#: - ``cpu-2026-12-06-s27/bench.json`` and ``cpu-2026-12-06-s28-s27code``: the code of
#:   f3939a7 (``git archive``) with session 27's command, once then, twice in session 28.
#: - ``cpu-2026-12-07-s35-repeats`` (session 35, ``run.sh``): four recorded runs' codes
#:   (``git archive``) each run again twice, alternating, with that run's command less the
#:   cases no calibration reads: 11-29's earlier run and its fp32 run (7209436, the last
#:   code with direct reads from 1 MiB), the 12-03 review's runs after the mend (3986479:
#:   ``after_mend_1g``, and ``shm_window1_mend`` under ``WEIGHTSYNC_SHM_DIRECT_WINDOW=1``)
#:   and the 12-02 delta run (26065dd; here with the limits that run did not record).
#: Runs of other days ran other code (the direct window of 12-03, the copy threads and
#: pipelined nixl of later days), so they are not repeats of one another.
_S35 = "cpu-2026-12-07-s35-repeats"
#: session 35's runs again (:data:`REPEATS`): its file stem -> (the recorded run, the set)
S35_REPEATS = {"prev": ("cpu-2026-11-29/bench-previous-run.json",
                        "CPU runs of the code of 7209436 (11-29, direct from 1 MiB)"),
               "fp32": ("cpu-2026-11-29/bench-fp32.json",
                        "CPU fp32 runs of the code of 7209436 (11-29, direct from 1 MiB)"),
               "mend": ("review-2026-12-03/after_mend_1g.json",
                        "CPU runs of the code of 3986479 (12-03 review, after the mend)"),
               "mendw1": ("review-2026-12-03/shm_window1_mend.json",
                          "CPU runs of the code of 3986479 (12-03 review, after the mend), "
                          "direct window 1"),
               "delta": ("delta-2026-12-02/bench_256mib.json",
                         "CPU runs of the code of 26065dd (12-02 delta run)")}
REPEATS = {**{f: rset for f, rset in S35_REPEATS.values()},
           **{f"{_S35}/{stem}_r{k}.json": rset for stem, (_, rset) in S35_REPEATS.items()
              for k in (1, 2)},
           "cpu-2026-11-29/bench.json": "CPU runs of the code of 11-29",
           "cpu-2026-12-06-s25-1129code/bench_run1.json": "CPU runs of the code of 11-29",
           "cpu-2026-12-06-s25-1129code/bench_run2.json": "CPU runs of the code of 11-29",
           "cpu-lasting-2026-12-03/bench_1g.json": "CPU runs of the code of a958c09 (12-03)",
           **{f"cpu-2026-12-06-s27-lastingcode/bench_1g_run{k}.json":
              "CPU runs of the code of a958c09 (12-03)" for k in (1, 2, 3)},
           **{f"cpu-shm-window-2026-12-06-s28/window{w}_r{k}.json":
              f"CPU runs of 12-06 s28, direct window {w}" for w in (1, 2) for k in (1, 2, 3)},
           **{f: "CPU runs of the code of f3939a7 (12-06 s27)"
              for f in ("cpu-2026-12-06-s27/bench.json",
                        "cpu-2026-12-06-s28-s27code/bench_run1.json",
                        "cpu-2026-12-06-s28-s27code/bench_run2.json")},
           "cpu-calib-2026-12-03/bench.json": "CPU runs of the code of 12-03",
           "cpu-2026-12-06-s27-1203code/bench_run1.json": "CPU runs of the code of 12-03",
           "cpu-2026-12-06-s27-1203code/bench_run2.json": "CPU runs of the code of 12-03",
           "cpu-calib-2026-12-04/bench.json": "CPU quiet-box runs of 12-04",
           "cpu-calib-2026-12-04b/bench.json": "CPU quiet-box runs of 12-04",
           "cpu-nixl-pipelined-2026-12-02/bench_1g_pipeline_off.json":
               "nixl runs of the code of 12-02, not pipelined",
           "cpu-2026-12-06-s25-1202code/bench_1g_pipeline_off_run1.json":
               "nixl runs of the code of 12-02, not pipelined",
           "cpu-2026-12-06-s25-1202code/bench_1g_pipeline_off_run2.json":
               "nixl runs of the code of 12-02, not pipelined",
           "cpu-nixl-2026-12-06-s25/progress/default_auto_1.json":
               "nixl runs of 12-06, receivers without the progress thread",
           "cpu-nixl-2026-12-06-s25/progress/default_auto_2.json":
               "nixl runs of 12-06, receivers without the progress thread",
           "cpu-nixl-2026-12-01/bench_1g.json": "nixl runs of 12-01",
           "cpu-nixl-2026-12-01/bench_1g_run2.json": "nixl runs of 12-01",
           **{f"cpu-nixl-2026-12-06-s26/ab/{case}_{bench}_{i}.json":
              f"nixl runs of 12-06 s26, the bench of {commit}"
              for case in ("default", "pipeline_off") for i in (1, 2)
              for bench, commit in (("old", "60c2f4f"), ("new", "f7466f0"))},
           **{f"cpu-nixl-2026-12-06-s26/staging_{i}.json":
              "nixl runs of 12-06 s26, the bench of f7466f0" for i in (1, 2)},
           **{f"cpu-2026-12-05-s17/{when}-r{k}.json": f"CPU runs of 12-05 s17, {when}"
              for when in ("before", "after") for k in (1, 2)},
           **{f"cpu-2026-12-05-s22/bench-{cmd}{when}-r{k}.json":
              f"CPU runs of 12-05 s22, bench-{cmd}{when}"
              for cmd in ("", "r1-", "readme-") for when in ("before", "after")
              for k in (1, 2, 3)},
           **{f"cpu-2026-12-04-s14/{cmd}.json": f"CPU runs of the code of 12-04 s14, {cmd}"
              for cmd in ("tuned", "tuned_direct1m")},
           **{f"cpu-2026-12-06-s27-s14code/{cmd}_r{k}.json":
              f"CPU runs of the code of 12-04 s14, {cmd}"
              for cmd in ("tuned", "tuned_direct1m") for k in (1, 2, 3)},
           **{f"gpu-h100-2026-12-06-s26/call{c}/{code}/r{k}/gpu_bench.json":
              "H100 runs of 12-06 s26 on one machine"
              for c in (1, 2) for k in (1, 2, 3) for code in ("c1129", "c1201")},
           **{f"gpu-h100-2026-12-07-{s}-delta/r{k}/c{ch}/gpu_bench.json":
              f"H100 runs of 12-07 {s} (delta calls) on one machine"
              for s in ("s34", "s35") for k in (1, 2) for ch in ("0.005", "0.05")},
           **{f"cpu-tiny-2026-12-07-s34/tiny_r{k}.json": "CPU tiny runs of 12-07 s34"
              for k in (2, 3)},
           **{f"gpu-h100-2026-12-05-s20/{name}": "H100 runs of 12-05 s20 (4414fc4), a "
              "machine each" for name in ("gpu_bench.json", "gpu_bench_span.json",
                                         "gpu_bench_replay.json")},
           **{f"gpu-{gpu}-2026-12-05-s21/{call}/r{k}_settle{st}/gpu_bench.json":
              f"{gpu.upper()} runs of 12-05 s21 {call} on one machine"
              for gpu, call in (("h100", "call3"), ("h200", "call4"))
              for k in (1, 2) for st in (0, 200)},
           **{f"gpu-h200-2026-12-05-branches/gpu_bench_r{k}.json":
              "H200 runs of 12-05 (f0d5d19) on one machine" for k in (1, 2)},
           **{f"gpu-h100-2026-12-06-s29b/r{k}/gpu_bench.json":
              "H100 runs of 12-06 s29 of today's ring" for k in (1, 2)},
           **{f"gpu-h100-2026-12-06-{s}/{code}/r{k}/gpu_bench.json":
              f"H100 runs of 12-06 {s} on one machine"
              for s in ("s30", "s31") for code in ("c1129", "c1201", "now")
              for k in (1, 2, 3, 4)},
           **{f"gpu-h100-2026-12-07-{s}/{code}/r{k}/gpu_bench.json": f"H100 runs of 12-07 {s} on "
              "one machine" for s in ("s34", "s34b") for code in ("c1129", "c1201", "now")
              for k in (1, 2)},
           **{f"gpu-h100-2026-12-07-s33/{code}/r{k}/gpu_bench.json":
              "H100 runs of 12-07 s33 on one machine"
              for code in ("c1129", "c1201", "now") for k in (1, 2, 3)},
           **{f"gpu-h200-2026-12-07-s33/{code}/r{k}/gpu_bench.json":
              "H200 runs of 12-07 s33 on one machine"
              for code in ("c1129", "c1201", "now") for k in (1, 2, 3, 4)},
           **{f"gpu-h100-2026-12-06-s29/{code}/r{k}/gpu_bench.json":
              "H100 runs of 12-06 s29 on one machine"
              for k in (1, 2) for code in ("c1129", "c1201")},
           **{f"gpu-h200-2026-11-29/{name}": "H200 runs of the code of 11-29"
              for name in ("bench_final.json", "bench_run6.json", "bench_run7.json",
                           "bench_run8.json")}}

#: the most two measurements of one case may differ (max / min) for one prediction to be
#: within GOAL of both: p / (1 + GOAL) <= m <= p / (1 - GOAL)
REPEAT_BAND = (1 + GOAL) / (1 - GOAL)


def _repeat_of(folder: str, name: str, case: str) -> Optional[str]:
    """The group of repeats a case of run ``folder/name`` belongs to, or None."""
    rset = REPEATS.get(f"{folder}/{name}")
    return f"{case} [{rset}]" if rset else None


def repeat_groups(rows: list[dict]) -> list[dict]:
    """Groups of repeats among ``rows`` (those with a ``repeat_of``, two or more): each
    with its rows' measurements, ``spread`` (max / min measured), ``noisy`` (spread over
    :data:`REPEAT_BAND`: no one prediction is within GOAL of all), ``residual_spread``
    (max / min of measured / predicted: what is left of the spread with each run's own
    links), ``noisy_given_links`` (that over the band), ``misses``, ``median_error`` (the
    median of its runs' errors) and ``within_goal`` (that within GOAL: the case, judged
    once). Sets ``noisy`` on every row (False outside a noisy group)."""
    by: dict[str, list[dict]] = defaultdict(list)
    for r in rows:
        r["noisy"] = False
        if r.get("repeat_of"):
            by[r["repeat_of"]].append(r)
    out = []
    for key, rs in by.items():
        if len(rs) < 2:
            continue
        m = [r["measured_s"] for r in rs]
        left = [r["measured_s"] / r["predicted_s"] for r in rs]
        g = {"group": key, "cases": [r["case"] for r in rs], "measured_s": m,
             "errors": [r["error"] for r in rs], "spread": max(m) / min(m),
             "residual_spread": max(left) / min(left),
             "misses": sum(not r["within_goal"] for r in rs)}
        g["median_error"] = statistics.median(g["errors"])
        g["within_goal"] = bool(abs(g["median_error"]) <= GOAL)
        g["noisy"] = g["spread"] > REPEAT_BAND
        g["noisy_given_links"] = g["residual_spread"] > REPEAT_BAND
        for r in rs:
            r["noisy"] = g["noisy"]
        out.append(g)
    return out


def by_case(rows: list[dict], repeats: list[dict]) -> tuple[int, int]:
    """(cases within GOAL, cases): a row outside any group of repeats is one case; a group
    is one case, judged by the median of its runs' errors (one run on a loaded box then
    neither hides a miss of the others nor makes one of its own)."""
    grouped = {g["group"] for g in repeats}
    alone = [r for r in rows if r.get("repeat_of") not in grouped]
    return (sum(r["within_goal"] for r in alone) + sum(g["within_goal"] for g in repeats),
            len(alone) + len(repeats))


# ------------------------------------------------------------------ rows

def _row(case: str, strategy: str, sc: Scenario, measured: float, source: str,
         check: Optional[Callable] = None) -> dict:
    p = predict(sc)
    r = p.results[strategy]
    seconds = float(r.seconds)
    row = {"case": case, "strategy": strategy, "predicted_s": seconds,
           "measured_s": measured, "error": seconds / measured - 1.0,
           "limited_by": f"{r.bottleneck.name}: {r.bottleneck.limit}", "source": source}
    row["within_goal"] = bool(abs(row["error"]) <= GOAL)
    if check is not None:
        row.update(check(r))
    return row


def _rows(case: str, strategy: str, scenario: Callable[[Links], Scenario], measured: float,
          source: str, preset: str, sets: Mapping[str, float], where: Mapping[str, str],
          check: Optional[Callable] = None, repeat_of: Optional[str] = None,
          fill_open: bool = False, code_costs: Optional[tuple[dict, str]] = None) -> list[dict]:
    """One case: with the links its run recorded (counted) and with the preset alone (not
    counted); only the preset's, counted, when the run recorded no limit. ``repeat_of``:
    its group of repeats (:func:`_repeat_of`), if any. Buckets are laid out as the run's
    code did: ``fill_open`` only for session 22's "after" runs, every other recorded run of
    ``shm`` / ``collective`` / ``cuda_ipc`` predates 2026-12-05's layout (the ``p2p``
    strategy does not read it). ``code_costs``: the host costs of the run's code on its host
    and where they come from, in both rows (a GPU preset's rows otherwise take the fitted
    costs of the old ring codes where the run set none)."""
    def recorded(links: Links) -> Scenario:   # laid out as the run's code did
        return dataclasses.replace(scenario(links), fill_open=fill_open)

    if code_costs:
        base, costs_from = code_costs
        note = "; host costs of its code, from " + costs_from + ": " + ", ".join(
            f"{k.split('.')[-1]} {v:g}" for k, v in base.items())
    elif preset in _GPU_PRESETS:
        # GPU hosts: a run that did not record its code's own host costs is priced with the
        # old ring codes' fitted ones (the presets carry the current code's, ring_costs_1204)
        base = {k: v for k, v in {**RING_SOFTWARE_1129, **_NO_HANDOFF,
                                  **OLD_PACK_WAIT_X}.items() if k not in sets}
        note = _legacy_note(base)
    else:
        base, note = {}, ""
    rows = []
    if sets:
        row = _row(case, strategy, recorded(load_links(preset, {**base, **sets})), measured,
                   source, check)
        row.update(links="run", links_from=_describe(sets, where) + note, counted=True)
        rows.append(row)
    row = _row(case, strategy, recorded(load_links(preset, base)), measured, source, check)
    row.update(links="preset", counted=not sets,
               links_from=f"preset {preset}" + ("" if sets else " (the run recorded no limit)")
               + note)
    rows.append(row)
    for row in rows:
        row["repeat_of"] = repeat_of
    return rows


def _legacy_note(base: Mapping[str, float]) -> str:
    if not base:
        return ""
    t, b = RING_SOFTWARE_1129["software.tensor_us"], RING_SOFTWARE_1129["software.bucket_us"]
    return f"; host costs of the code of 11-29 (tensor_us {t:g}, bucket_us {b:g}, fitted)"


def _model_key(rec: Mapping) -> tuple:
    """A workload's shapes depend on its dtype and bucket size (``synthetic``), not on its
    name alone: the key of the models a group builds once."""
    return rec["workload"], rec["dtype"], rec["bucket_size"]


def _cpu_scenario(models: dict, rec: Mapping, strategy: str, replace: Mapping,
                  extra: Mapping) -> Callable[[Links], Scenario]:
    """The Scenario of one CPU bench row for given links: its workload's model (built once
    per :func:`_model_key` in ``models``), the run's link fields ``replace``d, ``extra``
    Scenario fields."""
    key = _model_key(rec)
    if key not in models:
        models[key] = _cpu_model(rec)

    def scenario(links: Links) -> Scenario:
        return Scenario(model=models[key], links=dataclasses.replace(links, **replace),
                        trainer_gpus=1, replicas=rec["receivers"],
                        bucket_size=rec["bucket_size"], src_dtype=rec["dtype"],
                        dst_dtype=rec["dtype"], strategies=(strategy,), **extra)
    return scenario


def _cpu_model(rec: dict) -> ModelSpec:
    from weightsync.tools.bench.workloads import hf_qwen2, parse_size, synthetic, tiny
    if rec["workload"].startswith("hf-qwen2"):
        w, _ = hf_qwen2(rec["dtype"])
    elif rec["workload"].startswith("tiny-"):
        w = tiny(int(rec["workload"].split("-", 1)[1]), rec["dtype"])
    else:
        w = synthetic(parse_size(rec["workload"].split("-", 1)[1]), rec["dtype"],
                      bucket_size=rec["bucket_size"])
    if w is None or len(w.tensors) != rec["tensors"] or w.nbytes != rec["bytes"]:
        raise PlannerError("calibrate", f"workload {rec['workload']} is not what was measured")
    return model_from_tensors(w.name, w.tensors, note=w.note)


#: A code's per-tensor cost on this box (``software.tensor_us``), by code: its bench run of
#: 10,000 float32 tensors of 16 elements (``--tiny 10000``, one bucket, R=1), the mean of
#: ``shm``'s and ``collective``'s time a tensor (sender and receiver together). The
#: ``cpu-2core`` preset's is today's code's (session 34's first run); the codes of 12-02
#: and 12-03 ran their own, and their other tiny runs take those (``tensor_from``). Those
#: runs are the costs' inputs, not cases (:func:`cost_inputs`).
TINY_COSTS = {"today": ("cpu-tiny-2026-12-07-s34", "tiny_r1.json"),
              "12-02": ("per-tensor-2026-12-02", "after.json"),
              "12-03, before the direct window": ("review-2026-12-03", "tiny_before.json"),
              "12-03, after the mend": ("review-2026-12-03", "tiny_after_mend.json")}


@functools.lru_cache(maxsize=None)      # read once per run file, not once per row
def tiny_tensor_us(root: str, folder: str, name: str) -> float:
    """Microseconds a tensor of a ``--tiny`` run (:data:`TINY_COSTS`): the mean over its
    ``shm`` and ``collective`` rows of the warm median over the tensor count."""
    recs = [r for r in _json(root, folder, name)["results"]
            if r["method"] in ("shm", "collective") and r["status"] == "ok"]
    if not recs:
        raise PlannerError("calibrate", f"{folder}/{name} has no shm / collective row")
    return round(statistics.mean(r["warm_median_s"] / r["tensors"] for r in recs) * 1e6, 2)


#: The knob of a run whose ``shm`` trainer waited for each direct read before its next item
#: (``links.ring.direct_window`` 1): the code before 4978907 (12-03 12:37: the 11-29 and 12-02
#: runs, the lasting run's code a958c09 and its runs again) and runs under
#: ``WEIGHTSYNC_SHM_DIRECT_WINDOW=1``.
WAITED = {"links": {"direct_window": 1}}

#: Each 11-29 code's own wait between direct reads (``software.direct_wait_us``): their
#: trainer blocked on every read's acknowledgement (window 1, with no setting to change it).
#: The ``cpu-2core`` preset's 370 us is a later code's window 1 over window 2 (session 28).
#: Session 35 timed the receiver's gap between direct reads of Qwen2-0.5B in each of these
#: codes (``cpu-shm-wait-2026-12-07-s35``: ``gaps.py``, two rounds, ``gaps.jsonl``) beside
#: today's code at window 2 from the same size in the same round (the gap when nothing
#: waits). A code's wait is its gap over that one: the mean of the two rounds. code ->
#: (its record, the record at window 2).
WAIT_COSTS = {"7209436": ("c7209436", "now_min1m_w2"),      # direct reads from 1 MiB
              "dda6fe7": ("cdda6fe7", "now_min8m_w2")}      # from 8 MiB
WAIT_RUN = ("cpu-shm-wait-2026-12-07-s35", "gaps.jsonl")
#: the runs of the code of 11-29's reported run (dda6fe7) and of its earlier run (7209436)
WAITED_1129 = {**WAITED, "wait_from": "dda6fe7"}
WAITED_1129_1MIB = {"links": {"direct_window": 1, "direct_min_bytes": 1 << 20},
                    "wait_from": "7209436"}


@functools.lru_cache(maxsize=None)      # read once per code, not once per row
def direct_wait_us(root: str, code: str) -> float:
    """Microseconds of ``code``'s wait for each direct read (:data:`WAIT_COSTS`)."""
    name, base = WAIT_COSTS[code]
    path = os.path.join(root, *WAIT_RUN)
    with open(path) as f:
        recs = [json.loads(line) for line in f if line.strip()]
    mine = [r["median"]["gap_per_read_us"] for r in recs if r["code"] == name]
    free = [r["median"]["gap_per_read_us"] for r in recs if r["code"] == base]
    if not mine or len(mine) != len(free):
        raise PlannerError("calibrate", f"{'/'.join(WAIT_RUN)} has no rounds of {name} and {base}")
    return round(statistics.mean(a - b for a, b in zip(mine, free)), 1)

#: The other CPU bench runs of ``shm`` / ``collective`` with one torch thread a process and
#: ``receive_into`` (the bench's defaults; session 26 added them): (folder, file, label,
#: what that run's code or command set that the rows of :data:`CPU_RUNS` before them did
#: not: ``links`` fields, ``scenario`` fields). Each folder's ``command(s).txt`` says how it
#: ran:
#: - 12-02 (``cpu-1g-2026-12-02/into.json``), 12-04 (``cpu-2026-12-04/tuned.json``) and
#:   session 14's (``cpu-2026-12-04-s14``: ``tuned``; ``tuned_direct1m`` under
#:   ``WEIGHTSYNC_SHM_DIRECT_MIN=1048576``; the tuned rows of ``readme_rows``), 1 GiB R=1;
#: - 12-03's direct window at 1 and 2 (``cpu-shm-window-2026-12-03``, shm and collective:
#:   the window is not in the model) and the ``shm`` row of ``cpu-lasting-2026-12-03``;
#: - session 17's collective before / after receivers post ahead (not in the model), two
#:   runs each, 1 GiB and Qwen2, R=1 and R=2;
#: - session 21's collective after the 8 MiB direct size (``collective_direct_min``);
#: - session 22's shm runs of a9f0600 (before) and of the full-bucket layout (after:
#:   ``fill_open``), 4 GiB, three commands, alternating;
#: - session 27's code (f3939a7) with 12-03's calibration command plus ``cma-raw``, 0.25 and
#:   1 GiB and Qwen2, R=1/2/4 (``cpu-2026-12-06-s27``): full buckets, ``collective`` direct
#:   from 8 MiB; and its ``readme`` run (d790405, the same ``shm`` / ``collective``): 1 GiB,
#:   R=1/2, each method and its ``@readme`` row;
#: - the code of ``cpu-lasting-2026-12-03`` (a958c09) run again three times in session 27
#:   (``cpu-2026-12-06-s27-lastingcode``): repeats of its ``shm`` case;
#: - session 14's code (``git archive 299c7f2 src``) run again in session 27 with session
#:   14's two ``tuned`` commands, alternating, three rounds (``cpu-2026-12-06-s27-s14code``):
#:   repeats of those two cases (:data:`REPEATS`);
#: - session 28's code with the direct window at 1 and 2, alternating, three rounds, 1 GiB
#:   and Qwen2, R=1 (``cpu-shm-window-2026-12-06-s28``): repeats per window and case; then
#:   once more each with ``shm@readme`` beside ``shm`` (``readme.sh``);
#: - session 27's code and command run again twice in session 28
#:   (``cpu-2026-12-06-s28-s27code``): repeats of session 27's cases.
#: - runs with ``--threads 0`` (torch's default threads in every process, ``receive_into``):
#:   each method is its ``@readme`` row, and the run's ``memcpy`` a copy over every core
#:   (:func:`_readme_run`): 12-02's (the code of ``into.json``), 12-03's direct window at 1
#:   and 2 (shm), the 12-03 review's collective at window 1 and 2 (after its mend), 12-04's
#:   and session 14's ``readme`` runs.
#: Runs with ``--consume copy`` (``receive_weights`` + ``copy_``) are not modelled.
CPU_RUNS_MORE = (
    # the tiny runs (10,000 tensors) that are not their code's cost input (TINY_COSTS)
    ("per-tensor-2026-12-02", "after_threads0.json", "12-02 per-tensor, --threads 0",
     {**WAITED, "tensor_from": TINY_COSTS["12-02"]}),
    ("review-2026-12-03", "tiny_before2.json", "12-03 review, tiny before the window, run 2",
     {**WAITED, "tensor_from": TINY_COSTS["12-03, before the direct window"]}),
    *(("cpu-tiny-2026-12-07-s34", f"tiny_r{k}.json", f"12-07 s34, run {k}",
       {"scenario": {"fill_open": True}}) for k in (2, 3)),
    ("review-2026-12-03", "after_mend_1g.json", "12-03 review, after the mend",
     {"tensor_from": TINY_COSTS["12-03, after the mend"]}),
    *(("review-2026-12-03", f"shm_window{w}_mend.json",
       f"12-03 review, direct window {w}, after the mend",
       {**(WAITED if w == 1 else {}), "tensor_from": TINY_COSTS["12-03, after the mend"]})
      for w in (1, 2)),
    *(("cpu-shm-window-2026-12-06-s28/sampler", f"sampler_on_{k}.json",
       f"12-06 s28, sampler check, run {k}", {"scenario": {"fill_open": True}})
      for k in (1, 2)),
    ("cpu-2026-11-29", "bench-previous-run.json", "11-29, earlier run, direct from 1 MiB",
     WAITED_1129_1MIB),
    ("delta-2026-12-02", "bench_256mib.json", "12-02 delta run, dense rows", WAITED),
    ("cpu-2026-11-29", "bench-fp32.json", "11-29 fp32, direct from 1 MiB", WAITED_1129_1MIB),
    # session 35's runs of those codes again, and of the 12-03 review's after the mend
    *((_S35, f"{stem}_r{k}.json", f"{what}, 12-07 s35 run {k}", knob)
      for k in (1, 2) for stem, what, knob in (
          ("prev", "code of 11-29's earlier run, direct from 1 MiB", WAITED_1129_1MIB),
          ("fp32", "code of 11-29's fp32 run, direct from 1 MiB", WAITED_1129_1MIB),
          ("mend", "code of the 12-03 review after the mend",
           {"tensor_from": TINY_COSTS["12-03, after the mend"]}),
          ("mendw1", "code of the 12-03 review after the mend, direct window 1",
           {**WAITED, "tensor_from": TINY_COSTS["12-03, after the mend"]}),
          ("delta", "code of the 12-02 delta run, dense rows", WAITED))),
    ("cpu-1g-2026-12-02", "threads0_into.json", "12-02, --threads 0", WAITED),
    *(("cpu-shm-window-2026-12-03", f"window{w}_threads0.json",
       f"12-03, direct window {w}, --threads 0", WAITED if w == 1 else {}) for w in (1, 2)),
    *(("review-2026-12-03", f"collective_window{w}_threads0.json",
       f"12-03 review, direct window {w}, --threads 0", {}) for w in (1, 2)),
    ("cpu-2026-12-04", "readme.json", "12-04, --threads 0", {}),
    ("cpu-2026-12-04-s14", "readme.json", "12-04 s14, --threads 0", {}),
    ("cpu-1g-2026-12-02", "into.json", "12-02", WAITED),
    ("cpu-2026-12-04", "tuned.json", "12-04 tuned", {}),
    ("cpu-2026-12-04-s14", "tuned.json", "12-04 s14", {}),
    ("cpu-2026-12-04-s14", "tuned_direct1m.json", "12-04 s14, direct from 1 MiB",
     {"links": {"direct_min_bytes": 1 << 20}}),
    ("cpu-2026-12-04-s14", "readme_rows.json", "12-04 s14, readme_rows run", {}),
    ("cpu-2026-12-06-s27", "bench.json", "12-06 s27",
     {"scenario": {"fill_open": True, "collective_direct_min": 8 << 20}}),
    ("cpu-2026-12-06-s27", "readme.json", "12-06 s27, readme run",
     {"scenario": {"fill_open": True, "collective_direct_min": 8 << 20}}),
    *(("cpu-2026-12-06-s28-s27code", f"bench_run{k}.json", f"s27 code, 12-06 s28 run {k}",
       {"scenario": {"fill_open": True, "collective_direct_min": 8 << 20}}) for k in (1, 2)),
    *(("cpu-2026-12-06-s27-s14code", f"{cmd}_r{k}.json",
       f"s14 code, 12-06 s27 run {k}{', direct from 1 MiB' if cmd != 'tuned' else ''}",
       {"links": {"direct_min_bytes": 1 << 20}} if cmd != "tuned" else {})
      for cmd in ("tuned", "tuned_direct1m") for k in (1, 2, 3)),
    *(("cpu-shm-window-2026-12-03", f"{kind}window{w}.json", f"12-03, direct window {w}",
       WAITED if (kind, w) == ("", 1) else {})
      for kind in ("", "collective_") for w in (1, 2)),
    ("cpu-lasting-2026-12-03", "bench_1g.json", "12-03 lasting", WAITED),
    *(("cpu-2026-12-06-s27-lastingcode", f"bench_1g_run{k}.json",
       f"12-03 lasting code, 12-06 s27 run {k}", WAITED) for k in (1, 2, 3)),
    *(("cpu-shm-window-2026-12-06-s28", f"window{w}_r{k}.json",
       f"12-06 s28, direct window {w}, run {k}", WAITED if w == 1 else {})
      for k in (1, 2, 3) for w in (1, 2)),
    *(("cpu-shm-window-2026-12-06-s28", f"readme_window{w}.json",
       f"12-06 s28, direct window {w}, readme run", WAITED if w == 1 else {}) for w in (1, 2)),
    *(("cpu-2026-12-05-s17", f"{when}-r{k}.json", f"12-05 s17 {when} posting ahead, run {k}",
       {}) for when in ("before", "after") for k in (1, 2)),
    ("cpu-2026-12-05-s21", "bench_collective.json", "12-05 s21, direct from 8 MiB",
     {"scenario": {"collective_direct_min": 8 << 20}}),
    *(("cpu-2026-12-05-s22", f"bench-{cmd}{when}-r{k}.json",
       f"12-05 s22 {when}{' full buckets' if when == 'after' else ''}, "
       f"{cmd or 'r12-'}run {k}", {"scenario": {"fill_open": when == "after"}})
      for cmd, runs in (("", (1, 2)), ("r1-", (1, 2, 3)), ("readme-", (1, 2)))
      for when in ("before", "after") for k in runs))

#: The CPU bench runs of ``shm`` / ``collective`` (folder, file, label): the 11-29 run of
#: that day's code (a loaded box, load average ~5), and the 12-03 run of the code with the
#: direct window (`benchmarks/results/cpu-calib-2026-12-03/`), and the 12-04 run of the
#: code of that day on a quiet box (load 0.66 at its start, nothing else run beside it),
#: and 12-04b, the same again with ``cma-raw`` (the direct reads' own limit).
#: Each recorded ``memcpy``, ``memcpy-parallel`` and ``gloo-flat`` for every workload and
#: receiver count. Then session 16's two runs of the code with shared memory on either
#: side (1 GiB, R=1 and R=2: ``shm``, ``shm-shared``, ``shm-push``), which recorded
#: ``memcpy`` (one thread, paired with each step) and, paired with their ``@readme``
#: steps, ``memcpy`` over both cores (:data:`_ALL_CORES`). Last, two runs of the code of
#: 11-29 on 12-06 (repeats of 11-29's cases, :data:`REPEATS`), and two of the code of 12-03
#: on 12-06 (0.25 GiB and Qwen2, ``shm`` methods: repeats of 12-03's).
CPU_RUNS = (("cpu-2026-11-29", "bench.json", "11-29", WAITED_1129),
            ("cpu-calib-2026-12-03", "bench.json", "12-03"),
            ("cpu-calib-2026-12-04", "bench.json", "12-04"),
            ("cpu-calib-2026-12-04b", "bench.json", "12-04b"),
            ("cpu-2026-12-04-s16", "r1.json", "12-04 s16"),
            ("cpu-2026-12-04-s16", "r2.json", "12-04 s16"),
            ("cpu-2026-12-06-s25-1129code", "bench_run1.json", "11-29 code, 12-06 run 1",
             WAITED_1129),
            ("cpu-2026-12-06-s25-1129code", "bench_run2.json", "11-29 code, 12-06 run 2",
             WAITED_1129),
            ("cpu-2026-12-06-s27-1203code", "bench_run1.json", "12-03 code, 12-06 run 1"),
            ("cpu-2026-12-06-s27-1203code", "bench_run2.json", "12-03 code, 12-06 run 2"),
            *CPU_RUNS_MORE)

#: what each CPU method is in the model: (strategy, fields of the Links replaced, fields of
#: the Scenario). A method's ``@readme`` row (the same sync consumed as the README shows:
#: ``receive_into`` with torch's default threads) is the method's case: on these paths every
#: landing is a ``memmove`` (``fastcopy``) or a gloo op, none a torch op on its intra-op
#: threads, so the model has nothing to price differently (:data:`README`).
#: Every run in :data:`CPU_RUNS` sent ``collective``'s direct tensors from 16 MiB, the
#: default until 2026-12-05 (8 MiB since), but session 21's (its ``scenario`` knob).
_CPU_METHODS = {"shm": ("ring", {}, {}),
                "collective": ("broadcast", {}, {"collective_direct_min": 16 << 20}),
                "shm-buckets": ("ring", {"direct_min_bytes": 0}, {}),
                "shm-direct": ("ring", {"direct_max_receivers": 64}, {}),
                "shm-shared": ("ring", {}, {"shared": "trainer"}),
                "shm-push": ("ring", {}, {"shared": "receivers"})}


def _cpu_method(name: str) -> Optional[tuple]:
    """:data:`_CPU_METHODS`' entry of a bench method, ``@readme`` rows as their method."""
    return _CPU_METHODS.get(name[:-len(README)] if name.endswith(README) else name)


def _readme_run(results: list[dict]) -> list[dict]:
    """A run with ``--threads 0 --consume into`` as the bench's ``@readme`` rows: every
    process ran torch's default threads and consumed with ``receive_into``, so each method
    is its ``@readme`` row (its paired ``memcpy`` the copy over every core), and so is each
    unpaired ``memcpy`` (:data:`_ALL_CORES`, a ceiling of ``host_mem``, not the one-thread
    ``device_mem``, which such a run never timed)."""
    out = []
    for r in results:
        if _cpu_method(r["method"]) is not None and not r["method"].endswith(README):
            r = {**r, "method": r["method"] + README}
        elif r["method"] == "memcpy":
            r = {**r, "method": _ALL_CORES}
        out.append(r)
    return out


def _cpu_cases(root: str) -> list[dict]:
    rows, models = [], {}
    for folder, name, label, *knobs in CPU_RUNS:
        if not os.path.exists(os.path.join(root, folder, name)):
            continue
        knob = knobs[0] if knobs else {}
        doc = _json(root, folder, name)
        config = doc.get("config", {})
        if config.get("consume", "into") != "into":
            continue            # receive_weights + copy_: not modelled
        results = _readme_run(doc["results"]) if config.get("threads") == 0 else doc["results"]
        limits = _limits_by_case(results)
        for rec in results:
            method = _cpu_method(rec["method"]) if rec["status"] == "ok" else None
            if method is None:
                continue
            strategy, replace, extra = method
            # the run's own settings first, the method's over them (shm-buckets: no direct)
            replace = {**knob.get("links", {}), **replace}
            extra = {**extra, **knob.get("scenario", {})}
            fill_open = extra.pop("fill_open", False)
            scenario = _cpu_scenario(models, rec, strategy, replace, extra)
            sets, where = run_links(rec, limits[(rec["workload"], rec["dtype"])])
            if "wait_from" in knob:        # its code's own wait for each direct read
                sets["software.direct_wait_us"] = direct_wait_us(root, knob["wait_from"])
                where["software.direct_wait_us"] = (f"its code's wait for each direct read "
                                                    f"({'/'.join(WAIT_RUN)})")
            if "tensor_from" in knob:      # its code's own per-tensor cost
                sets["software.tensor_us"] = tiny_tensor_us(root, *knob["tensor_from"])
                where["software.tensor_us"] = (f"its code's per-tensor cost "
                                               f"({'/'.join(knob['tensor_from'])})")
            case = f"CPU {rec['workload']} {rec['method']} R={rec['receivers']}"
            rows += _rows(f"{case} ({label})", strategy, scenario, rec["warm_median_s"],
                          f"{folder}/{name} warm_median_s", "cpu-2core", sets, where,
                          repeat_of=_repeat_of(folder, name, case), fill_open=fill_open)
    return rows


#: Host costs of the ``cuda_ipc`` ring's code from session 14 on (replayed layouts and copy
#: programs) are the GPU presets' own (``tensor_us``, ``bucket_us``, ``handoff_us``,
#: ``finish_us``, ``pack_wait_x``; each preset's ``source`` says where they come from): that
#: code's host timelines on each kind of host, read by ``benchmarks/timeline_costs.py``
#: (:data:`TODAY_H100_TIMELINES`, :data:`TODAY_H200_TIMELINES`). Until session 33 the H200
#: preset carried run 7's hand reading (``gpu-h200-2026-12-04-programs``: 19 us, 283 us) and
#: the H100 hosts' handoff and pack wait.
_TIMELINE_1204 = {"h200-8gpu-400g": "gpu-h200-2026-12-07-s33 tl, tl2, tl3",
                  "h100-8gpu-400g": "gpu-h100-2026-12-06-s29c and -s30"}
#: Today's ring code's ``--timeline`` runs on H100 hosts (the H100 preset's costs).
TODAY_H100_TIMELINES = ("gpu-h100-2026-12-06-s29c/now", "gpu-h100-2026-12-06-s30/tl/now")
#: Today's ring code's ``--timeline`` runs on an H200 host (the H200 preset's costs since
#: session 33; until then run 7's hand reading and the H100 hosts' handoff and pack wait).
TODAY_H200_TIMELINES = ("gpu-h200-2026-12-07-s33/tl/now", "gpu-h200-2026-12-07-s33/tl2/now",
                        "gpu-h200-2026-12-07-s33/tl3/now")


def ring_costs_1204(preset: str) -> dict[str, float]:
    """The ring code of 12-04 on: its host costs on ``preset``'s host, as ``--link-set``
    keys (microseconds; ``pack_wait_x`` a factor), read from the preset itself."""
    sw = load_links(preset).software
    return {**{f"software.{k}": round(sw[k] * 1e6, 6)
               for k in ("tensor_us", "bucket_us", "handoff_us", "finish_us")},
            "software.pack_wait_x": sw["pack_wait_x"]}


#: Host costs of the ring codes older than 12-04 (11-29's and 12-01's) on an H200 host, where
#: neither was ever timed as it ran (the one H200 timeline, run 5 of 11-29, is of earlier
#: code): fitted to the 11-29 code's own H200 runs, the least squared log(predicted /
#: measured) over the rows of the four 11-29 H200 runs, host-ordered ones waiting
#: :data:`OLD_PACK_WAIT_X` for each pack (``planner-calib-2026-12-06-s30/fit_ring_1129.py``;
#: 47 / 1070 at session 30's wait of 1.35 (the H100 timeline's), 48 / 1070 at 1.15 (three H100
#: machines', ``planner-2026-12-07-s33/fit_ring_1129.txt``), 50 / 1070 at 0.79 (the 11-29
#: code's own H200 timeline, session 33: ``fit_ring_1129_h200wait.txt`` there), and, with
#: session 33's H200 runs of that code among the fit rows (a second H200 host, 33 rows in
#: all), 48 / 1020 (``fit_ring_1129_two_hosts.txt``). The H200 runs of 12-01 (12-01's and
#: session 33's) are left out of the fit and check it. Every other GPU run without
#: its code's own costs (the CPU-trainer and shm_d2h rows on ``h200-host``) takes them too.
#: Session 29 fitted 59 / 1060 over those rows and the H100 ones (which now take that
#: host's timeline costs,
#: :func:`ring_costs_old`), without the host ordering's wait
#: (:attr:`~weightsync.tools.planner.scenario.Scenario.ring_sync`); until then 70 / 930, read
#: off run 5's timeline.
RING_SOFTWARE_1129 = {"software.tensor_us": 48.0, "software.bucket_us": 1020.0}
#: The old codes' wait for each pack under host ordering on an H200 host (where their fitted
#: costs price them): the 11-29 code's, read off its H200 timeline (:data:`OLD_H200_TIMELINE`,
#: session 33). Until then the H100 timelines' (1.35 off session 30's alone), as no H200 one
#: existed. Their H100 rows take their own H100 timelines' (:func:`ring_costs_old`).
OLD_PACK_WAIT_X = {"software.pack_wait_x": 0.79}
#: The 11-29 code's ``--timeline`` run on an H200 host (:data:`OLD_PACK_WAIT_X`).
OLD_H200_TIMELINE = "gpu-h200-2026-12-07-s33/tl/c1129"
#: The old codes' fitted bucket cost stands for the whole per-bucket cycle, its handoff
#: and the sync's end included, so their rows add neither (the presets' ``handoff_us`` and
#: ``finish_us`` are today's code's).
_NO_HANDOFF = {"software.handoff_us": 0.0, "software.finish_us": 0.0}
#: ``--timeline`` runs of the old ring codes on H100 hosts, by code: their host costs there
#: (:func:`ring_costs_old`), read the way the H100 preset's are for today's code.
OLD_H100_TIMELINES = {
    "11-29": ("gpu-h100-2026-12-06-s26/call1/c1129/timeline",
              "gpu-h100-2026-12-06-s26/call2/c1129/timeline", "gpu-h100-2026-12-06-s29c/c1129",
              "gpu-h100-2026-12-06-s30/tl/c1129", "gpu-h100-2026-12-07-s33/tl/c1129",
              "gpu-h100-2026-12-07-s33/tl2/c1129"),
    "12-01": ("gpu-h100-2026-12-06-s26/call2/c1201/timeline",
              "gpu-h100-2026-12-06-s30/tl/c1201", "gpu-h100-2026-12-07-s33/tl/c1201",
              "gpu-h100-2026-12-07-s33/tl2/c1201")}


def ring_costs_old(code: str, root: Optional[str] = None) -> tuple[dict[str, float], str]:
    """Host costs (``--link-set`` keys: microseconds, ``pack_wait_x`` a factor) of the ring
    code of ``code`` (``"11-29"`` or ``"12-01"``) on an H100 host, from its own
    ``--timeline`` runs there (``benchmarks/timeline_costs.py``: the trainer's host time
    against the number of buckets, slot waits at the smallest bucket, the wait for each pack
    under host ordering), and where they come from."""
    costs, source = _timeline_costs(code, root or results_dir())
    return dict(costs), source


@functools.lru_cache(maxsize=None)
def _timeline_costs(code: str, root: str) -> tuple[tuple[tuple[str, float], ...], str]:
    """:func:`ring_costs_old`, read once per process (the timelines are recorded files)."""
    tool = _script("timeline_costs")
    costs = tool.host_costs([os.path.join(root, d) for d in OLD_H100_TIMELINES[code]])
    return tuple(costs.items()), f"the {code} code's H100 timelines"


def ring_code_of(row: Mapping) -> Optional[str]:
    """``"11-29"`` or ``"12-01"`` for a calibration row of a run of that ring code (on an
    H200 host: the fit rows of :data:`RING_SOFTWARE_1129` and its check rows, session 33's
    among them; on an H100 host: rows priced with :func:`ring_costs_old`), else None."""
    src = row["source"]
    if src.startswith("gpu-h200-2026-11-29/"):
        return "11-29"
    if src.startswith("gpu-h200-2026-12-01/"):
        return "12-01"
    folder, *parts = src.split("/")
    if folder in _OLD_H100_RUNS or folder == S33_H200_RING:
        return next((S26_CODES[p] for p in parts if p in S26_CODES), None)
    return None


def ring_1129_loss(tensor_us: float, bucket_us: float,
                   results: Optional[str] = None) -> tuple[float, list[dict]]:
    """The objective :data:`RING_SOFTWARE_1129` minimises, at these host costs: the sum of
    squared log(predicted / measured) over the counted H200 rows of the ring code of 11-29;
    with the counted H200 rows of both codes (see :func:`ring_code_of`) as predicted with
    them (only those runs are predicted: the H100 ones do not take these costs)."""
    global RING_SOFTWARE_1129
    kept = RING_SOFTWARE_1129
    RING_SOFTWARE_1129 = {"software.tensor_us": float(tensor_us),
                          "software.bucket_us": float(bucket_us)}
    try:
        rows = [r for r in _h200_cases(results or results_dir(), _OLD_H200_FOLDERS)
                if r.pop("counted") and ring_code_of(r)]
    finally:
        RING_SOFTWARE_1129 = kept
    loss = sum(math.log(r["predicted_s"] / r["measured_s"]) ** 2
               for r in rows if ring_code_of(r) == "11-29")
    return loss, rows


_GPU_PRESETS = frozenset({"h100-8gpu-400g", "h200-8gpu-400g", "h200-host"})
#: Runs of that later code, by folder.
_RING_1204_RUNS = frozenset({"gpu-h100-2026-12-05", "gpu-h200-2026-12-05",
                             "gpu-h100-2026-12-05-s20", "gpu-h200-2026-12-05-s21",
                             "gpu-h100-2026-12-05-s21", "gpu-h200-2026-12-05-branches",
                             "gpu-h100-2026-12-07-s34-delta", "gpu-h100-2026-12-07-s35-delta",
                             "gpu-h100-2026-12-05-s23", "gpu-h100-2026-12-06-s24",
                             "gpu-h100-2026-12-06-s29b"})


#: Session 26's H100 runs of the ``cuda_ipc`` ring of the code of 11-29 (0218da3) and of
#: 12-01 (1005ea0) with the same ``gpu_bench.py`` (the file is the same in both), the two
#: codes alternating, two rounds in a first device call and three in a second on the same
#: held machine (``commands.txt``): each code's rows are a group of repeats.
S26_RING = "gpu-h100-2026-12-06-s26"
S26_CODES = {"c1129": "11-29", "c1201": "12-01"}
#: Session 29's H100 runs of the same two codes (``run.sh``), after the fit of
#: :data:`RING_SOFTWARE_1129` and not in it: the bucket sizes session 26 did not time
#: (256 MiB, 512 MiB and 4 GiB event, 4 GiB host), alternating, two rounds in one device
#: call; each code's rows of one configuration are a group of repeats.
S29_RING = "gpu-h100-2026-12-06-s29"
#: Session 30's H100 runs (``run.sh``, run twice on the same held machine): first a
#: ``--timeline`` run of each ring code (``tl/c1129``, ``tl/c1201``, ``tl/now``: the old codes
#: at 256 MiB - 4 GiB event and 1 / 4 GiB host, today's receive_into the same), then four
#: rounds of timed runs alternating the three codes (the old codes at 256 MiB - 1 GiB event
#: and 1 / 4 GiB host; today's receive_into at 256 / 512 MiB event and 1 / 4 GiB host). Each
#: code's rows of one configuration are a group of repeats.
S30_RING = "gpu-h100-2026-12-06-s30"
#: Session 31's H100 runs: session 30's ``run.sh`` again on another machine (all four rounds
#: in one call), with the host's load recorded beside each run (``hostload.txt``,
#: ``benchmarks/hostload.py``); the same rows and groups as :data:`S30_RING`'s. Its
#: timelines are held out of the costs (:data:`OLD_H100_TIMELINES`,
#: :data:`TODAY_H100_TIMELINES`): its timed runs check the costs the other machines gave.
S31_RING = "gpu-h100-2026-12-06-s31"
#: Session 33's H100 runs, a third machine (``run_s33.sh`` in
#: ``planner-2026-12-07-s33``): each code's ``--timeline`` run printing all 6 warm syncs
#: before (``tl/``) and after (``tl2/``) three timed rounds alternating the codes (session
#: 30's commands), the host's load, each bench thread's CPU and a CPU-speed probe before
#: each bench recorded beside them.
S33_RING = "gpu-h100-2026-12-07-s33"
#: Session 33's H200 runs, one machine over two calls (``commands.txt`` there): today's ring
#: (``tl/now``, rounds 1-2, ``tl2/now``; then ``tl3/now``, rounds 3-4) and the old codes'
#: timelines and two rounds each, alternating with today's rounds 3-4. The old codes there are
#: priced with their fitted H200 costs (:data:`RING_SOFTWARE_1129`): the 11-29 code's rows
#: among its fit rows, the 12-01 code's among its checks.
S33_H200_RING = "gpu-h200-2026-12-07-s33"
#: Session 34's H100 runs, a fourth machine held out of every cost: session 33's script
#: (``run_s34.sh`` there: ``run_s33.sh`` with ``ROUNDS="1 2" AFTER=0``) with the GPU's
#: clocks, temperature and throttle reasons sampled each second (``gpuclk.txt``). Its
#: timelines (``tl/``) are not read; its two timed rounds check the costs the other
#: machines gave.
S34_RING = "gpu-h100-2026-12-07-s34"
#: The same again later in session 34 on a freshly started H100 (whether another host is
#: not recorded), held out alike.
S34B_RING = "gpu-h100-2026-12-07-s34b"
#: Session 34's delta+cuda_ipc runs on one H100 (``run_s34_delta.sh`` there): the codec's
#: kernels, then two rounds of gpu_bench.py's delta rows (receive_into, 256 MiB and 1 GiB
#: buckets, 0.5 % and 5 % of the trainer's elements changed between syncs) beside the dense
#: ring. Round 1's delta rows are the H100 preset's codec costs (:func:`delta_costs`),
#: round 2's check them; every dense row is a case of today's ring.
S34_DELTA = "gpu-h100-2026-12-07-s34-delta"
#: The same script again in session 35 on another H100 start (``commands.txt`` there),
#: held out: both rounds' delta rows check the costs of
#: :data:`S34_DELTA`'s round 1.
S35_DELTA = "gpu-h100-2026-12-07-s35-delta"


def delta_costs(root: Optional[str] = None) -> dict[str, float]:
    """The H100's codec costs per changed element (``codec.encode_ns``, ``codec.apply_ns``)
    from round 1's delta rows of :data:`S34_DELTA`: the trainer's own encode time over the
    elements it found changed, and the sync's time less the encode of one record bucket
    over them (the receivers' apply, which the encode of the next bucket runs beside),
    each the mean over the rows."""
    from weightsync.transport.codec.engine import DELTA_BUCKET
    root = root or results_dir()
    enc, app = [], []
    for ch in ("0.005", "0.05"):
        for e in _json(root, S34_DELTA, f"r1/c{ch}", "gpu_bench.json")["engine"]:
            if e["cfg"].get("delta") is None:
                continue
            c = e["metrics"]["codec"]
            buckets = max(1, math.ceil(c["record_bytes"] / DELTA_BUCKET))
            enc.append(c["encode_seconds"] / c["changed"])
            app.append((e["median_ms"] / 1e3 - c["encode_seconds"] / buckets) / c["changed"])
    return {"codec.encode_ns": round(statistics.mean(enc) * 1e9, 1),
            "codec.apply_ns": round(statistics.mean(app) * 1e9, 1)}
#: Folders of runs of the three ring codes in session 30's layout (``tl<k>/<code>``
#: timelines, ``<code>/r<k>`` timed rounds; ``now``: today's code, read by ``receive_into``
#: alone): three H100 machines and, since session 33, one H200.
_S30_H100 = frozenset({S30_RING, S31_RING, S33_RING, S34_RING, S34B_RING})
_S30_LAYOUT = _S30_H100 | {S33_H200_RING}
#: Folders of H100 runs of the old ring codes (a ``c1129`` / ``c1201`` folder per code).
_OLD_H100_RUNS = frozenset({S26_RING, S29_RING, *_S30_H100})
#: The H200 runs of the old ring codes (the fit and check rows of :data:`RING_SOFTWARE_1129`:
#: the 11-29 code's rows fit it, the 12-01 code's check it).
_OLD_H200_FOLDERS = frozenset({"gpu-h200-2026-11-29", "gpu-h200-2026-12-01", S33_H200_RING})
#: Session 29's H100 runs of today's ring (``run.sh``: the working tree of 377ccda, two
#: rounds): ``receive_into`` at 256 MiB to 4 GiB buckets, the first check of the presets'
#: host costs below 2 GiB. Only its ``receive_into`` rows are read: the bench's other rows
#: there (the consumer's views, stream waits, no control links, ...) are diagnostics the
#: model has no path for.
S29_NOW = "gpu-h100-2026-12-06-s29b"
#: The 11-29 H200 runs besides the reported one (``gpu-h200-2026-11-29/README.md``), by file:
#: their code differed from the committed one in the zero-copy half only (run 6: no
#: region-release fast path at the end of a sync; runs 7 and 8: zero-copy batches capped at
#: 2 GiB), so their ring rows are repeats of the reported run's. Run 8 timed the 1 GiB and
#: 4 GiB ring with event ordering only.
H200_1129_RUNS = {"bench_run6.json": "run 6", "bench_run7.json": "run 7",
                  "bench_run8.json": "run 8"}


def _h200_cases(root: str, folders: Optional[frozenset] = None) -> list[dict]:
    """The ``cuda_ipc`` ring on one H200 (and one H100 run); the device-memory rate from the
    run's own flat D2D copy of the same bytes (``d2d``), where it recorded one, and the
    host costs of the run's own code (:func:`ring_costs_1204` for the code of 12-04 on,
    else the preset's). ``folders``: only the runs of these result folders."""
    rows = []
    costs_1204 = {host: ring_costs_1204(host) for host in _TIMELINE_1204}
    costs_old = {code: ring_costs_old(code, root) for code in OLD_H100_TIMELINES}
    for folder, name in (("gpu-h200-2026-11-29", "bench_final.json"),
                         *(("gpu-h200-2026-11-29", n) for n in H200_1129_RUNS),
                         ("gpu-h200-2026-12-01", "gpu_bench.json"),
                         ("gpu-h100-2026-12-05", "gpu_bench.json"),
                         ("gpu-h100-2026-12-05", "gpu_bench_zc.json"),
                         ("gpu-h200-2026-12-05", "gpu_bench.json"),
                         ("gpu-h100-2026-12-05-s20", "gpu_bench.json"),
                         # session 20, H100: the same bench with the receiver's GPU span
                         # and copy replays timed after each sync, two fresh machines
                         *(("gpu-h100-2026-12-05-s20", f"gpu_bench_{k}.json")
                           for k in ("span", "replay")),
                         ("gpu-h200-2026-12-05-s21", "call1/settle0/gpu_bench.json"),
                         ("gpu-h200-2026-12-05-s21", "call1/settle200/gpu_bench.json"),
                         # session 21, H100 call 3 and H200 call 4: fill programs in
                         # batches against the plain ring, two rounds, settled and not
                         *((f"gpu-{gpu}-2026-12-05-s21", f"{call}/r{k}_settle{st}/gpu_bench.json")
                           for gpu, call in (("h100", "call3"), ("h200", "call4"))
                           for k in (1, 2) for st in (0, 200)),
                         # session 34, H100: delta+cuda_ipc beside the dense ring, two
                         # rounds (round 1's delta rows: the preset's codec costs)
                         *((folder, f"r{k}/c{ch}/gpu_bench.json")
                           for folder in (S34_DELTA, S35_DELTA)
                           for k in (1, 2) for ch in ("0.005", "0.05")),
                         # 12-05, H200: the copy programs as 1, 2 and 4 graph branches
                         *(("gpu-h200-2026-12-05-branches", f"gpu_bench_r{k}.json")
                           for k in (1, 2)),
                         # session 23, H100: the engine as it stands (event waits polled)
                         *(("gpu-h100-2026-12-05-s23", f"call1/r{k}_s{st}_poll/gpu_bench.json")
                           for k in (1, 2, 3) for st in (0, 200)),
                         # session 24, H100: zero-copy against pushes
                         *(("gpu-h100-2026-12-06-s24", f"call3/r/r1_s{st}/gpu_bench.json")
                           for st in (200, 0)),
                         # session 26, H100: the ring code of 11-29 and of 12-01, alternating
                         *((S26_RING, f"call{c}/{code}/r{k}/gpu_bench.json")
                           for c, rounds in ((1, (1, 2)), (2, (1, 2, 3)))
                           for k in rounds for code in S26_CODES),
                         # session 29, H100: the same two codes at other bucket sizes
                         *((S29_RING, f"{code}/r{k}/gpu_bench.json")
                           for k in (1, 2) for code in S26_CODES),
                         # session 29, H100: today's ring, receive_into, 256 MiB to 4 GiB
                         *((S29_NOW, f"r{k}/gpu_bench.json") for k in (1, 2)),
                         # sessions 30 and 31, H100: the three codes alternating, four
                         # rounds
                         *((folder, f"{code}/r{k}/gpu_bench.json")
                           for folder in sorted(_S30_LAYOUT)
                           for k in (1, 2, 3, 4) for code in (*S26_CODES, "now"))):
        if folders is not None and folder not in folders or \
                not os.path.exists(os.path.join(root, folder, name)):
            continue
        doc = _json(root, folder, name)
        model = model_from_tensors("llama3-8b-shapes",
                                   _script("gpu_bench").model_shapes(doc["layers"]))
        sets, where = {}, {}
        d2d = doc.get("d2d") or {}
        if d2d.get("flat_ms"):
            sets["links.device_mem.GBps"] = d2d["bytes"] / (d2d["flat_ms"] / 1e3) / 1e9
            where["links.device_mem.GBps"] = "flat D2D copy, own run"
        code = ring_code_of({"source": f"{folder}/{name}"})
        today = folder in _RING_1204_RUNS or (folder in _S30_LAYOUT and name.startswith("now/"))
        # runs whose other rows are the bench's diagnostics: only receive_into is read
        into_only = folder == S29_NOW or (today and folder in _S30_LAYOUT)
        if today:                         # the host's own preset costs of that code
            host = "h100-8gpu-400g" if folder.startswith("gpu-h100-") else "h200-8gpu-400g"
            sets.update(costs_1204[host])
            tl = _TIMELINE_1204[host]
            where.update(dict.fromkeys(("software.tensor_us", "software.bucket_us"),
                                       f"the code's own timeline ({tl})"),
                         **{"software.handoff_us": f"slot waits at 256 MiB in {tl}",
                            "software.finish_us": f"the sync's end in {tl}",
                            "software.pack_wait_x": f"host-ordered publishes in {tl}"})
        # an old code on an H100 host: its timeline costs there, in both rows
        old_costs = costs_old[code] if code and folder.startswith("gpu-h100-") else None
        for e in doc["engine"]:
            cfg = e["cfg"]
            if into_only and (cfg.get("consume") != "into" or set(cfg) - {
                    "bucket_size", "num_slots", "zero_copy", "sync", "consume"}):
                continue
            # zero-copy: receivers read the trainer's tensors; pushes: the trainer writes
            # the receivers' (Scenario.shared on a gpu links file)
            path = "push" if cfg.get("push") else "zero-copy" if cfg["zero_copy"] else "ring"
            if path != "ring" and not today:
                continue    # host costs never measured: see "not_modelled"
            shared = {"push": "receivers", "zero-copy": "trainer", "ring": "none"}[path]

            changed = None
            if cfg.get("delta") is not None:     # delta+cuda_ipc: the codec's own count
                if folder == S34_DELTA and name.startswith("r1/"):
                    continue        # round 1: the H100 preset's codec costs (delta_costs)
                codec = e["metrics"]["codec"]
                changed = codec["changed"] / codec["compared"]

            def scenario(links: Links, cfg=cfg, shared=shared, changed=changed) -> Scenario:
                return Scenario(model=model, links=links, trainer_gpus=1, replicas=1,
                                placement="colocated", bucket_size=cfg["bucket_size"],
                                strategies=("ring",), shared=shared,
                                ring_sync=cfg["sync"], delta=changed)
            # fill programs: asked for by name until session 21, the default since
            fills = path == "ring" and cfg.get("fill_graphs",
                                               folder == "gpu-h100-2026-12-05-s23")
            how = cfg["sync"] + (", receive_into" if cfg.get("consume") == "into" else "") \
                + (", fill programs" if fills else "") \
                + (", settled 200 ms" if "settle200" in name or "_s200_" in name
                   or "_s200/" in name else "") \
                + (f", {cfg['graph_branches']} graph branches" if "graph_branches" in cfg
                   else "") \
                + (f", delta at {cfg['delta']:g}" if cfg.get("delta") is not None else "") \
                + (f", round {name.split('/')[1][1]}" if folder.endswith("-s23") else "")
            gpu, when = folder.split("-", 2)[1:]     # gpu-h100-2026-12-05[-s20]
            case = f"{gpu.upper()} cuda_ipc {path} {cfg['bucket_size'] >> 20} MiB ({how}"
            run = ""
            if folder == S26_RING:     # call1/c1201/r2/gpu_bench.json
                call, code, k = name.split("/")[:3]
                case += f", code of {S26_CODES[code]}"
                run = f", {call} round {k[1:]}"
            elif folder == S29_NOW:    # r2/gpu_bench.json
                run = f", round {name[1]}"
            elif folder in (S29_RING, *_S30_LAYOUT):   # c1201/r2/gpu_bench.json, now/r2/...
                code, k = name.split("/")[:2]
                case += f", code of {S26_CODES[code]}" if code in S26_CODES else ""
                run = f", round {k[1:]}"
            elif folder.endswith("-2026-12-05-s21") and name.startswith(("call3", "call4")):
                run = f", {name.split('/')[0]} round {name.split('/')[1][1]}"
            elif folder in (S34_DELTA, S35_DELTA):
                run = f", round {name[1]}"
            elif folder == "gpu-h200-2026-12-05-branches":
                run = f", round {name[-6]}"
            elif folder == "gpu-h100-2026-12-05-s20" and name != "gpu_bench.json":
                run = f", {name[10:-5]} run"
            elif name in H200_1129_RUNS:
                run = f", {H200_1129_RUNS[name]}"
            rows += _rows(f"{case}{run}, {when})", "ring", scenario,
                          e["median_ms"] / 1e3, f"{folder}/{name} median_ms",
                          "h200-8gpu-400g", sets, where, code_costs=old_costs,
                          repeat_of=_repeat_of(folder, name, f"{case}, {when})"))
    return rows


def _sender_bytes(measured: list) -> Callable:
    def check(r) -> dict:
        pred = [int(x) for x in r.source_bytes]
        return {"bytes_per_sender": {"predicted": pred, "measured": measured}}
    return check


def _nccl_limit(b: Mapping) -> tuple[dict[str, float], dict[str, str]]:
    """NVLink's efficiency from the raw NCCL broadcast the run timed beside ``b``."""
    if not b.get("raw_s"):
        return {}, {}
    line = load_links("h200-8gpu-400g").link("intra").GBps
    eff = b["GB"] / b["raw_s"] / line
    return {"links.intra.efficiency": eff}, {"links.intra.efficiency":
                                             f"raw NCCL broadcast {b['GB'] / b['raw_s']:.0f} "
                                             f"GB/s, same case"}


def _nccl_cases(root: str) -> list[dict]:
    spec = _script("multi_gpu").model_spec(16)
    model = model_from_tensors("llama70b-shaped-16gb", spec)
    rows = []
    runs = [("multi-gpu-h200x2-2026-11-29", "bench.json", "2 x H200"),
            ("multi-gpu-h200x4-2026-11-29", "multi_gpu.json", "4 x H200"),
            ("multi-gpu-h200x2-2026-12-04", "multi_gpu.json", "2 x H200 (12-04)")]
    for folder, name, label in runs:
        if not os.path.exists(os.path.join(root, folder, name)):
            continue
        doc = _json(root, folder, name)
        for b in doc["bench"]:
            def scenario(links: Links, b=b) -> Scenario:
                return Scenario(model=model, links=links, trainer_gpus=1, replicas=1,
                                placement="packed", bucket_size=b["bucket_MiB"] << 20,
                                strategies=("broadcast",))
            how = f", {b['consume']}" if "consume" in b else ""
            rows += _rows(f"{label} collective 1 -> 1, {b['bucket_MiB']} MiB{how}", "broadcast",
                          scenario, b["warm_s"], f"{folder}/{name} bench warm_s",
                          "h200-8gpu-400g", *_nccl_limit(b))
        for s in doc.get("senders", []):
            if "senders" not in s:
                continue

            def scenario(links: Links, s=s) -> Scenario:
                return Scenario(model=model, links=links, trainer_gpus=s["senders"],
                                trainer_shard="full", replicas=s["receivers"],
                                placement="packed", bucket_size=1 << 30,
                                strategies=("broadcast",))
            rows += _rows(f"{label} collective {s['senders']} sender(s) -> "
                          f"{s['receivers']}, 1024 MiB", "broadcast", scenario, s["warm_s"],
                          f"{folder}/{name} senders warm_s", "h200-8gpu-400g",
                          *_nccl_limit(s), check=_sender_bytes(s["warm_bytes_per_sender"]))
    return rows


#: the recorded nixl runs: (folder, file, pipelined, serve) as the backend then ran
NIXL_RUNS = (("cpu-nixl-2026-12-01", "bench_1g.json", False, "staging"),
             ("cpu-nixl-2026-12-01", "bench_1g_run2.json", False, "staging"),
             ("cpu-nixl-pipelined-2026-12-02", "bench_1g.json", True, "staging"),
             ("cpu-nixl-pipelined-2026-12-02", "bench_1g_pipeline_off.json", False, "staging"),
             ("cpu-nixl-pipelined-2026-12-02", "bench_1g_serve_auto.json", True, "auto"),
             ("cpu-nixl-auto-2026-12-03", "bench_1g.json", True, "auto"),
             ("cpu-nixl-auto-2026-12-03", "bench_1g_staging_default_before.json", True,
              "staging"),
             ("cpu-2026-12-06-s25-1202code", "bench_1g_pipeline_off_run1.json", False,
              "staging"),
             ("cpu-2026-12-06-s25-1202code", "bench_1g_pipeline_off_run2.json", False,
              "staging"),
             ("cpu-nixl-2026-12-06-s25", "bench_1g_pipeline_off.json", False, "staging"),
             ("cpu-nixl-2026-12-06-s25", "bench_1g_staging.json", True, "staging"),
             ("cpu-nixl-2026-12-06-s25/progress", "default_auto_1.json", True, "auto"),
             ("cpu-nixl-2026-12-06-s25/progress", "default_auto_2.json", True, "auto"),
             ("cpu-nixl-2026-12-06-s25/progress", "pipeline_off_auto.json", False, "staging"),
             ("cpu-lasting-2026-12-03", "bench_1g.json", True, "auto"),
             # session 26: the bench before and after f7466f0 on the same engine code
             *(("cpu-nixl-2026-12-06-s26/ab", f"{case}_{bench}_{i}.json", pipelined, serve)
               for i in (1, 2) for bench in ("old", "new")
               for case, pipelined, serve in (("default", True, "auto"),
                                              ("pipeline_off", False, "staging"))),
             *(("cpu-nixl-2026-12-06-s26", f"staging_{i}.json", True, "staging")
               for i in (1, 2)),
             # 12-03 review: --threads 0 before and after the lasting fix (pipelined, auto)
             *(("review-2026-12-03", f"nixl_threads0_{w}.json", True, "auto")
               for w in ("before", "before2", "after", "after2")),
             ("cpu-lasting-2026-12-03", "tiny_after.json", True, "auto"),
             # session 25: every agent with NIXL's progress thread, as before 3d72733
             *(("cpu-nixl-2026-12-06-s25/progress", f"default_all_{i}.json", True, "auto")
               for i in (1, 2)),
             ("cpu-nixl-2026-12-06-s25/progress", "pipeline_off_all.json", False, "staging"),
             # 12-02 per-tensor runs (910c979 / 47ee8d4: not pipelined, staging)
             ("per-tensor-2026-12-02", "nixl_after.json", False, "staging"),
             ("per-tensor-2026-12-02", "after_threads0.json", False, "staging"),
             ("delta-2026-12-02", "bench_256mib.json", False, "staging"),
             *((_S35, f"delta_r{k}.json", False, "staging") for k in (1, 2)))

#: nixl bench runs whose bench kept a core spinning beside the sync (not counted): until
#: f7466f0 (12-06, session 26) the bench paired every ``nixl`` step with ``nixl-raw`` in
#: the same processes, and that limit's trainer-side agent ran NIXL's progress thread (a
#: core busy for as long as it lives, BENCHMARKS.md) through the ``nixl`` steps too. The
#: paired raw READ, timed under the same load, carries it into the pull's rate; nothing the
#: runs recorded carries it into the trainer's staging copy. The same engine code with the
#: bench before and after (``cpu-nixl-2026-12-06-s26/ab``, alternating) took 0.25-0.31 s
#: against 0.17-0.19 s (default) and 0.38-0.39 against 0.28-0.33 s (not pipelined,
#: staging). Their rows are printed with their errors, apart (``spun_rows``).
SPUN_RAW = frozenset(f"{folder}/{name}" for folder, name, *_ in NIXL_RUNS
                     if not folder.startswith("cpu-nixl-2026-12-06-s26")
                     or "_old_" in name)


def _nixl_cases(root: str) -> list[dict]:
    """``nixl`` 1 GiB 1 -> 1 on CPU, each run as the backend ran then (pipelined or not,
    staging or serving its own storage), with the run's own limits (:func:`run_links`: the
    raw NIXL READ the bench paired with each nixl step in the same processes as the
    cross-process link, its memcpy, where it ran one, as the copy rate)."""
    rows = []
    for folder, name, pipelined, serve in NIXL_RUNS:
        if not os.path.exists(os.path.join(root, folder, name)):
            continue
        results = _json(root, folder, name)["results"]
        rec = next((r for r in results if r["status"] == "ok" and r["method"] == "nixl"),
                   None)
        if rec is None:
            continue
        model = _cpu_model(rec)
        sets, where = run_links(rec, _limits_by_case(results)[(rec["workload"], rec["dtype"])])
        how = f"{'pipelined' if pipelined else 'not pipelined'}, {serve}"

        def scenario(links: Links, rec=rec, pipelined=pipelined, serve=serve) -> Scenario:
            return Scenario(model=model, links=links, trainer_gpus=1,
                            replicas=rec["receivers"], bucket_size=rec["bucket_size"],
                            strategies=("p2p",), pipelined=pipelined, serve=serve)
        made = _rows(f"CPU {rec['workload']} nixl R={rec['receivers']} ({folder[9:]}/"
                     f"{name}, {how})", "p2p", scenario, rec["warm_median_s"],
                     f"{folder}/{name} warm_median_s", "cpu-2core", sets, where,
                     repeat_of=_repeat_of(folder, name, f"CPU {rec['workload']} nixl "
                                                        f"R={rec['receivers']} ({how})"))
        for row in made:
            row["spun"] = f"{folder}/{name}" in SPUN_RAW
        rows += made
    return rows


#: The CPU bench runs of ``delta+<backend>`` (``weightsync bench --changed``: between syncs
#: the trainer changes that fraction of its elements): (folder, file, label, the knobs of
#: that run's code as :data:`CPU_RUNS_MORE` gives them). 12-02's (26065dd: the ring before
#: the direct window, ``nixl`` not pipelined and staging, every NIXL agent with its
#: progress thread) timed 256 MiB at 0.5 % into 1 and 2 receivers; its dense rows are
#: cases of their own (:data:`CPU_RUNS_MORE`, :data:`NIXL_RUNS`).
DELTA_RUNS = (("delta-2026-12-02", "bench_256mib.json", "12-02", WAITED),
              *((_S35, f"delta_r{k}.json", f"code of 12-02, 12-07 s35 run {k}", WAITED)
                for k in (1, 2)))
#: each codec method as the strategy its transport is (with the method's own knobs)
_DELTA_METHODS = {f"delta+{name}": _CPU_METHODS[name] for name in ("shm", "collective")}
_DELTA_METHODS["delta+nixl"] = ("p2p", {}, {"pipelined": False, "serve": "staging"})


def _delta_cases(root: str) -> list[dict]:
    """``delta+<backend>`` on CPU (:data:`DELTA_RUNS`), each as its transport's strategy
    with ``Scenario.delta`` the fraction of elements the run changed (the bench's records
    of a warm sync). The nixl rows ran while every NIXL agent kept a core spinning (before
    3d72733): shown apart, not counted, as the dense nixl runs of then
    (:data:`SPUN_RAW`)."""
    rows, models = [], {}
    for folder, name, label, knob in DELTA_RUNS:
        if not os.path.exists(os.path.join(root, folder, name)):
            continue
        doc = _json(root, folder, name)
        changed = doc["config"]["changed"]
        for rec in doc["results"]:
            method = _DELTA_METHODS.get(rec["method"]) if rec["status"] == "ok" else None
            if method is None:
                continue
            strategy, replace, extra = method
            replace = {**knob.get("links", {}), **replace}
            scenario = _cpu_scenario(models, rec, strategy, replace,
                                     {**extra, "delta": changed})
            case = f"CPU {rec['workload']} {rec['method']} at {changed:g} R={rec['receivers']}"
            made = _rows(f"{case} ({label})", strategy, scenario, rec["warm_median_s"],
                         f"{folder}/{name} warm_median_s", "cpu-2core", {}, {},
                         check=_record_bytes(rec), repeat_of=_repeat_of(folder, name, case))
            for row in made:
                row["spun"] = strategy == "p2p" and f"{folder}/{name}" in SPUN_RAW
            rows += made
    return rows


def _record_bytes(rec: Mapping) -> Optional[Callable]:
    """The bytes a warm sync sent as records (the bench's codec metrics) beside the bytes
    the plan has a worker take in (its records: the workloads have no tensor small enough
    to go dense)."""
    measured = (rec.get("info") or {}).get("record_bytes")
    if measured is None:
        return None

    def check(r) -> dict:
        return {"record_bytes": {"measured": measured, "predicted": r.dest_bytes[0]}}
    return check


def _nixl_gpu_cases(root: str) -> list[dict]:
    """``nixl`` across two H200s, 1 -> 1 whole (``benchmarks/nixl_multi.py``), with NVLink's
    efficiency set from the raw NIXL READ of the same bytes the run timed beside it. The
    TP-2 rows of that run are not modelled: they ran before trainers staged TP-split
    tensors box by box, which the planner models now (one READ per row then)."""
    path = os.path.join(root, "multi-gpu-h200x2-2026-12-04", "nixl_multi.txt")
    if not os.path.exists(path):
        return []
    mod = _script("nixl_multi")
    rows = []
    with open(path) as f:
        for line in f:
            if not line.startswith("{"):
                continue
            rec = json.loads(line)
            if not rec["case"].startswith("1 trainer ranks (full) -> 1 workers"):
                continue
            spec = mod.model_spec(rec["model_bytes"], mod.LLAMA8B)
            model = model_from_tensors("llama8b-shaped", [(n, s) for n, s, _ in spec])
            line_rate = load_links("h200-8gpu-400g").link("intra").GBps
            raw = rec["raw_read"]["warm_s"]
            sets = {"links.intra.efficiency": rec["model_bytes"] / raw / 1e9 / line_rate}
            where = {"links.intra.efficiency": f"raw NIXL READ {rec['model_bytes'] / raw / 1e9:.0f}"
                                               " GB/s, same case"}

            def scenario(links: Links) -> Scenario:
                return Scenario(model=model, links=links, trainer_gpus=1, replicas=1,
                                placement="packed", strategies=("p2p",), pipelined=True,
                                serve="auto")
            rows += _rows("2 x H200 nixl 1 -> 1 across GPUs (12-04)", "p2p", scenario,
                          rec["nixl"]["warm_s"], "multi-gpu-h200x2-2026-12-04/nixl_multi.txt",
                          "h200-8gpu-400g", sets, where)
    return rows


#: ``nixl`` on CPU, 2 trainer ranks each holding the whole model -> 2 TP-2 workers
#: (``benchmarks/nixl_multi.py --devices cpu --trainers 2 --tp 2``, 1.49 GB; folder
#: ``cpu-nixl-tp-2026-12-04``): (file, box-by-box staging on (``WEIGHTSYNC_NIXL_CUT``)).
#: Every worker gave ``receive_into`` tensors of its kept boxes' shapes (``--consume into``,
#: no landing buffer: ``extra_dev_bytes`` 1). ``nixl_multi_2to2_readme_copy.txt``
#: (``--consume copy``: a fresh full-shape tensor per partial tensor per sync, its box
#: copied out) is not modelled: the model has no path for that consumer.
NIXL_TP_FOLDER = "cpu-nixl-tp-2026-12-04"
NIXL_TP_RUNS = (("nixl_multi_2to2_cut_on.txt", True), ("nixl_multi_2to2_cut_off.txt", False),
                ("nixl_multi_2to2_into.txt", True))


def _reads_per_worker(measured: list) -> Callable:
    def check(r) -> dict:
        return {"reads_per_worker": {"predicted": [int(x) for x in r.dest_reads],
                                     "measured": measured}}
    return check


def _nixl_tp_cases(root: str) -> list[dict]:
    """``nixl`` 2 -> 2 TP-2 workers on CPU (:data:`NIXL_TP_RUNS`): the ``p2p`` strategy,
    trainers ``full``, ``serve="auto"`` and pipelined (the defaults the script ran), box-by-box
    staging as the run set it, slices landed in the workers' own shards. The cross-process
    link (``intra``) from the raw NIXL READ the same run timed (each worker READs its bytes
    from the trainers' flat regions, all workers at once: a worker's bytes / warm s, as
    ``nixl-raw`` sets it for the bench's runs); the rest from the preset."""
    folder = NIXL_TP_FOLDER
    if not any(os.path.exists(os.path.join(root, folder, n)) for n, _ in NIXL_TP_RUNS):
        return []
    mod = _script("nixl_multi")
    rows = []
    for name, cut in NIXL_TP_RUNS:
        path = os.path.join(root, folder, name)
        if not os.path.exists(path):
            continue
        with open(path) as f:
            rec = json.loads(next(line for line in f if line.startswith("{")))
        spec = mod.model_spec(rec["model_bytes"], mod.LLAMA8B)
        model = model_from_tensors("llama8b-shaped", [(n, s) for n, s, _ in spec])
        if model.params * 2 != rec["model_bytes"] or len(spec) != rec["tensors"]:
            raise PlannerError("calibrate", f"{folder}/{name}: the model is not what was "
                                            "measured")
        workers = rec["nixl"]["workers"]
        if any(w["extra_dev_bytes"] > 1 for w in workers):
            raise PlannerError("calibrate", f"{folder}/{name}: a worker used a landing "
                                            "buffer: not slices landed in its own shards")
        raw = rec["raw_read"]
        rate = max(w["bytes"] for w in raw["workers"]) / raw["warm_s"] / 1e9
        sets = {"links.intra.GBps": rate}
        where = {"links.intra.GBps": "raw NIXL READ of a worker's bytes, all workers at once, "
                                     "own run"}
        trainers, tp = len(rec["nixl"]["trainers"]), len(workers)

        def scenario(links: Links, cut=cut) -> Scenario:
            return Scenario(model=model, links=links, trainer_gpus=trainers,
                            trainer_shard="full", replicas=1, tp=tp, bucket_size=256 << 20,
                            strategies=("p2p",), pipelined=True, serve="auto", cut=cut,
                            into_shards=True)
        rows += _rows(f"CPU nixl {trainers} -> {tp} TP-{tp} workers, 1.49 GB, box-by-box "
                      f"staging {'on' if cut else 'off'} ({folder[9:]}/{name})", "p2p",
                      scenario, rec["nixl"]["warm_s"], f"{folder}/{name} nixl warm_s",
                      "cpu-2core", sets, where,
                      check=_reads_per_worker([w["reads"] for w in workers]))
    return rows


#: GPU trainer -> ``shm`` -> CPU receiver on the H200 host (``benchmarks/shm_d2h.py``),
#: runs of the code with pushes: (folder, file). The earlier runs of that script (12-04,
#: 12-04-d2h) ran before pushes and before the receivers' copy threads took the host's
#: cores, and are not modelled.
SHM_D2H_RUNS = (("gpu-h200-2026-12-04-s16", "shm_d2h.json"),
                ("gpu-h100-2026-12-05", "shm_d2h.json"))   # an H100 host of the same kind

#: shm_d2h's consumers the model has: the receiver lands the model in its own tensors
#: through the ring (``into``) or the trainer writes into them (``shared``: push).
#: ``views`` (receive_weights, each view dropped: no landing copy) is a reference the
#: model has no path for.
_D2H_CONSUMERS = {"into": "none", "shared": "receivers"}


def _d2h_limits(doc: Mapping) -> tuple[dict[str, float], dict[str, str]]:
    """The links an shm_d2h run recorded: its pinned device-to-host copy of the model's
    bytes (``links.d2h``) and the receiver's one copy of them over torch's default threads,
    every core of the host (``links.host_mem``: the most the host's copies reach, as the
    CPU runs' ``memcpy@all-cores``)."""
    t, rx = doc["trainer"], doc["rollout"]
    sets, where = {}, {}
    if t.get("d2h_pinned_ms"):
        sets["links.d2h.GBps"] = t["bytes"] / (t["d2h_pinned_ms"] / 1e3) / 1e9
        where["links.d2h.GBps"] = "pinned D2H copy, own run"
    if rx.get("host_copy_ms"):
        sets["links.host_mem.GBps"] = rx["bytes"] / (rx["host_copy_ms"] / 1e3) / 1e9
        where["links.host_mem.GBps"] = f"receiver's copy over {rx['threads']} threads, own run"
    return sets, where


def _shm_d2h_cases(root: str) -> list[dict]:
    """A GPU trainer's CUDA tensors into a CPU receiver over ``shm`` (one H200 host,
    ``h200-host``; ``trainer_device="gpu"``): through the pinned ring, or pushed into the
    receiver's shared tensors; the run's pinned ring (``pin`` 1) only, whose copies are
    the asynchronous device-to-host copies the model prices."""
    rows = []
    for folder, name in SHM_D2H_RUNS:
        if not os.path.exists(os.path.join(root, folder, name)):
            continue
        doc = _json(root, folder, name)
        args = doc["args"]
        shapes = _script("gpu_bench").model_shapes(args["layers"], args.get("scale", 1))
        model = model_from_tensors("llama3-8b-shapes", shapes)
        if model.params * 2 != doc["trainer"]["bytes"]:
            raise PlannerError("calibrate", f"{folder}/{name}: the model is not what was "
                                            "measured")
        sets, where = _d2h_limits(doc)
        for run in doc["runs"]:
            if run["consumer"] not in _D2H_CONSUMERS or str(run["pin"]) != "1" \
                    or not run.get("all_ok"):
                continue

            def scenario(links: Links, run=run) -> Scenario:
                return Scenario(model=model, links=links, trainer_gpus=1, replicas=1,
                                bucket_size=args["bucket_mb"] << 20, strategies=("ring",),
                                trainer_device="gpu", shared=_D2H_CONSUMERS[run["consumer"]])
            how = "ring, pinned" if run["consumer"] == "into" else "push"
            host = folder.split("-")[1].upper()
            rows += _rows(f"{host} host GPU trainer -> shm -> CPU receiver, {run['consumer']} "
                          f"({how}, {folder[9:]})", "ring", scenario, run["median_ms"] / 1e3,
                          f"{folder}/{name} median_ms", "h200-host", sets, where)
    return rows


# ------------------------------------------------------------------ coverage

_SHM_D2H_EARLY = ("ran before pushes and before the receivers' copy threads took the host's "
                  "cores (eb477d1): a code state the model has no costs of")
_DEV_1204 = ("a development state of the 12-04 ring within one session (commands.txt names "
             "each run's tree and what it changed): no timeline of that state")
_NOT_SYNCS = "not a weight sync: "
_COPY = ("consumed with receive_weights + copy_ (--consume copy): one more torch copy a "
         "tensor, direct tensors staged in fresh buffers; not modelled")
#: Every recorded measurement (a ``.json`` / ``.jsonl`` file under ``benchmarks/results/``)
#: that :func:`run` does not predict, by path (a file, or a folder ending in ``/``), and
#: why. :func:`coverage` checks that each file is a case's source, a cost input
#: (:func:`cost_inputs`), one of the calibration's own outputs (``planner*`` folders) or
#: listed here, so a run recorded later is either predicted or said not to be.
NOT_CALIBRATED: dict[str, str] = {
    # --timeline runs (every engine step stamped): the costs' inputs, or held out of them
    f"{S31_RING}/tl/": "--timeline runs held out of the costs: session 31's timed rounds "
                       "check the costs the other machines gave",
    f"{S34_RING}/tl/": "--timeline runs of a machine held out of the costs: its timed "
                       "rounds check the costs the other machines gave",
    f"{S34B_RING}/tl/": f"as {S34_RING}/tl/",
    f"{S33_RING}/tl/now/": "today's ring's timelines on the third H100 machine, not pooled "
                           "into the H100 preset (its tensor_us also prices pushes; pooled: "
                           "377 of 381 rows, two s24 push rows out)",
    f"{S33_RING}/tl2/now/": "as tl/now",
    f"{S33_H200_RING}/tl/c1201/": "the 12-01 code's H200 timeline: the old codes' H200 costs "
                                  "are the fit of the 11-29 runs (RING_SOFTWARE_1129), which "
                                  "its timed runs check",
    "gpu-h100-2026-12-05/gpu_bench_zc_timeline.json": "a zero-copy --timeline run (the "
                                                      "timed run beside it is a case)",
    "gpu-h200-2026-12-05-branches/zc_timeline.json": "a zero-copy --timeline run with "
                                                     "graph branches set by environment",
    # ring codes whose host costs were never timed
    "gpu-h200-2026-12-02/": "the ring code of 12-02 (f7bae5b: replayed plans on the sender, "
                            "between 12-01's and 12-04's codes): its host costs were never "
                            "timed",
    "gpu-h200-2026-12-03-window/gpu_bench.json": "the ring code of 12-02 again (the GPU path "
                                                 "did not change that day)",
    "gpu-h200-2026-12-04/": _DEV_1204,
    "gpu-h200-2026-12-04-programs/": _DEV_1204 + " (copy programs being introduced)",
    "gpu-h100-2026-12-05-s20/gpu_bench_norecord.json": "an experiment reverted after the "
                                                       "call (commands.txt)",
    "gpu-h100-2026-12-05-s23/call1/": None,     # filled below: the _block runs only
    "gpu-h200-2026-12-05-s21/call1/waits200/": "both sides' stream waits (off by default): "
                                               "no path in the model",
    # nixl on one H200 and shm_d2h states the model has no path for
    "gpu-h200-2026-12-01/nixl_gpu.json": "nixl VRAM -> VRAM on one H200 (UCX takes a host "
                                         "path there)",
    "gpu-h200-2026-12-03/nixl_gpu.json": "as gpu-h200-2026-12-01/nixl_gpu.json",
    "gpu-h200-2026-12-03-window/nixl_gpu.json": "as gpu-h200-2026-12-01/nixl_gpu.json",
    "gpu-h200-2026-12-04-d2h/run1_nixl_gpu.json": "as gpu-h200-2026-12-01/nixl_gpu.json",
    "gpu-h200-2026-12-04-d2h/run1_shm_d2h_consumers.json": _SHM_D2H_EARLY,
    "gpu-h200-2026-12-04-d2h/run2_": _SHM_D2H_EARLY + " (WEIGHTSYNC_COPY_THREADS set)",
    "gpu-h200-2026-12-04-d2h/run3_auto_threads.json": "a bench of its own (pinned against "
                                                      "unpinned at the new copy-thread "
                                                      "default): the unpinned ring is not "
                                                      "modelled",
    "gpu-h200-2026-12-04-d2h/run4_views_after_staging_reuse.json": "receive_weights views "
                                                                   "(not modelled)",
    "gpu-h200-2026-12-04/shm_d2h_run8.json": _SHM_D2H_EARLY,
    # CPU runs the model has no path for
    "cpu-1g-2026-12-02/threads0_copy.json": _COPY,
    "per-tensor-2026-12-02/after_threads0_copy.json": _COPY,
    "cpu-nixl-2026-12-01/bench_256m_readme_path.json": _COPY,
    "cpu-nixl-pipelined-2026-12-02/bench_1g_readme_path.json": _COPY,
    "cpu-nixl-auto-2026-12-03/bench_1g_readme_path.json": _COPY,
    "cpu-nixl-2026-12-06-s25/progress/readme_": _COPY,
    "cpu-nixl-2026-12-06-s26/readme_": _COPY,
    "per-tensor-2026-12-02/before.json": "the code before replayed plans (953d914, 62 us a "
                                         "tensor): its per-tensor cost was never measured "
                                         "apart from this run",
    "review-2026-12-03/tiny_after.json": "4978907's first direct window, with an extra "
                                         "coroutine a tensor (mended within the hour, "
                                         "3986479): a code state the model has no cost of",
    "cpu-shm-window-2026-12-06-s28/sampler/sampler_off_": "the bench's RSS sampler thread "
                                                          "off (WSB_NO_SAMPLER=1, a bench "
                                                          "check): the sampler_on runs "
                                                          "beside them are cases",
    "delta-2026-12-02/delta.json": "benchmarks/delta_bench.py's training run (bytes and "
                                   "times of 20 steps of AdamW and a churn of replicas): "
                                   "not a bench of the sync alone",
    f"{S34_DELTA}/kernels.json": "the codec's kernels on one tensor (delta_bench.py "
                                 "--kernels): not a sync; the H100 preset's codec source "
                                 "reads it",
    f"{S35_DELTA}/kernels.json": "the codec's kernels on one tensor (delta_bench.py "
                                 "--kernels) on session 35's H100: not a sync",
    # measurements that are not a sync of weightsync's own paths
    "gpu-h200-2026-12-02-codec/": _NOT_SYNCS + "the FP8 / delta codec kernels alone",
    "gpu-h200-2026-12-05-branches/gpu_copies.json": _NOT_SYNCS + "copy kernels alone",
    "gpu-h200-2026-12-05-s20/gpu_copies_ipc.json": _NOT_SYNCS + "copy kernels alone",
    "gpu-h100-2026-12-05-s20/gpu_copies_ipc.json": _NOT_SYNCS + "copy kernels alone",
    "late-joiner-": _NOT_SYNCS + "a replica joining mid-run (benchmarks/late_joiner.py)",
    "multi-gpu-h200x4-2026-11-29/conformance_final.json": _NOT_SYNCS + "test results",
    "swift-sync-": _NOT_SYNCS + "ms-swift's manager driving weightsync over Ray, its "
                                "phases timed (the planner has no Ray or manager costs)",
    "vllm-native-": _NOT_SYNCS + "vLLM's own weight-transfer path inside its engine",
}
NOT_CALIBRATED.update({f"gpu-h100-2026-12-05-s23/call1/r{k}_s{st}_block/": (
    "blocking event waits, an alternative the engine did not keep (the _poll runs beside "
    "them are cases)") for k in (1, 2, 3) for st in (0, 200)})
del NOT_CALIBRATED["gpu-h100-2026-12-05-s23/call1/"]


def cost_inputs() -> list[str]:
    """The runs the host costs are read off: the ``--timeline`` runs of the GPU rings (the
    presets' and the old codes'), the CPU codes' ``--tiny`` runs (:data:`TINY_COSTS`) and
    the 11-29 codes' waits between direct reads (:data:`WAIT_RUN`): inputs of the
    calibration, not its cases."""
    folders = {*TODAY_H100_TIMELINES, *TODAY_H200_TIMELINES, OLD_H200_TIMELINE,
               *(f for fs in OLD_H100_TIMELINES.values() for f in fs)}
    return sorted([f"{f}/gpu_bench.json" for f in folders]
                  + ["/".join(run) for run in TINY_COSTS.values()] + ["/".join(WAIT_RUN)])


def _not_calibrated(path: str) -> Optional[str]:
    return next((why for key, why in NOT_CALIBRATED.items()
                 if path == key or (key.endswith("/") or not key.endswith((".json", ".jsonl")))
                 and path.startswith(key)), None)


def coverage(doc: dict, results: Optional[str] = None) -> dict:
    """Every recorded measurement under ``results`` (default: the checkout's) against
    ``doc`` (:func:`run` over every group): ``cases`` (files some row was predicted from),
    ``cost_inputs``, ``not_calibrated`` (file: why, :data:`NOT_CALIBRATED`),
    ``unaccounted`` (none of these: a recorded run nobody decided about) and ``stale``
    (entries of NOT_CALIBRATED or cost inputs that match no file, or match a case)."""
    root = results if results is not None else results_dir()
    files = sorted(os.path.relpath(os.path.join(d, n), root)
                   for d, _, names in os.walk(root) for n in names
                   if n.endswith((".json", ".jsonl")))
    files = [f for f in files if not f.startswith("planner")]
    read = {r["source"].split()[0]
            for r in doc["rows"] + doc["preset_rows"] + doc["spun_rows"]}
    inputs = set(cost_inputs())
    out = {"cases": [], "cost_inputs": [], "not_calibrated": {}, "unaccounted": []}
    for f in files:
        why = _not_calibrated(f)
        if f in read:
            out["cases"].append(f)
        elif f in inputs:
            out["cost_inputs"].append(f)
        elif why is not None:
            out["not_calibrated"][f] = why
        else:
            out["unaccounted"].append(f)
    out["stale"] = sorted({k for k in NOT_CALIBRATED
                           if not any(f == k or f.startswith(k) for f in files)
                           or any(f == k or (k.endswith("/") and f.startswith(k))
                                  for f in read)} | (inputs - set(files)))
    return out


GROUPS = {"cpu": _cpu_cases, "nixl": _nixl_cases, "nixl-tp": _nixl_tp_cases,
          "h200": _h200_cases, "nccl": _nccl_cases, "nixl-gpu": _nixl_gpu_cases,
          "shm-d2h": _shm_d2h_cases, "delta": _delta_cases}


def run(groups: tuple[str, ...] = tuple(GROUPS), results: Optional[str] = None) -> dict:
    """Every case of ``groups``, predicted and compared (``error`` = predicted /
    measured - 1); ``results``: the folder of recorded runs (default: the checkout's
    ``benchmarks/results``). ``rows``: the calibration (each case with the links its run
    recorded); ``preset_rows``: the same cases with the preset alone, not counted;
    ``repeats``: :func:`repeat_groups` of the counted rows, ``noisy_misses`` the counted
    misses in noisy groups (``noisy_misses_given_links``: in groups noisy by measured /
    predicted); ``case_within_goal`` of ``case_count``: :func:`by_case` (``within_goal`` of
    ``cases`` counts every run's row)."""
    bad = [g for g in groups if g not in GROUPS]
    if bad:
        raise PlannerError("calibrate", f"unknown group(s) {', '.join(bad)}; "
                                        f"known: {', '.join(GROUPS)}")
    root = results if results is not None else results_dir()
    rows, preset, spun = [], [], []
    for g in groups:
        for row in GROUPS[g](root):
            counted = row.pop("counted")
            if row.pop("spun", False):       # see SPUN_RAW: shown apart, not counted
                if counted:
                    spun.append(row)
                continue
            (rows if counted else preset).append(row)
    repeats = repeat_groups(rows)
    repeat_groups(preset)        # marks the preset rows alike (same measurements)
    repeat_groups(spun)
    misses = [r for r in rows if not r["within_goal"]]
    noisy = {g["group"] for g in repeats if g["noisy"]}
    noisy_links = {g["group"] for g in repeats if g["noisy_given_links"]}
    case_within, case_count = by_case(rows, repeats)
    doc = {"schema": "weightsync.plan.calibration/5", "goal": GOAL, "rows": rows,
            "within_goal": sum(r["within_goal"] for r in rows), "cases": len(rows),
            "case_within_goal": case_within, "case_count": case_count,
            "misses": len(misses), "repeats": repeats, "repeat_band": REPEAT_BAND,
            "noisy_misses": sum(r["repeat_of"] in noisy for r in misses),
            "noisy_misses_given_links": sum(r["repeat_of"] in noisy_links for r in misses),
            "preset_rows": preset,
            "preset_within_goal": sum(r["within_goal"] for r in preset),
            "spun_rows": spun, "spun_within_goal": sum(r["within_goal"] for r in spun),
            "not_modelled": ["cuda_ipc zero-copy of the code before 12-04 (its host costs "
                             "were never timed; the 11-29 ring's fitted ones predict 22 ms "
                             "where it took 13)",
                             "verl-style cuda_ipc baseline",
                             "ray, gloo-per-tensor, safetensors-shm baselines",
                             "CPU runs with --consume copy (receive_weights + copy_: one "
                             "more torch copy per tensor, direct tensors staged in fresh "
                             "buffers)",
                             "shm_d2h receive_weights views and the unpinned ring",
                             "nixl TP workers consuming with receive_weights + copy "
                             "(cpu-nixl-tp-2026-12-04 readme_copy)",
                             "nixl VRAM -> VRAM on one H200 (UCX takes a host path there)"]}
    # which recorded files were read, only meaningful when every group ran
    doc["coverage"] = coverage(doc, root) if set(groups) == set(GROUPS) else None
    return doc


def _within(r: dict) -> str:
    if r["within_goal"]:
        return "yes"
    return "**no** (noisy repeats)" if r.get("noisy") else "**no**"


def _lines(rows: list[dict], sep: str) -> list[str]:
    out = []
    for r in rows:
        extra = ""
        if "bytes_per_sender" in r:
            b = r["bytes_per_sender"]
            extra = f" (bytes per sender predicted {b['predicted']}, measured {b['measured']})"
        if "reads_per_worker" in r:
            n = r["reads_per_worker"]
            extra = f" (READs per worker predicted {n['predicted']}, measured {n['measured']})"
        cells = [r["case"], f"{r['predicted_s'] * 1e3:.1f}", f"{r['measured_s'] * 1e3:.1f}",
                 f"{r['error'] * 100:+.0f} %", _within(r), r["limited_by"] + extra,
                 r["links_from"]]
        out.append(sep.join(cells))
    return out


_SPUN_TITLE = ("nixl runs with the bench's spinning raw agent (not counted: until f7466f0 the "
               "paired nixl-raw's trainer agent kept a core busy through the nixl steps, a "
               "load no recorded limit prices for the staging copy; calibrate.SPUN_RAW)")


def _spun_summary(doc: dict) -> str:
    n, k = len(doc["spun_rows"]), doc["spun_within_goal"]
    return (f"nixl runs with the bench's spinning raw agent: {k} of {n} within "
            f"+-{doc['goal'] * 100:.0f} %, not counted (with them: {doc['within_goal'] + k} "
            f"of {doc['cases'] + n} rows)")


_PRESET_TITLE = ("preset vs this run's box (not counted: the same cases with the preset's "
                 "fixed rates instead of the limits their run recorded)")


def _repeats_title(doc: dict) -> str:
    return (f"repeats (the same case in runs of the same code and command; noisy: "
            f"measurements more than {doc['repeat_band']:.3f} x apart, so no one prediction "
            f"is within +-{doc['goal'] * 100:.0f} % of all; still counted)")


def _repeat_lines(doc: dict, sep: str) -> list[str]:
    out = []
    for g in doc["repeats"]:
        cells = [g["group"], ", ".join(f"{m * 1e3:.1f}" for m in g["measured_s"]),
                 ", ".join(f"{e * 100:+.0f} %" for e in g["errors"]),
                 f"{g['median_error'] * 100:+.0f} %" + ("" if g["within_goal"] else " **no**"),
                 f"{g['spread']:.3f} x", f"{g['residual_spread']:.3f} x",
                 "**yes**" if g["noisy"] else "no", str(g["misses"])]
        out.append(sep.join(cells))
    return out


_REPEAT_HEAD = ("group | measured ms | errors | median error (the case) | spread (measured) | "
                "spread left with each run's links (measured / predicted) | noisy | misses")


def _noisy_summary(doc: dict) -> str:
    """How many misses are in noisy groups of repeats, and in groups whose measured /
    predicted ratios lie further apart than the band with each run's own links."""
    band = f"{doc['repeat_band']:.3f} x"
    n = sum(g["noisy"] for g in doc["repeats"])
    k = sum(g["noisy_given_links"] for g in doc["repeats"])
    return (f"of the {doc['misses']} misses, {doc['noisy_misses']} are in noisy groups of "
            f"repeats ({n} of {len(doc['repeats'])} groups: measurements more than {band} "
            f"apart) and {doc['noisy_misses_given_links']} in groups whose measured / "
            f"predicted ratios lie more than {band} apart with each run's own links "
            f"({k} groups)")


def _by_case(doc: dict) -> str:
    return (f"by case, each group of repeats judged once by the median of its runs' errors: "
            f"{doc['case_within_goal']} of {doc['case_count']} within "
            f"+-{doc['goal'] * 100:.0f} %")


def _coverage_summary(doc: dict) -> str:
    cov = doc.get("coverage")
    if not cov:
        return ""
    return (f"; recorded measurements (.json and .jsonl under benchmarks/results): "
            f"{len(cov['cases'])} files predicted, {len(cov['cost_inputs'])} the costs' inputs "
            f"(timelines, tiny runs, direct-read waits), "
            f"{len(cov['not_calibrated'])} not calibrated (calibrate.NOT_CALIBRATED says "
            f"why), {len(cov['unaccounted'])} unaccounted")


def format_text(doc: dict) -> str:
    head = ("case | predicted ms | measured ms | error | within 25 % | predicted bottleneck | "
            "links")
    tail = (f"{doc['within_goal']} of {doc['cases']} cases within +-{doc['goal'] * 100:.0f} % "
            f"(links from each run's own limits where it recorded them); {_by_case(doc)}; "
            f"{_noisy_summary(doc)}; {_spun_summary(doc)}; preset alone: "
            f"{doc['preset_within_goal']} of {len(doc['preset_rows'])}, not counted; "
            f"not modelled: {', '.join(doc['not_modelled'])}{_coverage_summary(doc)}")
    preset = ["", _PRESET_TITLE + ":", head] + _lines(doc["preset_rows"], " | ") \
        if doc["preset_rows"] else []
    repeats = ["", _repeats_title(doc) + ":", _REPEAT_HEAD] + _repeat_lines(doc, " | ") \
        if doc["repeats"] else []
    spun = ["", _SPUN_TITLE + ":", head] + _lines(doc["spun_rows"], " | ") \
        if doc["spun_rows"] else []
    return "\n".join([head] + _lines(doc["rows"], " | ") + repeats + spun + preset
                     + ["", tail])


def format_markdown(doc: dict) -> str:
    head = ["| case | predicted ms | measured ms | error | within +-25 % | predicted bottleneck "
            "| links |", "| --- | ---: | ---: | ---: | --- | --- | --- |"]
    out = head + [f"| {line} |" for line in _lines(doc["rows"], " | ")]
    out += ["", f"{doc['within_goal']} of {doc['cases']} cases within "
                f"+-{doc['goal'] * 100:.0f} % (links from each run's own limits where it "
                f"recorded them); {_noisy_summary(doc)}.", "", f"{_by_case(doc)[0].upper()}"
                f"{_by_case(doc)[1:]}."]
    if doc["repeats"]:
        title = _repeats_title(doc)
        out += ["", f"**{title[0].upper() + title[1:]}**", "",
                f"| {_REPEAT_HEAD} |", "| --- | ---: | ---: | ---: | ---: | ---: | --- | ---: |"]
        out += [f"| {line} |" for line in _repeat_lines(doc, " | ")]
    if doc["spun_rows"]:
        out += ["", f"**{_SPUN_TITLE[0].upper() + _SPUN_TITLE[1:]}**", ""] + head
        out += [f"| {line} |" for line in _lines(doc["spun_rows"], " | ")]
        out += ["", f"{_spun_summary(doc)[0].upper()}{_spun_summary(doc)[1:]}."]
    if doc["preset_rows"]:
        out += ["", f"**{_PRESET_TITLE[0].upper() + _PRESET_TITLE[1:]}**", ""] + head
        out += [f"| {line} |" for line in _lines(doc["preset_rows"], " | ")]
        out += ["", f"Preset alone: {doc['preset_within_goal']} of {len(doc['preset_rows'])} "
                    f"within +-{doc['goal'] * 100:.0f} % (not counted)."]
    if doc.get("coverage"):
        out += ["", "**Recorded measurements not calibrated**", "", "| file | why |",
                "| --- | --- |"]
        out += [f"| {f} | {why} |" for f, why in doc["coverage"]["not_calibrated"].items()]
        out += ["", f"{_coverage_summary(doc)[2].upper()}{_coverage_summary(doc)[3:]}."]
    return "\n".join(out)
