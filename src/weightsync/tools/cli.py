"""The ``weightsync`` command line.

Each subcommand is one function ``cmd_<name>(args) -> int`` plus one function that adds
its arguments to a parser; both are listed in :data:`SUBCOMMANDS`. To add a subcommand,
write the two functions and register them with :func:`subcommand`.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Callable, Optional, Sequence

__all__ = ["main", "build_parser", "subcommand", "SUBCOMMANDS"]

#: name -> (help, add_arguments(parser), run(args) -> exit code)
SUBCOMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None],
                             Callable[[argparse.Namespace], int]]] = {}


def subcommand(name: str, help: str, add_arguments: Callable[[argparse.ArgumentParser], None]):
    """Decorator registering ``run(args) -> int`` as subcommand ``name``."""
    def wrap(run: Callable[[argparse.Namespace], int]):
        SUBCOMMANDS[name] = (help, add_arguments, run)
        return run
    return wrap


# -- bench ------------------------------------------------------------------------------
def _csv(cast):
    def parse(text: str):
        try:
            return tuple(cast(x.strip()) for x in text.split(",") if x.strip())
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    return parse


def _bytes(text: str) -> int:
    from weightsync.tools.bench.workloads import parse_size
    try:
        if text.strip().isdigit():
            return int(text)
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _bench_args(p: argparse.ArgumentParser) -> None:
    from weightsync.tools.bench.runner import ALL_METHODS, DEFAULT_METHODS
    p.add_argument("--sizes", type=_csv(str), default=("0.25", "1", "4"),
                   help="synthetic sizes in GiB, or with a unit (e.g. 16MiB); default 0.25,1,4")
    p.add_argument("--dtypes", type=_csv(str), default=("bfloat16", "float32"))
    p.add_argument("--receivers", type=_csv(int), default=(1, 2, 4),
                   help="receiver process counts; default 1,2,4")
    p.add_argument("--methods", type=_csv(str), default=DEFAULT_METHODS,
                   help=f"subset of {','.join(ALL_METHODS)} (default: all but the shm-buckets/shm-direct variants)")
    p.add_argument("--no-hf", action="store_true",
                   help="skip the config-built HF Qwen2 (~0.5B) workload")
    p.add_argument("--warm", type=int, default=5, help="warm syncs per case (median reported)")
    p.add_argument("--bucket-size", type=_bytes, default=64 << 20,
                   help="bucket size of the weightsync backends (default 64MiB)")
    p.add_argument("--timeout", type=float, default=180.0, help="seconds per blocking step")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads per bench process (default 1: R+1 processes share the "
                        "cores; 0: torch's default of one per core)")
    p.add_argument("--consume", choices=("into", "copy"), default="into",
                   help="how receivers consume a sync: into (receive_into, default) or copy "
                        "(the README's `async for name, t in receive_weights(v): "
                        "params[name].copy_(t)`)")
    p.add_argument("--tiny", type=int, default=0, metavar="N",
                   help="also sync N tensors of 16 elements and print the time per tensor "
                        "(the per-tensor overhead; e.g. 10000)")
    p.add_argument("--changed", type=float, default=0.0, metavar="F",
                   help="per sync, change this fraction of every tensor's elements (default 0: "
                        "one element per tensor); e.g. 0.005 with --methods delta+shm,shm")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON ('-': stdout)")
    p.add_argument("--plot", metavar="PNG", help="write a GB/s plot (needs matplotlib)")
    p.add_argument("--markdown", metavar="PATH", help="write the tables and goals as Markdown")
    p.add_argument("--from-json", metavar="PATH",
                   help="do not run: re-render a previous --json result (table, plot, Markdown)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


class _Progress:
    """tqdm if installed, else one line per case on stderr."""

    def __init__(self, quiet: bool) -> None:
        self.quiet, self.bar, self.n, self.total = quiet, None, 0, 0

    def total_cb(self, total: int) -> None:
        self.total = total
        if self.quiet:
            return
        try:
            from tqdm import tqdm
            self.bar = tqdm(total=total, unit="run", file=sys.stderr, dynamic_ncols=True)
        except ImportError:
            self.bar = None

    def __call__(self, tag: str) -> None:
        if self.quiet:
            return
        if self.bar is not None:
            if self.n:
                self.bar.update(1)
            self.bar.set_description(tag)
        else:
            print(f"[{self.n + 1}/{self.total}] {tag}", file=sys.stderr, flush=True)
        self.n += 1

    def close(self) -> None:
        if self.bar is not None:
            self.bar.update(1)
            self.bar.close()


@subcommand("bench", "time weight syncs against baselines and limits", _bench_args)
def cmd_bench(args: argparse.Namespace) -> int:
    from weightsync.tools.bench import BenchConfig, format_goals, format_table, plot, run_bench, validate
    from weightsync.tools.bench.report import format_markdown
    if args.from_json:
        with open(args.from_json) as f:
            doc = json.load(f)
        validate(doc)
    else:
        cfg = BenchConfig(sizes=args.sizes, dtypes=args.dtypes, receivers=args.receivers,
                          methods=args.methods, hf=not args.no_hf, warm=args.warm,
                          bucket_size=args.bucket_size, timeout=args.timeout,
                          threads=args.threads, consume=args.consume, tiny=args.tiny,
                          changed=args.changed)
        progress = _Progress(args.quiet)
        try:
            doc = run_bench(cfg, progress=progress, total_cb=progress.total_cb)
        finally:
            progress.close()
        doc["command"] = "weightsync " + " ".join(sys.argv[1:]) if sys.argv else ""
    out = sys.stderr if args.json == "-" else sys.stdout
    print(format_table(doc), file=out)
    print("\nGoals (ratios from this run):\n" + format_goals(doc), file=out)
    for note in doc["notes"]:
        print(f"note: {note}", file=out)
    if args.json and not args.from_json:
        text = json.dumps(doc, indent=1)
        if args.json == "-":
            print(text)
        else:
            with open(args.json, "w") as f:
                f.write(text + "\n")
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(format_markdown(doc) + "\n")
    if args.plot:
        try:
            plot(doc, args.plot)
        except ImportError:
            print("note: --plot needs matplotlib (pip install 'weightsync[bench]')",
                  file=sys.stderr)
            return 2
    failed = [r for r in doc["results"] if r["status"] == "failed" or
              (r["status"] == "ok" and not r["ok"])]
    return 1 if failed else 0


# -- demo -------------------------------------------------------------------------------
def _demo_args(p: argparse.ArgumentParser) -> None:
    from weightsync.tools.demo import add_arguments
    add_arguments(p)


@subcommand("demo", "train with 2 FSDP2 ranks, sync each step into rollout replicas over "
            "Ray, check the rollouts bit for bit", _demo_args)
def cmd_demo(args: argparse.Namespace) -> int:
    from weightsync.tools.demo import run_from_args
    return run_from_args(args)


# -- plan -------------------------------------------------------------------------------
def _plan_args(p: argparse.ArgumentParser) -> None:
    from weightsync.tools.planner.cli import add_arguments
    add_arguments(p)


@subcommand("plan", "predict a sync on a cluster you do not have (bytes, reads, time, "
            "bottleneck), from the plan code the backends run", _plan_args)
def cmd_plan(args: argparse.Namespace) -> int:
    from weightsync.tools.planner.cli import run
    return run(args)


# -- entry point ------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="weightsync",
                                     description="Move trainer weights into rollout engines.")
    subs = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (help_text, add_arguments, run) in SUBCOMMANDS.items():
        sp = subs.add_parser(name, help=help_text, description=help_text)
        add_arguments(sp)
        sp.set_defaults(_run=run)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "_run", None):
        parser.print_help()
        return 2
    try:
        return int(args._run(args) or 0)
    except ValueError as exc:
        parser.error(str(exc))
        return 2


if __name__ == "__main__":
    sys.exit(main())
