"""Tests of ``weightsync plan --calibrate`` (weightsync.tools.planner.calibrate): every
case is predicted with the link rates its own run recorded (memcpy, memcpy-parallel,
gloo-flat, nixl-raw), the preset-only predictions are printed but not counted, and bad
recorded limits are a PlannerError. Recorded runs are copied into a tmp folder and changed
there, so a prediction that ignores its run's limits cannot pass."""

from __future__ import annotations

import copy
import functools
import json
import math
import os
import re

import pytest

from weightsync.tools.planner import PlannerError
from weightsync.tools.planner import calibrate
from weightsync.tools.planner.links import load_links

pytestmark = pytest.mark.timeout(120)

CPU_RUN = ("cpu-calib-2026-12-03", "bench.json")
NIXL_RUN = ("cpu-nixl-pipelined-2026-12-02", "bench_1g.json")


@pytest.fixture
def spun_counted(monkeypatch):
    """The tests of links, repeats and counting by case read the recorded nixl runs of 12-01
    and 12-02 as their inputs. The calibration keeps those runs out of the count (the
    bench's raw agent spun a core beside them, calibrate.SPUN_RAW, tested on its own
    below); these tests count them as any run."""
    monkeypatch.setattr(calibrate, "SPUN_RAW", frozenset())


@functools.lru_cache(maxsize=1)
def _h200_calibration() -> dict:
    return calibrate.run(("h200",))


def _h200_run() -> dict:
    """``calibrate.run(("h200",))`` over the recorded GPU runs: computed once per session
    (no test here changes what it reads), a fresh copy for each test."""
    return copy.deepcopy(_h200_calibration())


def _recorded(folder: str, name: str) -> dict:
    with open(os.path.join(calibrate.results_dir(), folder, name)) as f:
        return json.load(f)


def _write(root, folder: str, name: str, doc: dict) -> str:
    (root / folder).mkdir(parents=True, exist_ok=True)
    (root / folder / name).write_text(json.dumps(doc))
    return str(root)


def _cpu_1gib() -> dict:
    """The 12-03 CPU run, its 1 GiB workload only (no HF model needed, a few seconds)."""
    doc = _recorded(*CPU_RUN)
    doc["results"] = [r for r in doc["results"] if r["workload"] == "synthetic-1GiB"
                      and r["status"] == "ok"]
    return doc


def _find(rows: list, case: str) -> dict:
    hit = [r for r in rows if r["case"] == case]
    assert len(hit) == 1, (case, [r["case"] for r in rows])
    return hit[0]


def _rec(doc: dict, method: str, receivers: int) -> dict:
    return next(r for r in doc["results"] if r["method"] == method
                and r["receivers"] == receivers)


def test_cpu_links_come_from_the_runs_own_limits(tmp_path):
    """Slowing a run's recorded gloo-flat (paired with the collective's steps) slows that
    collective row's prediction by as much, and its memcpy-parallel the shm-buckets row's;
    the preset rows of the same cases do not move."""
    doc = _cpu_1gib()
    before = calibrate.run(("cpu",), results=_write(tmp_path / "a", *CPU_RUN, doc))
    slow = copy.deepcopy(doc)
    col = _rec(slow, "collective", 1)
    col["paired"]["warm_median_s"] *= 2
    for r in slow["results"]:
        if r["method"] == "memcpy-parallel":
            r["warm_median_s"] *= 2
    after = calibrate.run(("cpu",), results=_write(tmp_path / "b", *CPU_RUN, slow))

    case = "CPU synthetic-1GiB collective R=1 (12-03)"
    b, a = _find(before["rows"], case), _find(after["rows"], case)
    assert b["links"] == "run" and "gloo-flat, paired" in b["links_from"]
    # the gloo broadcast sets its pace (the stream, or the cores it keeps busy): twice the
    # raw broadcast's time, nearly twice the sync (the copies on the cores do not double)
    assert "broadcast stream" in b["limited_by"] or "cores" in b["limited_by"]
    assert 1.6 * b["predicted_s"] < a["predicted_s"] < 2.1 * b["predicted_s"]
    gbps = col["bytes"] / _rec(doc, "collective", 1)["paired"]["warm_median_s"] / 1e9
    assert f"collective {gbps:.3g} GB/s" in b["links_from"]

    case = "CPU synthetic-1GiB shm-buckets R=2 (12-03)"
    b, a = _find(before["rows"], case), _find(after["rows"], case)
    assert "host_mem" in b["limited_by"] and "memcpy-parallel" in b["links_from"]
    assert a["predicted_s"] > 1.5 * b["predicted_s"]

    for case in ("CPU synthetic-1GiB collective R=1 (12-03)",
                 "CPU synthetic-1GiB shm-buckets R=2 (12-03)"):
        pb, pa = _find(before["preset_rows"], case), _find(after["preset_rows"], case)
        assert pb["links"] == "preset" and pb["predicted_s"] == pa["predicted_s"]


def test_nixl_link_comes_from_the_paired_raw_read(tmp_path, spun_counted):
    """The nixl row's cross-process link is the raw READ the bench paired with its steps:
    a slower paired READ gives a slower prediction; the standalone READ is not used."""
    doc = _recorded(*NIXL_RUN)
    before = calibrate.run(("nixl",), results=_write(tmp_path / "a", *NIXL_RUN, doc))
    slow = copy.deepcopy(doc)
    _rec(slow, "nixl", 1)["paired"]["warm_median_s"] *= 3
    after = calibrate.run(("nixl",), results=_write(tmp_path / "b", *NIXL_RUN, slow))
    other = copy.deepcopy(doc)
    _rec(other, "nixl-raw", 1)["warm_median_s"] *= 3
    same = calibrate.run(("nixl",), results=_write(tmp_path / "c", *NIXL_RUN, other))
    (b,), (a,), (s,) = before["rows"], after["rows"], same["rows"]
    assert "nixl-raw, paired" in b["links_from"] and "intra_in" in b["limited_by"]
    assert a["predicted_s"] > 2 * b["predicted_s"]
    assert s["predicted_s"] == b["predicted_s"]


def test_preset_rows_are_printed_but_not_counted(tmp_path):
    """Each case with recorded limits has one counted row (its run's links) and one
    preset row apart; the count and the tally are over the counted rows only. A run that
    recorded no limit is predicted with the preset, and that row is counted."""
    doc = _cpu_1gib()
    res = calibrate.run(("cpu",), results=_write(tmp_path / "a", *CPU_RUN, doc))
    assert res["rows"] and len(res["rows"]) == len(res["preset_rows"]) == res["cases"]
    assert all(r["links"] == "run" for r in res["rows"])
    assert all(r["links"] == "preset" for r in res["preset_rows"])
    assert res["within_goal"] == sum(r["within_goal"] for r in res["rows"])
    assert res["preset_within_goal"] == sum(r["within_goal"] for r in res["preset_rows"])
    assert {r["case"] for r in res["rows"]} == {r["case"] for r in res["preset_rows"]}
    for r in res["rows"] + res["preset_rows"]:
        assert r["error"] == pytest.approx(r["predicted_s"] / r["measured_s"] - 1)
        assert r["within_goal"] == (abs(r["error"]) <= calibrate.GOAL)

    md = calibrate.format_markdown(res)
    head, _, preset = md.partition("Preset vs this run's box")
    assert preset, md
    assert f"{res['within_goal']} of {res['cases']} cases within" in head
    assert head.count("| preset cpu-2core |") == 0
    assert preset.count("| preset cpu-2core |") == len(res["preset_rows"])
    assert "preset vs this run's box" in calibrate.format_text(res)

    bare = copy.deepcopy(doc)
    limits = {lim.method for lim in calibrate.RUN_LIMITS}
    bare["results"] = [r for r in bare["results"] if r["method"] not in limits]
    for r in bare["results"]:
        r["paired"] = None
    res = calibrate.run(("cpu",), results=_write(tmp_path / "b", *CPU_RUN, bare))
    assert res["rows"] and not res["preset_rows"]
    assert all(r["links"] == "preset" and "recorded no limit" in r["links_from"]
               for r in res["rows"])


def test_run_links_rules():
    """Paired limit first, else the same receiver count; host_mem is the median of the
    run's memcpy-parallel records of 2+ processes (R copiers x bytes / s), never one process
    copying alone; gloo-flat counts each receiver's copy; the direct reads take a paired
    memcpy over the run's cma-raw, cma-raw over an unpaired memcpy."""
    gb = 10 ** 9
    rec = {"method": "shm", "receivers": 2, "bytes": gb,
           "paired": {"method": "memcpy", "warm_median_s": 0.2}}
    limits = {"memcpy": [{"receivers": 2, "bytes": gb, "warm_median_s": 0.1}],
              "memcpy-parallel": [{"receivers": 1, "bytes": gb, "warm_median_s": 0.1},
                                  {"receivers": 2, "bytes": gb, "warm_median_s": 0.25},
                                  {"receivers": 4, "bytes": gb, "warm_median_s": 0.2}],
              "gloo-flat": [{"receivers": 1, "bytes": gb, "warm_median_s": 0.1},
                            {"receivers": 2, "bytes": gb, "warm_median_s": 0.5}],
              "cma-raw": [{"receivers": 2, "bytes": gb, "warm_median_s": 0.25}]}
    parallel = limits["memcpy-parallel"]
    limits[calibrate._host_key("memcpy-parallel")] = [r for r in parallel if r["receivers"] > 1]
    sets, where = calibrate.run_links(rec, limits)
    assert sets == pytest.approx({"links.device_mem.GBps": 5.0,     # the paired memcpy
                                  "links.host_mem.GBps": 14.0,      # 2 / 0.25 and 4 / 0.2 GB/s
                                  "collective.GBps": 4.0,           # 2 x 1 GB in 0.5 s
                                  # the paired memcpy, over the run's cma-raw
                                  "ring.direct_GBps": 5.0})
    assert where["links.device_mem.GBps"] == "memcpy, paired"
    assert "over the run's cma-raw" in where["ring.direct_GBps"]
    # a step without a paired memcpy: the run's cma-raw, 2 readers x 1 GB in 0.25 s
    sets, where = calibrate.run_links({**rec, "paired": None}, limits)
    assert sets["ring.direct_GBps"] == pytest.approx(8.0)
    assert where["ring.direct_GBps"] == "cma-raw, own run, R=2"
    assert where["links.host_mem.GBps"] == "memcpy-parallel, median of the run's 2 records " \
        "of 2+ processes"
    # a run whose only memcpy-parallel is one process (R=1): host_mem stays the preset's
    alone = {"memcpy-parallel": parallel[:1], calibrate._host_key("memcpy-parallel"): []}
    assert "links.host_mem.GBps" not in calibrate.run_links({**rec, "receivers": 1,
                                                             "paired": None}, alone)[0]
    assert calibrate.run_links({**rec, "paired": None}, {}) == ({}, {})
    # a run without cma-raw: the direct reads at its memcpy's rate (the paired one here)
    sets, where = calibrate.run_links(rec, {k: v for k, v in limits.items() if k != "cma-raw"})
    assert sets["ring.direct_GBps"] == pytest.approx(5.0)
    assert "no cma-raw" in where["ring.direct_GBps"] and "memcpy, paired" in where["ring.direct_GBps"]
    bad = {"memcpy": [{"receivers": 2, "bytes": gb, "warm_median_s": 0}]}
    with pytest.raises(PlannerError, match="warm_median_s"):
        calibrate.run_links({**rec, "paired": None}, bad)
    with pytest.raises(PlannerError, match="unknown group"):
        calibrate.run(("gpu",))


NIXL_REPEATS = (("cpu-nixl-2026-12-01", "bench_1g.json"),
                ("cpu-nixl-2026-12-01", "bench_1g_run2.json"))


def test_repeats_further_apart_than_the_band_are_a_noisy_group_still_counted(tmp_path,
                                                                            spun_counted):
    """The two 12-01 nixl runs (the same code and command, calibrate.REPEATS) measured the
    same case 2.06 s and 7.28 s: more than (1 + GOAL) / (1 - GOAL) apart, so no one
    prediction can be within the goal of both. They form one noisy group; both rows stay
    counted, a miss among them is counted as a noisy miss and marked in the table. A run
    outside REPEATS (the 12-02 pipelined one) is in no group. Brought within the band of
    each other, the same two runs are a group that is not noisy."""
    docs = [_recorded(*run) for run in NIXL_REPEATS]
    root = tmp_path / "a"
    for (folder, name), doc in zip(NIXL_REPEATS, docs):
        _write(root, folder, name, doc)
    _write(root, *NIXL_RUN, _recorded(*NIXL_RUN))
    res = calibrate.run(("nixl",), results=str(root))
    assert res["cases"] == 3 and len(res["repeats"]) == 1
    (g,) = res["repeats"]
    m1, m2 = (_rec(d, "nixl", 1)["warm_median_s"] for d in docs)
    assert g["measured_s"] == [m1, m2]
    assert g["spread"] == pytest.approx(m2 / m1) and g["spread"] > calibrate.REPEAT_BAND
    assert calibrate.REPEAT_BAND == pytest.approx(1.25 / 0.75)
    rows = [r for r in res["rows"] if r["repeat_of"] == g["group"]]
    assert len(rows) == 2 and g["noisy"] and all(r["noisy"] for r in rows)
    left = [r["measured_s"] / r["predicted_s"] for r in rows]
    assert g["residual_spread"] == pytest.approx(max(left) / min(left))
    assert g["noisy_given_links"] == (g["residual_spread"] > calibrate.REPEAT_BAND)
    (other,) = [r for r in res["rows"] if r["repeat_of"] is None]
    assert NIXL_RUN[0] in other["source"] and not other["noisy"]
    misses = [r for r in res["rows"] if not r["within_goal"]]
    assert res["misses"] == len(misses)
    assert res["noisy_misses"] == sum(r in rows for r in misses)
    text, md = calibrate.format_text(res), calibrate.format_markdown(res)
    for r in misses:
        marker = "**no** (noisy repeats)" if r["noisy"] else "**no** |"
        assert f"| {r['error'] * 100:+.0f} % | {marker}" in text
    assert f"{res['noisy_misses']} are in noisy groups of repeats (1 of 1 groups" in text
    assert "| **yes** |" in md.partition("Repeats (")[2]

    close = copy.deepcopy(docs[1])
    _rec(close, "nixl", 1)["warm_median_s"] = 1.5 * m1
    root = tmp_path / "b"
    _write(root, *NIXL_REPEATS[0], docs[0])
    _write(root, *NIXL_REPEATS[1], close)
    res = calibrate.run(("nixl",), results=str(root))
    (g,) = res["repeats"]
    assert g["spread"] == pytest.approx(1.5) and not g["noisy"]
    assert res["noisy_misses"] == 0 and not any(r["noisy"] for r in res["rows"])
    assert "**no** (noisy repeats)" not in calibrate.format_text(res)


def test_a_group_of_repeats_is_one_case_judged_by_the_median_of_its_errors(tmp_path,
                                                                          monkeypatch,
                                                                          spun_counted):
    """Counted by case, the two 12-01 nixl runs plus a third of the same code are one case,
    judged by the median of their three errors: a third run close to the prediction outvotes
    the slow run's miss (which the count of rows still shows), a third run as far off as
    the slow one does not. The 12-02 run, in no group, is a case of its own."""
    run3 = ("cpu-nixl-2026-12-01", "bench_1g_run3.json")
    monkeypatch.setattr(calibrate, "NIXL_RUNS", calibrate.NIXL_RUNS[:2]
                        + (run3 + (False, "staging"),) + calibrate.NIXL_RUNS[2:3])
    monkeypatch.setitem(calibrate.REPEATS, "/".join(run3), "nixl runs of 12-01")
    docs = [_recorded(*run) for run in NIXL_REPEATS]
    first = calibrate.run(("nixl",), results=_write(tmp_path / "a", *NIXL_REPEATS[0], docs[0]))
    predicted = first["rows"][0]["predicted_s"]
    outcomes = []
    for k, third_error in (("near", -0.09), ("far", -0.45)):
        root = tmp_path / k
        third = copy.deepcopy(docs[0])
        _rec(third, "nixl", 1)["warm_median_s"] = predicted / (1 + third_error)
        for (folder, name), doc in zip(NIXL_REPEATS + (run3,), docs + [third]):
            _write(root, folder, name, doc)
        _write(root, *NIXL_RUN, _recorded(*NIXL_RUN))
        res = calibrate.run(("nixl",), results=str(root))
        (g,) = res["repeats"]
        assert len(g["errors"]) == 3 and res["cases"] == 4 and res["case_count"] == 2
        assert g["median_error"] == pytest.approx(sorted(g["errors"])[1])
        (alone,) = [r for r in res["rows"] if r["repeat_of"] is None]
        assert res["case_within_goal"] == alone["within_goal"] + g["within_goal"]
        assert res["within_goal"] == sum(r["within_goal"] for r in res["rows"])
        text = calibrate.format_text(res)
        assert (f"{res['case_within_goal']} of 2 within +-25 %") in text
        assert f"| {g['median_error'] * 100:+.0f} %" in text
        outcomes.append((g["within_goal"], res["misses"]))
    (near_ok, near_misses), (far_ok, far_misses) = outcomes
    assert near_ok and not far_ok                # the slow run is outvoted only by a close one
    assert near_misses >= 1 and far_misses == near_misses + 1   # rows: every run's miss


S16_CPU = ("cpu-2026-12-04-s16", "r2.json")
S16_D2H = ("gpu-h200-2026-12-04-s16", "shm_d2h.json")


def test_shared_memory_rows_take_their_runs_all_core_memcpy(tmp_path):
    """Session 16's CPU run: shm-shared and shm-push are modelled (shared read, push), and
    the @readme row as its method. host_mem is the run's memcpy over both cores (paired with
    its @readme steps): halving that rate makes the push, paced by the host's memory, nearly
    twice as slow; the one-thread memcpy paired with each step still sets device_mem, and
    the run's own one-thread memcpy the @readme row's."""
    doc = _recorded(*S16_CPU)
    before = calibrate.run(("cpu",), results=_write(tmp_path / "a", *S16_CPU, doc))
    assert {r["case"] for r in before["rows"]} == {
        f"CPU synthetic-1GiB {m} R=2 (12-04 s16)"
        for m in ("shm", "shm-shared", "shm-push", "shm-push@readme")}
    readme = _find(before["rows"], "CPU synthetic-1GiB shm-push@readme R=2 (12-04 s16)")
    assert "device_mem 10.6 GB/s (memcpy, own run)" in readme["links_from"]
    case = "CPU synthetic-1GiB shm-push R=2 (12-04 s16)"
    b = _find(before["rows"], case)
    assert "shm push" in b["limited_by"]
    assert "host_mem" in b["links_from"] and "memcpy@all-cores, own run" in b["links_from"]
    assert "memcpy, paired" in b["links_from"]
    slow = copy.deepcopy(doc)
    _rec(slow, "shm-push@readme", 2)["paired"]["warm_median_s"] *= 2
    after = calibrate.run(("cpu",), results=_write(tmp_path / "b", *S16_CPU, slow))
    a = _find(after["rows"], case)
    assert 1.8 * b["predicted_s"] < a["predicted_s"] < 2.1 * b["predicted_s"]


def test_a_readme_row_is_its_methods_case_and_its_paired_copy_is_not_one_threads():
    """A method's @readme row is predicted as the method (torch's default threads do not
    enter the modelled paths: every landing is a memmove or a gloo op); the memcpy the bench
    paired with it ran on torch's default threads too, so it does not set device_mem (one
    thread's copy): the run's own memcpy record does, where the plain method's paired one
    would."""
    assert calibrate._cpu_method("shm@readme") == calibrate._CPU_METHODS["shm"]
    assert calibrate._cpu_method("collective@readme") == calibrate._CPU_METHODS["collective"]
    assert calibrate._cpu_method("nixl@readme") is None
    gb = 10 ** 9
    lim = {"memcpy": [{"receivers": 1, "bytes": gb, "warm_median_s": 0.1}]}
    paired = {"method": "memcpy", "warm_median_s": 0.05}
    sets, where = calibrate.run_links({"method": "shm", "receivers": 1, "bytes": gb,
                                       "paired": paired}, lim)
    assert sets["links.device_mem.GBps"] == pytest.approx(20.0)
    assert where["links.device_mem.GBps"] == "memcpy, paired"
    sets, where = calibrate.run_links({"method": "shm@readme", "receivers": 1, "bytes": gb,
                                       "paired": paired}, lim)
    assert sets["links.device_mem.GBps"] == pytest.approx(10.0)
    assert where["links.device_mem.GBps"] == "memcpy, own run"
    assert sets["ring.direct_GBps"] == pytest.approx(10.0)


T0_RUN = ("cpu-2026-12-04", "readme.json")


def test_a_threads_0_run_is_read_as_its_readme_rows_and_a_copy_run_not_at_all(tmp_path):
    """A run with ``--threads 0`` (torch's default threads everywhere, ``receive_into``) is
    the bench's @readme rows: each method is predicted as its @readme row, where the same
    numbers read as a one-thread run are not; its memcpy ran on every core, so it sets
    host_mem (a ceiling), never device_mem (one thread's copy), and doubling its time halves
    host_mem. The same run recorded as ``--consume copy`` (receive_weights + copy_) gives
    no row."""
    doc = _recorded(*T0_RUN)
    assert doc["config"]["threads"] == 0 and doc["config"]["consume"] == "into"
    rows = calibrate.run(("cpu",), results=_write(tmp_path / "a", *T0_RUN, doc))["rows"]
    assert {r["case"] for r in rows} == {f"CPU synthetic-1GiB {m}@readme R=1 (12-04, "
                                         f"--threads 0)" for m in ("shm", "collective")}
    shm = _find(rows, "CPU synthetic-1GiB shm@readme R=1 (12-04, --threads 0)")
    assert "memcpy@all-cores, own run" in shm["links_from"]
    assert "device_mem" not in shm["links_from"]
    tuned = copy.deepcopy(doc)          # the same numbers as a one-thread run's
    tuned["config"]["threads"] = 1
    rows1 = calibrate.run(("cpu",), results=_write(tmp_path / "b", *T0_RUN, tuned))["rows"]
    one = _find(rows1, "CPU synthetic-1GiB shm R=1 (12-04, --threads 0)")
    assert "device_mem" in one["links_from"] and "memcpy@all-cores" not in one["links_from"]
    slow = copy.deepcopy(doc)
    for r in slow["results"]:
        if r["method"] == "memcpy":
            r["warm_median_s"] *= 2
        if (r.get("paired") or {}).get("method") == "memcpy":
            r["paired"]["warm_median_s"] *= 2
    rows2 = calibrate.run(("cpu",), results=_write(tmp_path / "c", *T0_RUN, slow))["rows"]
    host = [float(re.search(r"host_mem ([0-9.]+) GB/s", r["links_from"]).group(1))
            for r in (shm, _find(rows2, shm["case"]))]
    assert host[1] == pytest.approx(host[0] / 2, rel=0.01)
    copied = copy.deepcopy(doc)
    copied["config"]["consume"] = "copy"
    assert calibrate.run(("cpu",), results=_write(tmp_path / "d", *T0_RUN, copied))["rows"] \
        == []


def test_run_links_ceiling_is_the_most_of_its_limits():
    """host_mem: the higher of memcpy-parallel (R processes) and the memcpy over all cores."""
    gb = 10 ** 9
    rec = {"method": "shm", "receivers": 1, "bytes": gb, "paired": None}
    two = [{"receivers": 2, "bytes": gb, "warm_median_s": 0.1}]
    lim = {"memcpy-parallel": two, calibrate._host_key("memcpy-parallel"): two,
           "memcpy@all-cores": [{"receivers": 1, "bytes": gb, "warm_median_s": 0.2}]}
    sets, where = calibrate.run_links(rec, lim)
    assert sets["links.host_mem.GBps"] == pytest.approx(20.0)
    assert where["links.host_mem.GBps"] == \
        "memcpy-parallel, median of the run's 1 records of 2+ processes"
    lim["memcpy@all-cores"][0]["warm_median_s"] = 0.025
    sets, where = calibrate.run_links(rec, lim)
    assert sets["links.host_mem.GBps"] == pytest.approx(40.0)
    assert where["links.host_mem.GBps"].startswith("memcpy@all-cores")


def test_host_mem_is_the_median_of_every_multi_process_copy_of_the_run():
    """memcpy-parallel sets host_mem, a property of the host: the median over the run's
    records of 2+ processes of every workload (`_limits_by_case` pools them), so one
    workload's lucky record does not set that workload's host alone; R=1 records (one
    process) are not among them, and a run with none of 2+ leaves host_mem to the preset
    (one process copying alone is one core's rate, not the node's copies together: the
    code of 11-29's runs again with R=1 alone had shm-buckets, paced by host_mem, at
    +27..+64 % with it)."""
    gb = 10 ** 9

    def mp(workload, receivers, seconds):
        return {"status": "ok", "method": "memcpy-parallel", "workload": workload,
                "dtype": "bfloat16", "receivers": receivers, "bytes": gb,
                "warm_median_s": seconds}
    # R x 1 GB each in s: a R=4 outlier of 40 GB/s; the others 10 (R=1), 12, 13, 14, 15
    results = [mp("a", 1, 0.1), mp("a", 2, 2 / 12), mp("a", 4, 0.1),
               mp("b", 1, 0.1), mp("b", 2, 2 / 13), mp("b", 4, 4 / 14), mp("c", 2, 2 / 15)]
    limits = calibrate._limits_by_case(results)
    rec = {"method": "shm-buckets", "receivers": 2, "bytes": gb, "paired": None}
    for workload in ("a", "b", "c"):
        sets, where = calibrate.run_links(rec, limits[(workload, "bfloat16")])
        assert sets["links.host_mem.GBps"] == pytest.approx(14.0)     # median of 12..40
        assert "median of the run's 5 records" in where["links.host_mem.GBps"]
    # a run whose only record is one process: none (the preset's)
    sets, _ = calibrate.run_links(rec, calibrate._limits_by_case(results[:1])[("a", "bfloat16")])
    assert "links.host_mem.GBps" not in sets


def test_gpu_trainer_into_a_cpu_receiver_rows_use_the_runs_d2h(tmp_path):
    """shm_d2h (GPU trainer -> shm -> CPU receiver): the pinned ring (into) and the push
    (shared) are rows, views is not; d2h and host_mem come from the run's own pinned D2H
    copy and host copy. A D2H twice as slow makes the push, paced by it, twice as slow."""
    doc = _recorded(*S16_D2H)
    before = calibrate.run(("shm-d2h",), results=_write(tmp_path / "a", *S16_D2H, doc))
    cases = sorted(r["case"] for r in before["rows"])
    assert len(cases) == 2 and "into (ring, pinned" in cases[0] and "shared (push" in cases[1]
    push = next(r for r in before["rows"] if "shared (push" in r["case"])
    assert "d2h" in push["limited_by"] and "pinned D2H copy, own run" in push["links_from"]
    assert "receiver's copy over 16 threads" in push["links_from"]
    slow = copy.deepcopy(doc)
    slow["trainer"]["d2h_pinned_ms"] *= 2
    after = calibrate.run(("shm-d2h",), results=_write(tmp_path / "b", *S16_D2H, slow))
    a = next(r for r in after["rows"] if "shared (push" in r["case"])
    assert 1.9 * push["predicted_s"] < a["predicted_s"] < 2.0 * push["predicted_s"]


def test_cuda_ipc_zero_copy_rows_are_the_code_whose_host_costs_were_timed():
    """Zero-copy runs are the ring strategy with shared="trainer", from the code of 12-04 on
    only (older code's host costs were never timed): each moves the bytes once, so on an
    H100 its prediction sits near the run's own flat copy; on the H200, whose copies are
    faster and whose host costs (the H200 preset's, its own timelines since session 33) are
    higher, the trainer's host work sets its pace (9.2-10.0 ms measured against a 7.5 ms
    flat copy). A first announcement of the whole model (16 GiB) waits for all 291 tensors'
    host time before the first copy."""
    rows = [r for r in _h200_run()["rows"] if "zero-copy" in r["case"]]
    assert rows and not [r for r in rows if "2026-11-29" in r["case"] or "2026-12-01" in
                         r["case"]]
    for r in rows:
        paced = "device_mem" if r["case"].startswith("H100") else "software of trainer"
        assert paced in r["limited_by"], r
        assert r["within_goal"], r
    s23 = [r for r in rows if r["case"].endswith("2026-12-05-s23)")]
    assert len(s23) == 6 and len([r for r in rows if r["case"].endswith("-s24)")]) == 2
    flat = 16060522496 / 10.6395e-3          # that run's flat D2D copy, bytes/s
    for r in s23:
        assert 1.0 < r["predicted_s"] * flat / 16060522496 < 1.06, r
    # session 24's pushes: the trainer's copy into each receiver, priced with the run's
    # own flat copy; the receivers' pass over the pushed tensors follows the copies
    pushes = [r for r in _h200_run()["rows"] if "cuda_ipc push" in r["case"]]
    assert len(pushes) == 2 and all("flat D2D copy, own run" in r["links_from"] for r in pushes)
    assert all("device_mem" in r["limited_by"] for r in pushes)
    whole = next(r for r in rows if r["case"].startswith("H100 cuda_ipc zero-copy 16384 MiB"))
    first = next(r for r in rows if r["case"].startswith("H100 cuda_ipc zero-copy 1024 MiB")
                 and r["case"].endswith("2026-12-05)"))
    assert whole["predicted_s"] - first["predicted_s"] > 4e-3     # ~290 x 19 us


#: The H100 ring rows of session 23 (call 1's polled runs), in both ring tests below.
S23_RINGS = [f"H100 cuda_ipc ring 4096 MiB (event, receive_into, fill programs, {settled}round "
             f"{k}, 2026-12-05-s23)" for k in (1, 2, 3) for settled in ("", "settled 200 ms, ")]


def test_the_h100_run_of_12_05_is_calibrated_with_its_own_rates():
    """The H100 host's runs (cuda_ipc ring with receive_into, shm D2H) are rows named after
    their GPU, each priced with the run's own flat D2D / pinned D2H / host copy."""
    rows = calibrate.run(("h200", "shm-d2h"))["rows"]
    h100 = [r for r in rows if r["case"].startswith("H100 ") and "zero-copy" not in r["case"]
            and "cuda_ipc push" not in r["case"]
            and not r["source"].startswith((calibrate.S26_RING, calibrate.S29_RING + "/",
                                            calibrate.S29_NOW, *calibrate._S30_LAYOUT,
                                            calibrate.S34_DELTA, calibrate.S35_DELTA))]
    assert sorted(r["case"] for r in h100) == sorted([
        "H100 cuda_ipc ring 2048 MiB (event, receive_into, 2026-12-05)",
        "H100 cuda_ipc ring 4096 MiB (event, receive_into, 2026-12-05)",
        "H100 cuda_ipc ring 4096 MiB (event, receive_into, 2026-12-05-s20)",
        *(f"H100 cuda_ipc ring 4096 MiB (event, receive_into, {k} run, 2026-12-05-s20)"
          for k in ("span", "replay")),
        *S23_RINGS,
        *(f"H100 cuda_ipc ring {size} MiB (event, receive_into{fill}{settled}, call3 round {k}, "
          "2026-12-05-s21)" for k in (1, 2) for settled in ("", ", settled 200 ms")
          for size, fill in ((4096, ""), (2048, ", fill programs"), (4096, ", fill programs"))),
        "H100 host GPU trainer -> shm -> CPU receiver, into (ring, pinned, 2026-12-05)",
        "H100 host GPU trainer -> shm -> CPU receiver, shared (push, 2026-12-05)"])
    for r in h100:
        assert "own run" in r["links_from"], r
    assert any(r["case"].startswith("H200 cuda_ipc ring") for r in rows)


def test_ring_rows_are_priced_with_their_own_codes_host_costs():
    """Runs of the code with replayed copy programs (12-05, H100 and H200) are checked with
    that code's host costs (its own timeline), which the GPU presets carry now; runs of the
    code of 11-29 keep that code's (RING_SOFTWARE_1129, the presets' until session 23).
    Each case is then within +-25 %."""
    rows = [r for r in _h200_run()["rows"] if r["links"] == "run"]
    later = [r for r in rows if "2026-12-05" in r["case"] and "zero-copy" not in r["case"]]
    assert not [r for r in rows if "cuda_ipc push" in r["case"] and "2026-12-06" not in r["case"]]
    earlier = [r for r in rows if not any(d in r["case"] for d in
                                          ("2026-12-05", "2026-12-06", "2026-12-07"))]
    assert sorted(r["case"] for r in later) == sorted([
        "H100 cuda_ipc ring 2048 MiB (event, receive_into, 2026-12-05)",
        "H100 cuda_ipc ring 4096 MiB (event, receive_into, 2026-12-05)",
        "H100 cuda_ipc ring 4096 MiB (event, receive_into, 2026-12-05-s20)",
        *(f"H100 cuda_ipc ring 4096 MiB (event, receive_into, {k} run, 2026-12-05-s20)"
          for k in ("span", "replay")),
        *S23_RINGS,
        *(f"{gpu} cuda_ipc ring {size} MiB (event, receive_into{fill}{settled}, {call} round "
          f"{k}, 2026-12-05-s21)" for gpu, call, sizes in (("H100", "call3", (4096, 2048)),
                                                            ("H200", "call4", (4096,)))
          for k in (1, 2) for settled in ("", ", settled 200 ms")
          for size, fill in ((4096, ""), *((z, ", fill programs") for z in sizes))),
        "H200 cuda_ipc ring 2048 MiB (event, receive_into, 2026-12-05)",
        "H200 cuda_ipc ring 4096 MiB (event, receive_into, 2026-12-05)",
        "H200 cuda_ipc ring 4096 MiB (event, receive_into, 2026-12-05-s21)",
        "H200 cuda_ipc ring 4096 MiB (event, receive_into, fill programs, 2026-12-05-s21)",
        "H200 cuda_ipc ring 4096 MiB (event, receive_into, fill programs, settled 200 ms, "
        "2026-12-05-s21)",
        "H200 cuda_ipc ring 4096 MiB (event, receive_into, settled 200 ms, 2026-12-05-s21)",
        *(f"H200 cuda_ipc ring 4096 MiB (event, receive_into{b}, round {k}, "
          "2026-12-05-branches)" for k in (1, 2)
          for b in ("", ", 2 graph branches", ", 4 graph branches"))])
    groups = {g["group"]: g for g in _h200_run()["repeats"]}
    legacy = calibrate.RING_SOFTWARE_1129["software.tensor_us"]
    assert legacy != load_links("h200-8gpu-400g").sw("tensor_us") * 1e6
    assert earlier and all(f"code of 11-29 (tensor_us {legacy:g}" in r["links_from"]
                           for r in earlier)
    h100, h200 = load_links("h100-8gpu-400g"), load_links("h200-8gpu-400g")
    for r in later:       # each host's own timelines of that code
        t, h = (15.5, 219) if r["case"].startswith("H100") else (23.8, 117)
        assert f"software tensor_us {t:g} " in r["links_from"], r
        assert f"software handoff_us {h:g} " in r["links_from"], r
        # each case within: a row alone, or its group of repeats (by the median)
        assert groups[r["repeat_of"]]["within_goal"] if r.get("repeat_of") in groups \
            else r["within_goal"], r
    # the presets carry today's costs, each read off its own host's timelines; the old
    # codes' fitted bucket cost includes their handoff
    assert (h100.sw("tensor_us"), h100.sw("bucket_us")) == pytest.approx((15.5e-6, 297.7e-6))
    assert (h200.sw("tensor_us"), h200.sw("bucket_us")) == pytest.approx((23.8e-6, 490.3e-6))
    assert h100.sw("handoff_us") == pytest.approx(218.8e-6)
    assert h200.sw("handoff_us") == pytest.approx(116.6e-6)
    assert (h100.software["pack_wait_x"], h200.software["pack_wait_x"]) == \
        pytest.approx((1.59, 1.02))
    assert not [r for r in earlier if "handoff" in r["links_from"]]
    # the later code's ring is limited by the GPU's memory, the earlier code's by its host
    assert all(r["limited_by"].startswith("deliver: device_mem") for r in later)
    assert all("software" in r["limited_by"] for r in earlier)


NIXL_TP = "cpu-nixl-tp-2026-12-04"


def _nixl_tp_copy(root, raw_factor: float = 1.0) -> str:
    """The recorded 2 -> 2 TP-2 nixl runs in ``root``, every raw READ ``raw_factor`` x as
    slow (the readme_copy run too: it must not become a row)."""
    src = os.path.join(calibrate.results_dir(), NIXL_TP)
    (root / NIXL_TP).mkdir(parents=True)
    for name in os.listdir(src):
        with open(os.path.join(src, name)) as f:
            text = f.read()
        if name.endswith(".txt") and text.startswith("{"):
            rec = json.loads(text.splitlines()[0])
            rec["raw_read"]["warm_s"] *= raw_factor
            text = json.dumps(rec) + "\n"
        (root / NIXL_TP / name).write_text(text)
    return str(root)


def test_nixl_tp_runs_are_read_with_their_cuts_and_their_raw_read(tmp_path):
    """The CPU nixl runs of 2 trainer ranks into 2 TP-2 workers (cpu-nixl-tp-2026-12-04)
    are rows of their own group: box-by-box staging on (12 READs per worker recorded) and
    off (WEIGHTSYNC_NIXL_CUT=0, 8,202), each compiled as the run staged it; the README-way
    copy consumer is not modelled. The cross-process link is the run's own raw READ: a
    raw READ 3 x as slow gives a prediction over 2 x as slow."""
    res = calibrate.run(("nixl-tp",), results=_nixl_tp_copy(tmp_path / "a"))
    rows = {r["case"].rpartition("/")[2].rstrip(")"): r for r in res["rows"]}
    assert set(rows) == {"nixl_multi_2to2_cut_on.txt", "nixl_multi_2to2_cut_off.txt",
                         "nixl_multi_2to2_into.txt"}
    on, off = rows["nixl_multi_2to2_cut_on.txt"], rows["nixl_multi_2to2_cut_off.txt"]
    assert on["reads_per_worker"]["measured"] == [12, 12]
    assert max(on["reads_per_worker"]["predicted"]) <= 12
    assert off["reads_per_worker"]["measured"] == [8202, 8202]
    assert min(off["reads_per_worker"]["predicted"]) > 8000
    for r in res["rows"]:
        assert "raw NIXL READ" in r["links_from"] and "intra_in" in r["limited_by"]
        assert r["within_goal"] == (abs(r["error"]) <= calibrate.GOAL)
    slow = calibrate.run(("nixl-tp",), results=_nixl_tp_copy(tmp_path / "b", 3.0))
    for b, a in zip(res["rows"], slow["rows"]):
        assert a["case"] == b["case"] and a["predicted_s"] > 2 * b["predicted_s"]


def test_the_staging_default_run_of_12_03_is_a_nixl_row():
    """12-03's run before the auto default (pipelined, staging; code that still exists:
    WEIGHTSYNC_NIXL_SERVE=staging) is read beside that day's auto run (both shown apart:
    the bench's raw agent spun beside them)."""
    res = calibrate.run(("nixl",))
    (row,) = [r for r in res["spun_rows"]
              if "bench_1g_staging_default_before.json" in r["case"]]
    assert "pipelined, staging" in row["case"] and "nixl-raw, paired" in row["links_from"]
    assert row["measured_s"] == pytest.approx(0.6274020990003919)


SPUN_FREE = ("cpu-nixl-2026-12-06-s26", "staging_1.json")


def test_runs_with_the_benchs_spinning_raw_agent_are_shown_apart_not_counted(tmp_path):
    """A nixl run of SPUN_RAW (the bench's paired raw agent spun a core beside the sync)
    is predicted and printed with its error, apart from the count; the same recorded
    numbers under a run made after the fix are counted. The real calibration keeps every
    SPUN_RAW run apart and counts the others."""
    doc = _recorded(*NIXL_RUN)
    assert "/".join(NIXL_RUN) in calibrate.SPUN_RAW
    assert "/".join(SPUN_FREE) not in calibrate.SPUN_RAW
    root = tmp_path / "a"
    _write(root, *NIXL_RUN, doc)
    _write(root, *SPUN_FREE, doc)
    res = calibrate.run(("nixl",), results=str(root))
    (row,), (spun,) = res["rows"], res["spun_rows"]
    assert SPUN_FREE[0] in row["source"] and NIXL_RUN[0] in spun["source"]
    assert len(res["preset_rows"]) == 1 and SPUN_FREE[0] in res["preset_rows"][0]["source"]
    assert spun["predicted_s"] == pytest.approx(row["predicted_s"])
    assert res["cases"] == 1 and res["case_count"] == 1
    assert res["spun_within_goal"] == spun["within_goal"]
    text, md = calibrate.format_text(res), calibrate.format_markdown(res)
    both = res["within_goal"] + res["spun_within_goal"]
    for out in (text, md):
        assert "spinning raw agent" in out and spun["case"] in out
        assert f"(with them: {both} of 2 rows)" in out
    real = calibrate.run(("nixl",))
    for r in real["rows"] + real["preset_rows"]:
        assert r["source"].split(" ")[0] not in calibrate.SPUN_RAW
    assert {r["source"].split(" ")[0] for r in real["spun_rows"]} == \
        {k for k in calibrate.SPUN_RAW
         if os.path.exists(os.path.join(calibrate.results_dir(), k))}


def test_the_h100_runs_of_two_ring_codes_are_a_group_per_code_and_case():
    """Session 26 ran the cuda_ipc ring of 11-29's and of 12-01's code alternating on one
    H100 (calibrate.S26_RING): each code's runs of one configuration are one group of
    repeats, never mixed with the other code's, priced with that code's H100 host costs
    (calibrate.ring_costs_old, from its own timelines there)."""
    res = _h200_run()
    when = calibrate.S26_RING.split("-", 2)[2]            # 2026-12-06-s26
    groups = [g for g in res["repeats"] if f"{when})" in g["group"]]
    if not groups:
        pytest.skip("session 26's H100 runs are not in this checkout")
    assert len(groups) == 6                   # 2 codes x (event 1 GiB, event 2 GiB, host 1 GiB)
    for g in groups:
        (code,) = [c for c in calibrate.S26_CODES.values() if f"code of {c}," in g["group"]]
        assert len(g["cases"]) >= 4 and all(f"code of {code}," in c for c in g["cases"])
    rows = [r for r in res["rows"] if calibrate.S26_RING in r["source"]]
    assert rows
    for r in rows:
        costs, _ = calibrate.ring_costs_old(calibrate.ring_code_of(r))
        t, b = (costs[f"software.{k}_us"] for k in ("tensor", "bucket"))
        assert f"tensor_us {t:g}, bucket_us {b:g}" in r["links_from"], r


def test_more_cpu_runs_are_predicted_with_their_own_codes_settings(tmp_path):
    """The CPU runs of CPU_RUNS_MORE carry what their code set: the same recorded numbers
    under session 22's "after" name are laid out in full buckets (no ring stalls: a faster
    prediction) and under its "before" name the old way; under session 21's name a
    collective sends direct tensors from 8 MiB, under session 17's from 16 MiB; session
    14's run under WEIGHTSYNC_SHM_DIRECT_MIN=1 MiB reads the k/v projections directly."""
    s22 = _recorded("cpu-2026-12-05-s22", "bench-r1-before-r1.json")
    root = tmp_path / "a"
    _write(root, "cpu-2026-12-05-s22", "bench-r1-before-r1.json", s22)
    _write(root, "cpu-2026-12-05-s22", "bench-r1-after-r1.json", s22)
    rows = calibrate.run(("cpu",), results=str(root))["rows"]
    (before,) = [r for r in rows if "s22 before" in r["case"]]
    (after,) = [r for r in rows if "s22 after" in r["case"]]
    assert after["measured_s"] == before["measured_s"]
    assert after["predicted_s"] < before["predicted_s"]
    stall = [float(re.search(r"uneven size \(\+([0-9.]+) ms\)", r["limited_by"]).group(1))
             for r in (before, after)]
    assert stall[1] < 0.5 * stall[0]           # full buckets: far fewer uneven ones

    s21 = _recorded("cpu-2026-12-05-s21", "bench_collective.json")
    root = tmp_path / "b"
    _write(root, "cpu-2026-12-05-s21", "bench_collective.json", s21)
    _write(root, "cpu-2026-12-05-s17", "before-r1.json", s21)
    rows = calibrate.run(("cpu",), results=str(root))["rows"]
    case = "CPU hf-qwen2-0.5b collective R=1"
    (at8,) = [r for r in rows if r["case"].startswith(case) and "s21" in r["case"]]
    (at16,) = [r for r in rows if r["case"].startswith(case) and "s17" in r["case"]]
    assert at8["predicted_s"] != pytest.approx(at16["predicted_s"], rel=0.01)

    s14 = _recorded("cpu-2026-12-04-s14", "tuned.json")
    root = tmp_path / "c"
    _write(root, "cpu-2026-12-04-s14", "tuned.json", s14)
    _write(root, "cpu-2026-12-04-s14", "tuned_direct1m.json", s14)
    rows = calibrate.run(("cpu",), results=str(root))["rows"]
    (auto,) = [r for r in rows if r["case"].endswith("(12-04 s14)")]
    (one,) = [r for r in rows if "direct from 1 MiB" in r["case"]]
    assert one["predicted_s"] != pytest.approx(auto["predicted_s"], rel=0.01)


def test_session_14s_code_run_again_repeats_each_of_its_two_commands_apart():
    """Session 27 ran session 14's code again with its two ``tuned`` commands (by default;
    direct reads from 1 MiB): each command's runs are one group of repeats with 12-04's run
    of it, never mixed with the other command's, and the 1 MiB runs read directly from 1 MiB."""
    if not os.path.isdir(os.path.join(calibrate.results_dir(), "cpu-2026-12-06-s27-s14code")):
        pytest.skip("session 27's runs of session 14's code are not in this checkout")
    res = calibrate.run(("cpu",))
    groups = {g["group"]: g for g in res["repeats"] if "code of 12-04 s14" in g["group"]}
    assert len(groups) == 2, list(groups)
    for g in groups.values():
        direct = g["group"].endswith("tuned_direct1m]")
        assert len(g["cases"]) == 4
        assert all(("direct from 1 MiB" in c) == direct for c in g["cases"]), g["cases"]
    again = [r for r in res["rows"] if "s14 code, 12-06 s27" in r["case"]]
    assert len(again) == 6
    assert sum("direct from 1 MiB" in r["case"] for r in again) == 3


def test_the_12_03_code_run_again_makes_each_of_its_cases_a_group_with_12_03s_run():
    """Session 27 ran 12-03's code (4a44e05) again twice: every case of 12-03's run that
    those runs measured too is one group of three repeats (12-03's run and the two)."""
    if not os.path.isdir(os.path.join(calibrate.results_dir(), "cpu-2026-12-06-s27-1203code")):
        pytest.skip("session 27's runs of 12-03's code are not in this checkout")
    res = calibrate.run(("cpu",))
    groups = [g for g in res["repeats"] if g["group"].endswith("[CPU runs of the code of 12-03]")]
    # 0.25 GiB and Qwen2, shm / shm-buckets / shm-direct, R = 1, 2, 4
    assert len(groups) == 18, [g["group"] for g in groups]
    for g in groups:
        assert len(g["cases"]) == 3
        assert sum(c.endswith("(12-03)") for c in g["cases"]) == 1, g["cases"]


def test_runs_whose_trainer_waited_for_each_direct_read_are_priced_with_window_1(monkeypatch):
    """The code before the direct window (4978907) and runs under
    WEIGHTSYNC_SHM_DIRECT_WINDOW=1 waited for each direct read: those runs, and only those,
    are predicted with links.ring.direct_window 1, which makes their direct rows slower and
    leaves every other row as it was; a run of the window's own day at 2 is not among them."""
    def waits(knob):
        return knob.get("links", {}).get("direct_window") == 1

    def unwaited(knob):     # the same run as if its trainer had not waited
        links = {k: v for k, v in knob.get("links", {}).items() if k != "direct_window"}
        return {**{k: v for k, v in knob.items() if k != "wait_from"}, "links": links}

    waited = {f"{f}/{n}" for f, n, _, *knob in calibrate.CPU_RUNS if knob and waits(knob[0])}
    assert {"cpu-2026-11-29/bench.json", "cpu-1g-2026-12-02/into.json",
            "cpu-shm-window-2026-12-03/window1.json", "cpu-lasting-2026-12-03/bench_1g.json",
            "cpu-2026-12-06-s27-lastingcode/bench_1g_run1.json",
            "cpu-2026-12-06-s25-1129code/bench_run1.json",
            "cpu-shm-window-2026-12-06-s28/window1_r1.json"} <= waited
    assert not waited & {"cpu-shm-window-2026-12-03/window2.json",
                         "cpu-calib-2026-12-03/bench.json",
                         "cpu-shm-window-2026-12-06-s28/window2_r1.json",
                         "cpu-shm-window-2026-12-03/collective_window1.json"}
    res = calibrate.run(("cpu",))
    monkeypatch.setattr(calibrate, "CPU_RUNS", tuple(
        (*r[:3], unwaited(r[3])) if len(r) > 3 and waits(r[3]) else r
        for r in calibrate.CPU_RUNS))
    before = {r["case"]: r["predicted_s"] for r in calibrate.run(("cpu",))["rows"]}
    moved = {r["case"] for r in res["rows"] if r["predicted_s"] != before[r["case"]]}
    assert moved, "no row is priced with the window"
    for r in res["rows"]:
        if r["case"] in moved:
            assert r["predicted_s"] > before[r["case"]]
    labels = {label for f, n, label, *_ in calibrate.CPU_RUNS if f"{f}/{n}" in waited}
    assert all(any(f"({label})" in c for label in labels) for c in moved)
    assert any("s28, direct window 1" in c for c in moved)
    assert not any("direct window 2" in c for c in moved)


def test_session_27s_run_again_makes_each_of_its_cases_a_group_with_its_first_run():
    """Session 28 ran session 27's code (f3939a7) with session 27's command twice more:
    every case of that run is one group of three repeats, priced with that run's settings
    (full buckets, collective direct from 8 MiB)."""
    if not os.path.isdir(os.path.join(calibrate.results_dir(), "cpu-2026-12-06-s28-s27code")):
        pytest.skip("session 28's runs of session 27's code are not in this checkout")
    res = calibrate.run(("cpu",))
    groups = [g for g in res["repeats"]
              if g["group"].endswith("[CPU runs of the code of f3939a7 (12-06 s27)]")]
    # 0.25 GiB, 1 GiB and Qwen2; shm / shm-buckets / shm-direct / collective; R = 1, 2, 4
    assert len(groups) == 36, [g["group"] for g in groups]
    for g in groups:
        assert len(g["cases"]) == 3
        assert sum(c.endswith("(12-06 s27)") for c in g["cases"]) == 1, g["cases"]
    assert sum("s27 code, 12-06 s28 run" in r["case"] for r in res["rows"]) == 72
    knobs = {f"{f}/{n}": k[0] for f, n, _, *k in calibrate.CPU_RUNS if k}
    assert knobs["cpu-2026-12-06-s28-s27code/bench_run1.json"] == \
        knobs["cpu-2026-12-06-s27/bench.json"] == \
        {"scenario": {"fill_open": True, "collective_direct_min": 8 << 20}}


def test_the_11_29_h200_runs_are_one_group_per_ring_case():
    """The 11-29 H200 folder holds the reported run and runs 6, 7 and 8, whose code differed
    in the zero-copy half only: each ring configuration they timed is one group of repeats
    (four runs for the 1 GiB and 4 GiB event rings, which run 8 timed too, else three), and
    none of their zero-copy rows is a row."""
    res = _h200_run()
    groups = {g["group"]: g for g in res["repeats"]
              if g["group"].endswith("[H200 runs of the code of 11-29]")}
    assert len(groups) == 7, list(groups)      # event 256 MiB .. 4 GiB, host 1 and 4 GiB
    for key, g in groups.items():
        runs = 4 if ("1024 MiB (event" in key or "4096 MiB (event" in key) else 3
        assert len(g["cases"]) == runs, g["cases"]
        assert sum(", run " in c for c in g["cases"]) == runs - 1
    rows = [r for r in res["rows"] if r["source"].startswith("gpu-h200-2026-11-29/")]
    assert len(rows) == 7 + 7 + 7 + 2
    assert not [r for r in rows if "zero-copy" in r["case"]]
    # the single 12-01 run of other code is not one of them
    assert not [g for g in groups.values() if any("2026-12-01" in c for c in g["cases"])]


def test_the_11_29_ring_costs_are_the_least_squares_fit_to_that_codes_runs():
    """RING_SOFTWARE_1129 (the old ring codes' costs on an H200 host) minimises the squared
    log error over the H200 runs of the ring code of 11-29 (fit_ring_1129.py of session 30
    searched a 1 us x 10 us grid; rerun in session 33): each neighbour on that grid does
    worse, and so do session 29's fit (59 us, 1060 us) and the costs read off run 5's
    timeline before (70 us, 930 us).
    The fit has 33 rows (the four runs of 11-29, 23, and session 33's two on a second H200
    host, 10); the code of 12-01's H200 rows (3 of 12-01, 10 of session 33) and both codes'
    H100 rows (priced with their H100 timelines' costs) are not in it."""
    t = calibrate.RING_SOFTWARE_1129["software.tensor_us"]
    b = calibrate.RING_SOFTWARE_1129["software.bucket_us"]
    best, rows = calibrate.ring_1129_loss(t, b)
    fit = [r for r in rows if calibrate.ring_code_of(r) == "11-29" and r["case"][:5] == "H200 "]
    if len(fit) < 33:
        pytest.skip("not every run of the 11-29 ring code is in this checkout")
    assert len(fit) == 33
    assert len(rows) == 33 + 3 + 10 and all(r["case"].startswith("H200 ") for r in rows)
    for dt, db in ((1, 0), (-1, 0), (0, 10), (0, -10)):
        assert calibrate.ring_1129_loss(t + dt, b + db)[0] > best, (dt, db)
    assert calibrate.ring_1129_loss(59, 1060)[0] > best
    assert calibrate.ring_1129_loss(70, 930)[0] > best


def test_session_29s_h100_runs_are_groups_and_today_s_only_by_receive_into():
    """Session 29's H100 runs: the two old ring codes at 256 MiB, 512 MiB and 4 GiB (event)
    and 4 GiB (host), each code's two rounds one group per case, priced with that code's
    H100 timeline costs (calibrate.ring_costs_old; not fitted to any run); today's ring
    (s29b) read only where consumed with receive_into (its diagnostic rows have no path in
    the model), priced with today's."""
    res = _h200_run()
    def of(rset: str) -> list[dict]:
        return [g for g in res["repeats"] if g["group"].endswith(f"[{rset}]")]
    old = of("H100 runs of 12-06 s29 on one machine")
    now = of("H100 runs of 12-06 s29 of today's ring")
    if not old or not now:
        pytest.skip("session 29's H100 runs are not in this checkout")
    assert len(old) == 8 and all(len(g["cases"]) == 2 for g in old)
    assert len(now) == 5 and all(len(g["cases"]) == 2 for g in now)
    assert all("receive_into" in c for g in now for c in g["cases"])
    rows = {r["case"]: r for r in res["rows"]}
    for g in now:
        assert all("software tensor_us 15.5 " in rows[c]["links_from"] for c in g["cases"])
    for g in old:
        for c in g["cases"]:
            costs, _ = calibrate.ring_costs_old(calibrate.ring_code_of(rows[c]))
            assert f"tensor_us {costs['software.tensor_us']:g}," in rows[c]["links_from"]


def _timeline(path, bucket_mib: int, syncs: dict, layers: int = 32) -> None:
    """A --timeline run's gpu_bench.txt (a ring configuration per ordering in ``syncs``: the
    steps of its one printed sync, as runs before session 32 printed, or a list of syncs,
    each under its ``timeline: warm sync k of n`` line) and its json, whose flat copy of the
    model took 10 ms."""
    os.makedirs(path, exist_ok=True)
    lines, cfgs = ["d2d {}"], []
    for sync, steps in syncs.items():
        cfgs.append({"bucket_size": bucket_mib << 20, "num_slots": 2, "zero_copy": False,
                     "sync": sync})
        lines.append("engine " + json.dumps({"cfg": cfgs[-1], "median_ms": 1.0}))
        if steps and isinstance(steps[0], tuple):
            lines += [f"  {t:7.2f} ms  {step}" for t, step in steps]
            continue
        for k, one in enumerate(steps, 1):
            lines.append(f"timeline: warm sync {k} of {len(steps)}, 50.00 ms")
            lines += [f"  {t:7.2f} ms  {step}" for t, step in one]
    with open(os.path.join(path, "gpu_bench.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.join(path, "gpu_bench.json"), "w") as f:
        json.dump({"layers": layers, "d2d": {"flat_ms": 10.0},
                   "engine": [{"cfg": c} for c in cfgs]}, f)


def _buckets(n: int, pack: float, publish: float, wait: float,
             loop: float = 0.0, end: float = 1.0) -> list[tuple[float, str]]:
    """n buckets: wait for a free slot, pack, publish, the trainer's loop to its next slot
    wait (ms), one after another; receiver steps between them, which the reading must
    skip; the sync ends ``end`` ms after the last loop."""
    out, t = [(0.0, "T send_weights>")], 0.0
    for _ in range(n):
        out += [(t, "T _tx_wait_free>"), (t + wait, "T <_tx_wait_free"),
                (t + wait + 0.01, "R _rx_fetch>"), (t + wait + 0.02, "R <_rx_fetch")]
        t += wait + pack
        out += [(t, "T _publish>"), (t + publish, "T <_publish")]
        t += publish + loop
    return out + [(t + end, "T <send_weights")]


def test_session_33s_h200_runs_check_the_old_codes_fit_and_are_groups_per_code_and_case():
    """Session 33's H200 runs (calibrate.S33_H200_RING, one machine): today's receive_into in
    four rounds (256 / 512 MiB event, 1 / 4 GiB host) priced with the H200 preset, the old
    codes' two rounds each (256 MiB - 1 GiB event, 1 / 4 GiB host) with their fitted H200
    costs (RING_SOFTWARE_1129, the 11-29 code's H200 pack wait): the 11-29 code's among that
    fit's rows (calibrate.ring_1129_loss), the 12-01 code's checks of it; a group per code
    and configuration; the timelines (tl/, tl2/, tl3/) are not rows."""
    res = _h200_run()
    folder = calibrate.S33_H200_RING
    rows = [r for r in res["rows"] if r["source"].startswith(folder + "/")]
    if not rows:
        pytest.skip("session 33's H200 runs are not in this checkout")
    assert not [r for r in rows if "/tl" in r["source"]]
    today = [r for r in rows if "/now/" in r["source"]]
    old = [r for r in rows if r not in today]
    assert len(today) == 4 * 4 and len(old) == 2 * 5 * 2
    assert all("software tensor_us 23.8 " in r["links_from"] for r in today)
    assert {calibrate.ring_code_of(r) for r in old} == {"11-29", "12-01"}
    t = calibrate.RING_SOFTWARE_1129["software.tensor_us"]
    assert all(f"code of 11-29 (tensor_us {t:g}, " in r["links_from"] for r in old)
    _, fit_rows = calibrate.ring_1129_loss(t, calibrate.RING_SOFTWARE_1129["software.bucket_us"])
    mine = [r for r in fit_rows if r["source"].startswith(folder + "/")]
    assert len([r for r in mine if calibrate.ring_code_of(r) == "11-29"]) == 10
    assert len([r for r in mine if calibrate.ring_code_of(r) == "12-01"]) == 10
    groups = [g for g in res["repeats"]
              if g["group"].endswith("[H200 runs of 12-07 s33 on one machine]")]
    assert sorted(len(g["cases"]) for g in groups) == [2] * 10 + [4] * 4


def test_timeline_costs_reads_tensor_bucket_and_handoff_costs_off_timelines(tmp_path):
    """benchmarks/timeline_costs.py: the trainer's host time (packing, publishing and its
    loop from a publish to its next slot wait) against the number of buckets is a line
    whose intercept over the model's tensors is tensor_us and slope bucket_us; the
    slot waits per bucket at the smallest bucket size are handoff_us; what host-ordered
    publishes take beyond event-ordered ones at a bucket size, over one flat copy of the
    model, is pack_wait_x (averaged over sizes). One bucket size is not enough (a
    ValueError)."""
    tool = calibrate._script("timeline_costs")
    tensors = len(calibrate._script("gpu_bench").model_shapes(32))
    # 4 buckets at 4 GiB and 72 at 256 MiB: packing 0.2 + 0.02 x tensors/bucket, publish 0.1,
    # the loop to the next slot wait 0.08
    per_t = 0.02 * 291 / tensors        # ms a tensor, whatever the model's count
    # host-ordered publishes: 4 GiB 14 ms (1.4 flat copies) longer, 256 MiB 18 ms (1.8)
    for n, mib, wait, host in ((4, 4096, 2.0, 3.5), (72, 256, 0.25, 0.25)):
        pack = 0.2 + per_t * tensors / n
        _timeline(tmp_path / f"b{mib}", mib,
                  {"event": _buckets(n, pack, 0.1, wait, 0.08),
                   "host": _buckets(n, pack, 0.1 + host, wait, 0.08)})
    costs = tool.host_costs([str(tmp_path / "b4096"), str(tmp_path / "b256")])
    assert costs["software.bucket_us"] == pytest.approx(380, abs=0.2)
    # n buckets take n - 1 loops (the last publish ends the bucket stream): one loop less
    # in the intercept
    assert costs["software.tensor_us"] == pytest.approx((per_t - 0.08 / tensors) * 1e3,
                                                        abs=0.1)
    assert costs["software.handoff_us"] == pytest.approx(250, abs=0.2)
    assert costs["software.pack_wait_x"] == pytest.approx(1.6, abs=0.005)
    with pytest.raises(ValueError, match="two bucket sizes"):
        tool.host_costs([str(tmp_path / "b256")])


def test_timeline_costs_reads_the_syncs_end_at_the_smallest_bucket_size(tmp_path):
    """finish_us: what a sync takes outside the trainer's loop (here the last loop and the
    end, 0.08 + ``end`` ms after the last publish) beyond one bucket's pack and unpack at the
    flat copy's rate (10 ms for the model), at the smallest bucket size; the end at a larger
    size moves nothing."""
    tool = calibrate._script("timeline_costs")
    model = 2 * sum(math.prod(s) for _, s in calibrate._script("gpu_bench").model_shapes(32))

    def costs(end256: float, end4096: float) -> dict:
        for n, mib, end in ((4, 4096, end4096), (72, 256, end256)):
            _timeline(tmp_path / f"e{mib}", mib,
                      {"event": _buckets(n, 0.2 + 6 / n, 0.1, 0.25, 0.08, end=end)})
        return tool.host_costs([str(tmp_path / "e4096"), str(tmp_path / "e256")])

    fill = 2 * 10.0 * (256 << 20) / model        # ms: one bucket packed and unpacked
    assert costs(1.0, 1.0)["software.finish_us"] == pytest.approx((1.08 - fill) * 1e3, abs=0.1)
    assert costs(3.0, 1.0)["software.finish_us"] == pytest.approx((3.08 - fill) * 1e3, abs=0.1)
    assert costs(3.0, 9.0)["software.finish_us"] == costs(3.0, 1.0)["software.finish_us"]
    assert costs(0.0, 1.0)["software.finish_us"] == 0.0          # never below nothing


def test_timeline_costs_takes_the_median_of_a_runs_syncs_at_each_bucket_size(tmp_path):
    """A --timeline run of session 32 on prints every warm sync: each is read as its own
    sync, and a run's point at a bucket size is the median of its syncs there, so one
    stalled sync (a host time three times the others', twice the slot waits) moves no
    cost, and a single-sync run reads as before."""
    tool = calibrate._script("timeline_costs")
    tensors = len(calibrate._script("gpu_bench").model_shapes(32))
    per_t = 0.02 * 291 / tensors
    for n, mib, wait, host in ((4, 4096, 2.0, 3.5), (72, 256, 0.25, 0.25)):
        pack = 0.2 + per_t * tensors / n
        event = [_buckets(n, pack, 0.1, wait, 0.08) for _ in range(3)]
        event.insert(1, _buckets(n, 3 * pack, 0.3, 2 * wait, 0.24))   # a stall
        _timeline(tmp_path / f"many{mib}", mib,
                  {"event": event, "host": [_buckets(n, pack, 0.1 + host, wait, 0.08)] * 3})
        _timeline(tmp_path / f"one{mib}", mib,
                  {"event": _buckets(n, pack, 0.1, wait, 0.08),
                   "host": _buckets(n, pack, 0.1 + host, wait, 0.08)})
    got = tool.syncs(str(tmp_path / "many256" / "gpu_bench.txt"))
    assert [s.cfg["sync"] for s in got] == ["event"] * 4 + ["host"] * 3
    assert len({round(s.host_ms, 3) for s in got[:4]}) == 2      # the stall is read too
    many = tool.host_costs([str(tmp_path / "many4096"), str(tmp_path / "many256")])
    one = tool.host_costs([str(tmp_path / "one4096"), str(tmp_path / "one256")])
    assert many == pytest.approx(one, abs=0.05)
    assert many["software.bucket_us"] == pytest.approx(380, abs=0.2)
    assert many["software.handoff_us"] == pytest.approx(250, abs=0.2)
    assert many["software.pack_wait_x"] == pytest.approx(1.6, abs=0.005)


def test_timeline_costs_prints_the_costs_as_plan_arguments_that_plan_takes(tmp_path, capsys):
    """The script's last line is its costs as `weightsync plan` arguments (README, "Plan a
    sync": your own host's ring); the planner takes them and prices the ring with them."""
    import argparse

    from weightsync.tools.planner.cli import add_arguments, scenario_from_args
    tool = calibrate._script("timeline_costs")
    for n, mib, wait in ((4, 4096, 2.0), (72, 256, 0.25)):
        _timeline(tmp_path / f"b{mib}", mib,
                  {"event": _buckets(n, 0.2 + 0.02 * 291 / n, 0.1, wait, 0.08)})
    dirs = [str(tmp_path / "b4096"), str(tmp_path / "b256")]
    tool.main(dirs)
    last = capsys.readouterr().out.strip().splitlines()[-1].split()
    costs = tool.host_costs(dirs)
    assert last == [a for k, v in costs.items() for a in ("--link-set", f"{k}={v:g}")]
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    sc = scenario_from_args(parser.parse_args(
        ["--model", "qwen3-235b-a22b", "--links", "h100-8gpu-400g", *last]))
    sw = sc.links.software
    assert {k: sw[k.split(".")[1]] * (1 if k.endswith("_x") else 1e6) for k in costs} == \
        pytest.approx(costs)


def test_hostload_reads_each_runs_busy_and_stolen_share_of_the_cpus(tmp_path):
    """benchmarks/hostload.py: a run's window is its B .. E marks; its busy share is user +
    nice + system + irq + softirq over every jiffy between the samples around it, steal
    apart, and the highest 1-minute load average sampled in it. A run with no end is
    left out."""
    tool = calibrate._script("hostload")

    def s(t, user, idle, steal, load):   # user nice system idle iowait irq softirq steal ...
        return f"S {t} cpu  {user} 0 0 {idle} 0 0 0 {steal} 0 0 {load} 1.0 1.0 2/100 7"
    (tmp_path / "h.txt").write_text("\n".join([
        s(10.0, 0, 0, 0, 0.5), "B 10.1 a/r1", s(11.0, 300, 700, 0, 0.9),
        s(12.0, 600, 1300, 100, 2.5), "E 11.9 a/r1",
        "B 12.2 b/r1", s(13.0, 700, 2200, 100, 0.7), s(14.0, 800, 3100, 100, 0.6),
        "E 13.5 b/r1", "B 14.1 c/r1", ""]))
    a, b = tool.read(str(tmp_path / "h.txt"))
    assert (a.run, b.run) == ("a/r1", "b/r1")
    assert a.busy == pytest.approx(0.3) and a.steal == pytest.approx(0.05)
    assert a.load1_max == 2.5 and a.seconds == pytest.approx(1.8)
    assert b.busy == pytest.approx(0.1) and b.steal == 0 and b.load1_max == 2.5


def test_the_h200_presets_ring_costs_are_what_timeline_costs_reads_off_its_timelines():
    """The H200 preset's host costs of today's ring are what timeline_costs.py reads off that
    code's three H200 timelines (calibrate.TODAY_H200_TIMELINES, session 33: 23.8 us a
    tensor, 490.3 us a bucket, handoff 116.6 us, the sync's end 1607.1 us, pack wait 1.02),
    and the old codes' pack wait on an H200 (calibrate.OLD_PACK_WAIT_X, 0.79) is what it
    reads off the 11-29 code's H200 timeline (calibrate.OLD_H200_TIMELINE)."""
    root = calibrate.results_dir()
    dirs = [os.path.join(root, d) for d in calibrate.TODAY_H200_TIMELINES]
    if not all(os.path.exists(d) for d in dirs):
        pytest.skip("the H200 timelines of today's ring are not in this checkout")
    tool = calibrate._script("timeline_costs")
    assert tool.host_costs(dirs) == pytest.approx(calibrate.ring_costs_1204("h200-8gpu-400g"),
                                                  abs=1e-6)
    old = tool.host_costs([os.path.join(root, calibrate.OLD_H200_TIMELINE)])
    assert old["software.pack_wait_x"] == calibrate.OLD_PACK_WAIT_X["software.pack_wait_x"]


def test_the_h100_presets_ring_costs_are_what_timeline_costs_reads_off_its_timelines():
    """The H100 preset's host costs of today's ring (15.5 us, 298 us, handoff 219 us, the
    sync's end 816 us, pack wait 1.59) are what timeline_costs.py reads off that code's two
    H100 timelines (calibrate.TODAY_H100_TIMELINES); the old codes' H100 costs
    (calibrate.ring_costs_old) are read the same way. Session 29's one timeline alone gives
    20.4 / 345 / 206 / 836 (its hand reading, 20 / 262, left out the trainer's loop between a
    publish and its next slot wait)."""
    root = calibrate.results_dir()
    dirs = [os.path.join(root, d) for d in calibrate.TODAY_H100_TIMELINES]
    if not all(os.path.exists(d) for d in dirs):
        pytest.skip("the H100 timelines of today's ring are not in this checkout")
    tool = calibrate._script("timeline_costs")
    got = tool.host_costs(dirs)
    want = calibrate.ring_costs_1204("h100-8gpu-400g")
    assert got == pytest.approx(want, abs=1e-6)
    assert tool.host_costs(dirs[:1]) == {"software.tensor_us": 20.4, "software.bucket_us": 344.9,
                                         "software.handoff_us": 206.1,
                                         "software.finish_us": 835.8}


def test_old_ring_codes_on_an_h100_take_their_own_timelines_costs_and_host_rows_wait():
    """The ring codes of 11-29 and 12-01 on an H100 host are priced with the costs
    timeline_costs.py reads off their own --timeline runs there (calibrate.ring_costs_old,
    all of a code's H100 timelines at once), never with the H200 fit (whose rows take the
    11-29 code's wait for each pack from its H200 timeline: the H200 preset's test); a run
    ordered by the host (sync=host)
    is predicted slower than the same run's event-ordered rows at that bucket size: its
    trainer waits for each pack."""
    res = _h200_run()
    old = [r for r in res["rows"] if calibrate.ring_code_of(r) and r["case"].startswith("H100")]
    if not old:
        pytest.skip("no H100 runs of the old ring codes in this checkout")
    c1129, src = calibrate.ring_costs_old("11-29")
    assert "11-29 code's H100 timelines" in src
    assert c1129 == pytest.approx({"software.tensor_us": 35.8, "software.bucket_us": 547.8,
                                   "software.handoff_us": 206.7, "software.finish_us": 3234.4,
                                   "software.pack_wait_x": 1.15}, abs=0.05)
    tool = calibrate._script("timeline_costs")
    assert c1129 == tool.host_costs([os.path.join(calibrate.results_dir(), d)
                                     for d in calibrate.OLD_H100_TIMELINES["11-29"]])
    c1201, src = calibrate.ring_costs_old("12-01")
    assert "12-01 code's H100 timelines" in src and c1201 != c1129
    for r in old:
        assert "host costs of its code, from the" in r["links_from"], r
        assert "fitted" not in r["links_from"], r
    by_run: dict = {}
    for r in old:
        key = r["source"], re.search(r"ring (\d+) MiB \((\w+)", r["case"]).groups()
        by_run[key] = r["predicted_s"]
    pairs = [(v, by_run[(src, (mib, "event"))]) for (src, (mib, how)), v in by_run.items()
             if how == "host" and (src, (mib, "event")) in by_run]
    assert pairs and all(host > event for host, event in pairs)


@pytest.mark.parametrize("session, rounds, in_costs", [("s30", 4, 3), ("s31", 4, 0),
                                                     ("s33", 3, 4), ("s34", 2, 0),
                                                     ("s34b", 2, 0)])
def test_session_30s_h100_runs_are_a_group_per_code_and_case_and_timelines_no_rows(
        session, rounds, in_costs):
    """Session 30's H100 runs (calibrate.S30_RING), session 31's (the same script on
    another machine, S31_RING) and session 33's (a third machine, three rounds between
    two timelines of each code, S33_RING): each code's rounds of one configuration are one
    group of that machine (the old codes: 256 MiB - 1 GiB event, 1 / 4 GiB host; today's
    receive_into: 256 / 512 MiB event, 1 / 4 GiB host), priced with that code's H100 costs
    (the old codes' timelines, today's the H100 preset); the --timeline runs (tl/, tl2/)
    are not rows. Session 30's three timelines and session 33's four of the old codes are
    among those costs; session 31's are not (held out: its runs check the costs read off
    the other machines), nor session 33's of today's code (the preset's tensor_us also
    prices zero-copy and pushes). Session 34's fourth machine (S34_RING, two rounds after
    one timeline of each code) is held out of every cost like session 31's, and each of its
    groups is within the goal."""
    res = _h200_run()
    folder = {"s30": calibrate.S30_RING, "s31": calibrate.S31_RING,
              "s33": calibrate.S33_RING, "s34": calibrate.S34_RING,
              "s34b": calibrate.S34B_RING}[session]
    day = folder.split("-")[-2]          # gpu-h100-2026-12-06-s30 -> 06
    groups = [g for g in res["repeats"]
              if g["group"].endswith(f"[H100 runs of 12-{day} {session} on one machine]")]
    if not groups:
        pytest.skip(f"session {session[1:]}'s H100 runs are not in this checkout")
    assert len(groups) == 5 + 5 + 4 and all(len(g["cases"]) == rounds for g in groups)
    assert all(f"2026-12-{day}-{session})" in c for g in groups for c in g["cases"])
    timelines = [*calibrate.TODAY_H100_TIMELINES, *(d for ds in
                                                    calibrate.OLD_H100_TIMELINES.values()
                                                    for d in ds)]
    assert sum(d.startswith(folder + "/") for d in timelines) == in_costs
    rows = [r for r in res["rows"] if r["source"].startswith(folder + "/")]
    assert len(rows) == 14 * rounds and not [r for r in rows if "/tl" in r["source"]]
    today = [r for r in rows if "/now/" in r["source"]]
    assert len(today) == 4 * rounds and all("receive_into" in r["case"] for r in today)
    assert all("software tensor_us 15.5 " in r["links_from"] for r in today)
    assert sum("(host," in r["case"] for r in today) == 2 * rounds
    if session in ("s31", "s34", "s34b"):   # held out: a check of the other machines' costs
        assert all(g["within_goal"] for g in groups)
    for r in rows:
        if r not in today:
            costs, _ = calibrate.ring_costs_old(calibrate.ring_code_of(r))
            assert f"tensor_us {costs['software.tensor_us']:g}," in r["links_from"], r


def test_every_recorded_measurement_is_predicted_a_cost_input_or_said_not_to_be():
    """Every .json under benchmarks/results is a case's source, one of the costs' timelines
    or in calibrate.NOT_CALIBRATED with its reason (a run recorded later and forgotten is
    "unaccounted"); no entry there is stale (matching no file, or a file that is a case)."""
    doc = calibrate.run()
    cov = doc["coverage"]
    assert cov["unaccounted"] == [] and cov["stale"] == []
    assert set(cov["cost_inputs"]) == set(calibrate.cost_inputs())
    assert not set(cov["cases"]) & set(cov["not_calibrated"])
    # runs that sessions before 34 left out without a word are cases now
    assert "per-tensor-2026-12-02/after.json" in cov["cost_inputs"]      # 12-02's tensor_us
    for f in ("per-tensor-2026-12-02/after_threads0.json",
              "gpu-h200-2026-12-05-branches/gpu_bench_r1.json",
              "gpu-h100-2026-12-05-s21/call3/r2_settle200/gpu_bench.json",
              "cpu-2026-11-29/bench-fp32.json", "review-2026-12-03/after_mend_1g.json"):
        assert f in cov["cases"], f
    assert "0 unaccounted" in calibrate.format_text(doc)
    assert "delta" in cov["not_calibrated"]["delta-2026-12-02/delta.json"]


def test_coverage_names_a_forgotten_run_and_a_stale_entry(tmp_path, monkeypatch):
    for path in ("read/a.json", "why/b.json", "new/c.json", "t/gpu_bench.json",
                 "planner-x/calib.json", "read/notes.txt"):
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text("{}")
    monkeypatch.setattr(calibrate, "NOT_CALIBRATED", {"why/": "a reason", "gone/": "old",
                                                      "read/a.json": "listed and read"})
    monkeypatch.setattr(calibrate, "cost_inputs", lambda: ["t/gpu_bench.json",
                                                           "u/gpu_bench.json"])
    doc = {"rows": [{"source": "read/a.json warm_median_s"}], "preset_rows": [],
           "spun_rows": []}
    cov = calibrate.coverage(doc, str(tmp_path))
    assert cov["cases"] == ["read/a.json"] and cov["cost_inputs"] == ["t/gpu_bench.json"]
    assert cov["not_calibrated"] == {"why/b.json": "a reason"}
    assert cov["unaccounted"] == ["new/c.json"]
    assert cov["stale"] == ["gone/", "read/a.json", "u/gpu_bench.json"]


def test_each_codes_per_tensor_cost_is_its_own_tiny_run():
    """The cpu-2core preset's tensor_us is today's code's, read off session 34's first tiny
    run (10,000 tensors); the 12-02 and 12-03 codes' other runs take their own code's (their
    first tiny run), those runs being inputs, not cases. Each tiny case is then within the
    goal; with today's cost instead, the 12-02 runs (23.5-26.4 us a tensor) are not."""
    root = calibrate.results_dir()
    today = calibrate.tiny_tensor_us(root, *calibrate.TINY_COSTS["today"])
    assert load_links("cpu-2core").sw("tensor_us") == pytest.approx(today * 1e-6)
    assert 9 < today < 12
    rows = [r for r in calibrate.run(("cpu",))["rows"] if r["case"].startswith("CPU tiny-")]
    inputs = {"/".join(run) for run in calibrate.TINY_COSTS.values()}
    assert not [r for r in rows if r["source"].split()[0] in inputs]
    assert len(rows) == 8 and all(r["within_goal"] for r in rows)
    old = [r for r in rows if "12-0" in r["case"] and "12-07" not in r["case"]]
    assert len(old) == 4 and all("its code's per-tensor cost" in r["links_from"] for r in old)
    for r in old:
        with_today = 10000 * today * 1e-6 / r["measured_s"] - 1
        if "12-02" in r["case"]:
            assert with_today < -calibrate.GOAL, r["case"]


def test_a_workloads_model_is_built_per_dtype_and_bucket_size():
    """The 11-29 fp32 run's synthetic-256MiB is 182 float32 tensors; built once per name it
    was the bf16 run's 98 tensors at 4 bytes each (twice the bytes: +33..+66 %)."""
    rows = [r for r in calibrate.run(("cpu",))["rows"] if "(11-29 fp32" in r["case"]]
    assert len(rows) == 4
    for r in rows:
        assert abs(r["error"]) < 0.3, r["case"]
    assert calibrate._model_key({"workload": "w", "dtype": "float32", "bucket_size": 1}) != \
        calibrate._model_key({"workload": "w", "dtype": "bfloat16", "bucket_size": 1})


def test_each_11_29_codes_wait_for_a_direct_read_is_its_own_timing(tmp_path):
    """The 11-29 codes' trainer blocked on every direct read; the wait each read adds is
    their own, timed in session 35 (their receiver's gap between reads over today's at
    window 2 from the same size, same round), not the later code's 370 us. Every shm row of
    those runs carries it, and says so; a timing file without the rounds is an error."""
    root = calibrate.results_dir()
    early = calibrate.direct_wait_us(root, "7209436")      # reads from 1 MiB
    late = calibrate.direct_wait_us(root, "dda6fe7")       # reads from 8 MiB
    assert 40 < early < 150 and 150 < late < 300
    assert load_links("cpu-2core").sw("direct_wait_us") == pytest.approx(370e-6)
    rows = calibrate.run(("cpu",))["rows"]
    for label, wait in (("(11-29, earlier run", early), ("(11-29)", late),
                        ("(code of 11-29's earlier run", early), ("(11-29 code, 12-06 run", late)):
        mine = [r for r in rows if label in r["case"] and " shm" in r["case"]]
        assert mine, label
        assert all("its code's wait for each direct read" in r["links_from"] for r in mine)
    qwen = [r for r in rows if r["case"].startswith("CPU hf-qwen2-0.5b shm R=1 (")
            and "earlier run" in r["case"]]
    assert len(qwen) == 3 and all(r["within_goal"] for r in qwen)
    (tmp_path / calibrate.WAIT_RUN[0]).mkdir()
    (tmp_path / calibrate.WAIT_RUN[0] / calibrate.WAIT_RUN[1]).write_text(
        json.dumps({"code": "c7209436", "median": {"gap_per_read_us": 300.0}}) + "\n")
    with pytest.raises(PlannerError, match="no rounds"):
        calibrate.direct_wait_us(str(tmp_path), "7209436")
