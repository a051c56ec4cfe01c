"""``weightsync plan --fit``: a links file from your own ``weightsync bench --json`` run.

The CPU bench times the limits of the machine it runs on beside the backends. Each limit
sets one field of a host links file (:mod:`.links`); every other field comes from a base
preset (``cpu-2core`` unless ``base`` says otherwise):

* ``memcpy`` -> ``links.device_mem.GBps``: bytes / warm median (one copy, one process);
* ``memcpy-parallel`` with 2+ receivers -> ``links.host_mem.GBps``: receivers x bytes /
  warm median (every copy of the host together; one process copying alone sets nothing);
* ``gloo-flat`` -> ``collective.GBps``: receivers x bytes / warm median;
* ``nixl-raw`` -> ``links.intra.GBps``: bytes / warm median;
* ``cma-raw`` -> ``ring.direct_GBps``: receivers x bytes / warm median;
* ``shm`` and ``collective`` on a ``--tiny N`` workload, 1 receiver ->
  ``software.tensor_us``: warm median / N, in microseconds;
* ``machine.cores`` -> ``cores``.

Each field is the median over every ``ok`` row that sets it (any workload but the
``--tiny`` ones for rates, any dtype). Run, for example::

    weightsync bench --sizes 0.25,1 --receivers 1,2 --dtypes bfloat16 --no-hf \\
        --methods shm,collective,memcpy,memcpy-parallel,gloo-flat,cma-raw --tiny 10000 \\
        --json bench.json
    weightsync plan --fit bench.json --out links.json
    weightsync plan --links links.json --model bench:synthetic-1GiB --replicas 2

Owns :func:`fit_links` and :data:`FITS`. Bad input is a :class:`~.errors.PlannerError`
(a ``ValueError``) naming the field, e.g. ``results[3].warm_median_s``.
"""

from __future__ import annotations

import copy
import math
import statistics
from dataclasses import dataclass
from typing import Any, Mapping, Optional

from weightsync.tools.planner.errors import PlannerError
from weightsync.tools.planner.links import PRESET_DIR, _read, load_links, parse_links, \
    preset_names

__all__ = ["Fit", "FITS", "fit_links", "fit_file", "BENCH_SCHEMA", "DEFAULT_BASE"]

#: the ``schema`` of a ``weightsync bench --json`` document
BENCH_SCHEMA = "weightsync-bench/1"
DEFAULT_BASE = "cpu-2core"


@dataclass(frozen=True)
class Fit:
    """One links field set from bench rows of ``method``: ``bytes x (receivers if
    per_receiver else 1) / warm_median_s`` in GB/s, from rows with at least
    ``min_receivers`` receivers."""

    method: str
    field: str
    per_receiver: bool
    what: str
    min_receivers: int = 1


#: the limits the bench records and the link each one sets
FITS = (
    Fit("memcpy", "links.device_mem.GBps", False, "one flat memcpy in one process"),
    Fit("memcpy-parallel", "links.host_mem.GBps", True,
        "every receiver copies the bytes at once: all copies of the host together",
        min_receivers=2),
    Fit("gloo-flat", "collective.GBps", True,
        "one raw gloo broadcast of a flat buffer (a copy to each receiver)"),
    Fit("nixl-raw", "links.intra.GBps", False, "one raw NIXL READ of a flat region"),
    Fit("cma-raw", "ring.direct_GBps", True,
        "every receiver reads the trainer's flat buffer with cross-memory reads"),
)
#: the methods whose ``--tiny`` rows give the cost of a tensor (``software.tensor_us``)
TENSOR_METHODS = ("shm", "collective")
TENSOR_FIELD = "software.tensor_us"


def _number(row: Mapping, key: str, where: str, *, integer: bool = False,
            low: float = 0.0) -> float:
    v = row.get(key)
    ok = not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v) \
        and v > low and (not integer or v == int(v))
    if not ok:
        kind = "an integer" if integer else "a number"
        raise PlannerError(f"{where}.{key}", f"must be {kind} > {low:g}, got {v!r}")
    return float(v)


def _rows(doc: Any) -> list[tuple[int, Mapping]]:
    if not isinstance(doc, Mapping):
        raise PlannerError("bench", f"a weightsync bench --json document is a JSON object, "
                                    f"got {type(doc).__name__}")
    if doc.get("schema") != BENCH_SCHEMA:
        raise PlannerError("schema", f"must be {BENCH_SCHEMA!r} (weightsync bench --json), "
                                     f"got {doc.get('schema')!r}")
    results = doc.get("results")
    if not isinstance(results, list):
        raise PlannerError("results", f"must be a list of bench rows, got "
                                      f"{type(results).__name__}")
    out = []
    for i, row in enumerate(results):
        if not isinstance(row, Mapping):
            raise PlannerError(f"results[{i}]", f"must be an object, got {type(row).__name__}")
        if row.get("status") == "ok":
            out.append((i, row))
    return out


def _tiny(row: Mapping) -> bool:
    """A ``--tiny`` row: a per-tensor cost, no rate of bytes."""
    name = row.get("workload")
    return isinstance(name, str) and name.startswith("tiny-")


def _median(values: list[float]) -> dict[str, float]:
    return {"value": statistics.median(values), "rows": len(values), "min": min(values),
            "max": max(values)}


def _measure(doc: Any) -> dict[str, dict]:
    """field -> {value, rows, min, max, method} from the bench document's ok rows."""
    rows = _rows(doc)
    found: dict[str, dict] = {}
    for fit in FITS:
        rates = []
        for i, row in rows:
            if row.get("method") != fit.method or _tiny(row):
                continue
            where = f"results[{i}]"
            receivers = _number(row, "receivers", where, integer=True)
            if receivers < fit.min_receivers:
                continue
            nbytes = _number(row, "bytes", where, integer=True)
            seconds = _number(row, "warm_median_s", where)
            rates.append((receivers if fit.per_receiver else 1) * nbytes / seconds / 1e9)
        if rates:
            found[fit.field] = {**_median(rates), "method": fit.method, "what": fit.what}
    per_tensor = []
    for i, row in rows:
        if row.get("method") not in TENSOR_METHODS or not _tiny(row):
            continue
        where = f"results[{i}]"
        if _number(row, "receivers", where, integer=True) != 1:
            continue
        tensors = _number(row, "tensors", where, integer=True)
        per_tensor.append(_number(row, "warm_median_s", where) / tensors * 1e6)
    if per_tensor:
        found[TENSOR_FIELD] = {**_median(per_tensor), "method": "/".join(TENSOR_METHODS),
                               "what": "a sync of N tensors of 16 elements to one receiver "
                                       "(--tiny N), per tensor"}
    if not found:
        names = ", ".join(f.method for f in FITS)
        raise PlannerError("results", f"no ok row of {names} or a --tiny shm/collective row: "
                                      "run weightsync bench with those --methods")
    return found


def _base_doc(base: str | Mapping) -> tuple[dict, str]:
    if isinstance(base, Mapping):
        doc, name = copy.deepcopy(dict(base)), str(base.get("name", "base"))
    elif base in preset_names():
        doc, name = _read(f"{PRESET_DIR}/{base}.json"), base
    else:
        load_links(base)             # a PlannerError naming what is wrong with it
        doc, name = _read(base), str(base)
    parse_links(doc, name)
    if doc.get("device") != "host":
        raise PlannerError("base", f"{name!r} is a {doc.get('device', 'gpu')} links file; the "
                                   "bench runs processes on one host: give a host links file "
                                   f"(e.g. {DEFAULT_BASE})")
    return doc, name


def fit_links(bench: Any, base: str | Mapping = DEFAULT_BASE, *, name: str = "fitted",
              source: str = "weightsync bench --json") -> dict:
    """A links document (what ``weightsync plan --links`` reads) from a parsed
    ``weightsync bench --json`` document: ``base`` (a preset name, a links file's path or
    a mapping; a host links file) with every field the bench measured set from it
    (:data:`FITS`). The document's ``fitted`` section says, per field, the value, the rows
    it came from and their range. Raises :class:`PlannerError` naming the first bad field."""
    found = _measure(bench)
    doc, base_name = _base_doc(base)
    sections: dict[tuple[str, ...], list[str]] = {}
    for field, got in found.items():
        *path, key = field.split(".")
        node = doc
        for k in path:
            node = node.setdefault(k, {})
        node[key] = round(got["value"], 4 if key.endswith("GBps") else 2)
        sections.setdefault(tuple(path), []).append(key)
    for path, keys in sections.items():
        node = doc
        for k in path:
            node = node[k]
        fitted = [f"{'.'.join((*path, k))} ({found['.'.join((*path, k))]['method']})"
                  for k in keys]
        node["source"] = f"fitted from {source}: {', '.join(fitted)}; any other field as in " \
                         f"{base_name}"
    machine = bench.get("machine") if isinstance(bench.get("machine"), Mapping) else {}
    cores = machine.get("cores")
    if isinstance(cores, int) and not isinstance(cores, bool) and cores > 0:
        doc["cores"] = cores
        found["cores"] = {"value": cores, "rows": 0, "method": "machine.cores",
                          "what": "the bench machine's cores"}
    desc = ", ".join(str(machine[k]) for k in ("hostname", "cpu") if machine.get(k))
    doc["name"] = name
    doc["description"] = f"fitted from {source}" + (f" ({desc})" if desc else "") + \
        f"; the rest from {base_name}"
    doc["fitted"] = {k: {x: (round(v, 6) if isinstance(v, float) else v)
                         for x, v in got.items()} for k, got in found.items()}
    doc["notes"] = [f"{k}: {got['what']}; median of {got['rows']} bench rows"
                    for k, got in found.items() if got["rows"]] + \
        [f"Every other number is {base_name}'s: see its file for what each one is."]
    parse_links(doc, name)           # what plan --links will read
    return doc


def fit_file(path: str, base: str | Mapping = DEFAULT_BASE,
             name: Optional[str] = None) -> dict:
    """:func:`fit_links` of the bench JSON at ``path``."""
    import json
    import os
    try:
        with open(path) as f:
            bench = json.load(f)
    except OSError as exc:
        raise PlannerError("fit", f"cannot read {path}: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise PlannerError("fit", f"{path} is not valid JSON: {exc}") from None
    stem = os.path.splitext(os.path.basename(path))[0]
    return fit_links(bench, base, name=name or f"fit-{stem}", source=os.path.basename(path))
