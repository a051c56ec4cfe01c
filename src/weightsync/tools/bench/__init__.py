"""``weightsync bench``: time weight syncs against honest baselines and physical limits.

Importable::

    from weightsync.tools.bench import BenchConfig, run_bench, format_table
    doc = run_bench(BenchConfig(sizes=("0.25",), receivers=(1,), warm=5))
    print(format_table(doc))

See :mod:`weightsync.tools.bench.runner` (cases, pools), :mod:`~weightsync.tools.bench.methods`
(weightsync backends and limits), :mod:`~weightsync.tools.bench.baselines` (Ray, per-tensor
gloo, safetensors) and :mod:`~weightsync.tools.bench.report` (JSON schema, goals, table, plot).
"""

from weightsync.tools.bench.report import SCHEMA, format_goals, format_table, plot, validate
from weightsync.tools.bench.runner import ALL_METHODS, BenchConfig, run_bench
from weightsync.tools.bench.workloads import Workload, hf_qwen2, parse_size, synthetic

__all__ = ["BenchConfig", "run_bench", "format_table", "format_goals", "plot", "validate",
           "SCHEMA", "ALL_METHODS", "Workload", "synthetic", "hf_qwen2", "parse_size"]
