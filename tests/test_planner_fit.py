"""``weightsync plan --fit``: a links file from a ``weightsync bench --json`` run. The
bench's limits set the rates they measured (medians over the rows), everything else comes
from the base preset, ``plan --links`` reads the file, and bad input is a ValueError naming
the field."""

from __future__ import annotations

import copy
import json

import pytest

from weightsync.tools.cli import main
from weightsync.tools.planner import PlannerError, fit_links, load_links, plan
from weightsync.tools.planner.fit import fit_file

pytestmark = pytest.mark.timeout(120)

GiB = 1 << 30


def _row(method: str, receivers: int, seconds: float, *, nbytes: int = GiB,
         workload: str = "synthetic-1GiB", status: str = "ok", **extra) -> dict:
    return {"workload": workload, "dtype": "bfloat16", "bytes": nbytes, "receivers": receivers,
            "method": method, "status": status, "warm_median_s": seconds, **extra}


def bench_doc() -> dict:
    """A bench run as ``weightsync bench --json`` writes it (the fields the fit reads)."""
    rows = [
        _row("memcpy", 1, 0.100), _row("memcpy", 2, 0.125), _row("memcpy", 4, 0.200),
        _row("memcpy-parallel", 1, 0.050),                  # one process: not the host's
        _row("memcpy-parallel", 2, 0.200), _row("memcpy-parallel", 4, 0.400),
        _row("gloo-flat", 1, 0.250), _row("gloo-flat", 2, 0.500),
        _row("cma-raw", 2, 0.250),
        _row("nixl-raw", 1, 0.125),
        _row("shm", 1, 0.150),                              # a backend: sets nothing
        _row("shm", 1, 0.010, workload="tiny-1000", nbytes=64000, tensors=1000),
        _row("collective", 1, 0.030, workload="tiny-1000", nbytes=64000, tensors=1000),
        _row("shm", 2, 0.500, workload="tiny-1000", nbytes=64000, tensors=1000),
        _row("memcpy", 1, 1e-6, workload="tiny-1000", nbytes=64000, tensors=1000),
        _row("gloo-flat", 4, None, status="skipped"),
    ]
    return {"schema": "weightsync-bench/1", "machine": {"hostname": "box", "cpu": "Some CPU",
                                                        "cores": 8},
            "config": {}, "results": rows, "goals": [], "notes": []}


def test_the_limits_set_the_rates_they_measured():
    doc = fit_links(bench_doc())
    gb = GiB / 1e9
    fitted = {k: v["value"] for k, v in doc["fitted"].items()}
    assert fitted["links.device_mem.GBps"] == pytest.approx(gb / 0.125)   # median of 3
    assert doc["fitted"]["links.device_mem.GBps"]["rows"] == 3            # tiny row left out
    assert fitted["links.host_mem.GBps"] == pytest.approx(2 * gb / 0.2)   # R=2 and R=4 only
    assert doc["fitted"]["links.host_mem.GBps"]["rows"] == 2
    assert fitted["collective.GBps"] == pytest.approx((gb / 0.25 + 2 * gb / 0.5) / 2)
    assert fitted["ring.direct_GBps"] == pytest.approx(2 * gb / 0.25)
    assert fitted["links.intra.GBps"] == pytest.approx(gb / 0.125)
    assert fitted["software.tensor_us"] == pytest.approx(20.0)            # 10 and 30 us
    assert fitted["cores"] == 8
    # what plan reads: the fitted rates, and the base preset's other numbers
    links = load_links(doc)
    base = load_links("cpu-2core")
    assert links.links["device_mem"].rate == pytest.approx(round(gb / 0.125, 4) * 1e9)
    assert links.collective_cap == pytest.approx(round(fitted["collective.GBps"], 4) * 1e9)
    assert links.direct_rate == pytest.approx(round(2 * gb / 0.25, 4) * 1e9)
    assert links.software["tensor_us"] == pytest.approx(20e-6)
    assert links.cores == 8 and links.device == "host"
    assert links.software["bucket_us"] == base.software["bucket_us"]
    assert links.codec == base.codec and links.direct_min_bytes == base.direct_min_bytes
    assert "Some CPU" in doc["description"]
    assert "fitted" in doc["links"]["device_mem"]["source"]


def test_only_the_measured_fields_change_and_the_bench_doc_is_left_alone():
    bench = bench_doc()
    bench["results"] = [r for r in bench["results"] if r["method"] == "memcpy"]
    before = copy.deepcopy(bench)
    doc = fit_links(bench, "h200-host")
    assert bench == before
    assert set(doc["fitted"]) == {"links.device_mem.GBps", "cores"}
    base = load_links("h200-host")
    links = load_links(doc)
    assert links.links["host_mem"].rate == base.links["host_mem"].rate
    assert links.links["d2h"].rate == base.links["d2h"].rate


def test_plan_takes_the_fitted_file(tmp_path, capsys):
    src, out = tmp_path / "bench.json", tmp_path / "links.json"
    src.write_text(json.dumps(bench_doc()))
    assert main(["plan", "--fit", str(src), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "links.device_mem.GBps" in printed and str(out) in printed
    doc = json.loads(out.read_text())
    assert doc["name"] == "fit-bench"
    assert main(["plan", "--links", str(out), "--model", "bench:synthetic-16MiB",
                 "--replicas", "2", "--strategies", "ring,broadcast"]) == 0
    assert "fit-bench" in capsys.readouterr().out
    # through the Python API: a box whose copies ran 4 x as fast syncs faster
    def ring_seconds(scale: float) -> float:
        doc = fit_links({**bench_doc(), "results": [
            _row(m, r, s / scale) for m, r, s in (("memcpy", 1, 0.1), ("memcpy-parallel", 2, 0.2),
                                                  ("cma-raw", 1, 0.1))]})
        return plan("bench:synthetic-16MiB", links=load_links(doc), trainer_gpus=1,
                    replicas=1, strategies=("ring",)).results["ring"].seconds
    assert ring_seconds(4.0) < 0.5 * ring_seconds(1.0)
    # without --out: the links file on stdout, the summary on stderr
    assert main(["plan", "--fit", str(src)]) == 0
    got = capsys.readouterr()
    assert json.loads(got.out)["fitted"] == doc["fitted"]
    assert "links.host_mem.GBps" in got.err


def _bad(**change) -> dict:
    doc = bench_doc()
    for key, value in change.items():
        if key.startswith("row0_"):
            doc["results"][0][key[5:]] = value
        elif key.startswith("tiny_"):
            doc["results"][11][key[5:]] = value
        else:
            doc[key] = value
    return doc


@pytest.mark.parametrize("doc, field", [
    ([], "bench"),
    (_bad(schema="weightsync.plan/1"), "schema"),
    (_bad(results={"memcpy": 1}), "results"),
    (_bad(results=[]), "results"),
    (_bad(results=[_row("shm", 1, 0.1)]), "results"),
    (_bad(results=["memcpy"]), "results[0]"),
    (_bad(row0_warm_median_s=0.0), "results[0].warm_median_s"),
    (_bad(row0_warm_median_s="0.1"), "results[0].warm_median_s"),
    (_bad(row0_bytes=-1), "results[0].bytes"),
    (_bad(row0_receivers=1.5), "results[0].receivers"),
    (_bad(tiny_tensors=None), "results[11].tensors"),
])
def test_bad_input_is_a_value_error_naming_the_field(doc, field):
    with pytest.raises(ValueError) as e:
        fit_links(doc)
    assert isinstance(e.value, PlannerError) and e.value.field == field, e.value


def test_a_gpu_base_or_a_missing_file_is_named(tmp_path, capsys):
    with pytest.raises(PlannerError) as e:
        fit_links(bench_doc(), "h100-8gpu-400g")
    assert e.value.field == "base"
    with pytest.raises(PlannerError) as e:
        fit_file(str(tmp_path / "missing.json"))
    assert e.value.field == "fit"
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(_bad(row0_warm_median_s=-2)))
    assert main(["plan", "--fit", str(bad), "--out", str(tmp_path / "x.json")]) == 2
    assert "results[0].warm_median_s" in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()


@pytest.mark.timeout(300)
def test_a_real_bench_run_fits(tmp_path):
    """What ``weightsync bench --json`` writes is what the fit reads."""
    out = tmp_path / "bench.json"
    assert main(["bench", "--sizes", "4MiB", "--dtypes", "bfloat16", "--receivers", "1,2",
                 "--warm", "2", "--no-hf", "--quiet", "--timeout", "60", "--tiny", "200",
                 "--methods", "shm,memcpy,memcpy-parallel,gloo-flat", "--json", str(out)]) in (0, 1)
    doc = fit_file(str(out))
    assert {"links.device_mem.GBps", "links.host_mem.GBps", "collective.GBps",
            "software.tensor_us", "cores"} <= set(doc["fitted"])
    assert all(v["value"] > 0 for v in doc["fitted"].values())
    load_links(doc)
