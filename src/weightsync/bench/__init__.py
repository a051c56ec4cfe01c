"""``weightsync bench``: time weight syncs against honest baselines and physical limits.

Importable::

    from weightsync.bench import BenchConfig, run_bench, format_table
    doc = run_bench(BenchConfig(sizes=("0.25",), receivers=(1,), warm=5))
    print(format_table(doc))

See :mod:`weightsync.bench.runner` (cases, pools), :mod:`~weightsync.bench.methods`
(weightsync backends and limits), :mod:`~weightsync.bench.baselines` (Ray, per-tensor
gloo, safetensors) and :mod:`~weightsync.bench.report` (JSON schema, goals, table, plot).
"""

from .report import SCHEMA, format_goals, format_table, plot, validate
from .runner import ALL_METHODS, BenchConfig, run_bench
from .workloads import Workload, hf_qwen2, parse_size, synthetic

__all__ = ["BenchConfig", "run_bench", "format_table", "format_goals", "plot", "validate",
           "SCHEMA", "ALL_METHODS", "Workload", "synthetic", "hf_qwen2", "parse_size"]
