"""``weightsync plan``: the arguments and the run of the subcommand.

Owns :func:`add_arguments` and :func:`run` (registered in :mod:`weightsync.tools.cli`).
Exit codes: 0 done; 2 bad input (a :class:`~.errors.PlannerError`: one line naming the
field, no traceback; argparse's own errors also exit 2).
"""

from __future__ import annotations

import argparse
import json
import sys

from weightsync.core.config import DEFAULT_BUCKET_SIZE, DEFAULT_NUM_SLOTS
from weightsync.transport.backends.collective import COLLECTIVE_DIRECT_MIN

__all__ = ["add_arguments", "run", "scenario_from_args"]


def _pair(text: str) -> tuple[str, object]:
    if "=" not in text:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    key, value = text.split("=", 1)
    try:
        return key.strip(), json.loads(value)
    except json.JSONDecodeError:
        return key.strip(), value


def add_arguments(p: argparse.ArgumentParser) -> None:
    m = p.add_argument_group("model")
    m.add_argument("--model", help="preset (kimi-k2, qwen3-235b-a22b), HF config folder or "
                                   "JSON file, or a transformers config class (DeepseekV3Config)")
    m.add_argument("--set", type=_pair, action="append", default=[], metavar="KEY=VALUE",
                   help="override a config field before the model is built (repeatable)")
    m.add_argument("--src-dtype", default="bfloat16", help="dtype trainer ranks export")
    m.add_argument("--dst-dtype", default="bfloat16",
                   help="dtype workers keep: a floating dtype, or fp8 (e4m3, 128x128 block scales)")
    m.add_argument("--fp8-at", choices=("trainer", "receiver"), default="trainer",
                   help="fp8: quantize on the trainer (fp8 on the wire) or on the receiver")
    lay = p.add_argument_group("layout")
    lay.add_argument("--trainer-gpus", type=int, default=1, help="trainer ranks (FSDP2)")
    lay.add_argument("--trainer-shard", choices=("fsdp", "full"), default="fsdp",
                     help="fsdp: Shard(0) shards (default); full: every rank holds full tensors "
                          "(with --trainer-tp/--trainer-ep: its TP/EP shards, replicated over "
                          "data-parallel ranks, as Megatron)")
    lay.add_argument("--trainer-tp", type=int, default=1,
                     help="tensor parallel size of the trainer (ranks of a TP group consecutive)")
    lay.add_argument("--trainer-ep", type=int, default=0,
                     help="expert parallel groups of the trainer: a group is trainer-tp x "
                          "trainer-ep ranks, experts split over all of them (0: experts TP-split)")
    lay.add_argument("--replicas", type=int, default=1, help="rollout replicas")
    lay.add_argument("--tp", type=int, default=1, help="tensor parallel size of a replica")
    lay.add_argument("--ep", type=int, default=0,
                     help="expert parallel groups: a replica is tp x ep GPUs, experts whole and "
                          "split over all of them, attention TP-split in each group (0: experts "
                          "TP-split like dense layers)")
    lay.add_argument("--placement", choices=("nodes", "packed", "colocated"), default="nodes",
                     help="rollout on nodes of their own (default), on the next free GPUs "
                          "(packed), or on the trainer's GPUs (colocated: worker i on rank i's)")
    lk = p.add_argument_group("links and strategies")
    lk.add_argument("--links", default="h100-8gpu-400g", help="preset or YAML/JSON links file")
    lk.add_argument("--rollout-links", help="links of the rollout nodes (default: --links)")
    lk.add_argument("--link-set", type=_pair, action="append", default=[], metavar="PATH=VALUE",
                    help="override a field of both links files, e.g. links.nic.efficiency=0.89 "
                         "or software.read_us=1 (repeatable)")
    lk.add_argument("--strategies", default="p2p,broadcast,ring",
                    help="subset of p2p (nixl pull), broadcast (collective), ring (shm/cuda_ipc)")
    lk.add_argument("--bucket-mb", type=float, default=DEFAULT_BUCKET_SIZE / 2**20,
                    help="bucket size of broadcast/ring in MiB "
                         f"(default {DEFAULT_BUCKET_SIZE >> 20})")
    lk.add_argument("--num-slots", type=int, default=DEFAULT_NUM_SLOTS,
                    help="buckets of a trainer rank's ring (WEIGHTSYNC_NUM_SLOTS; default "
                         f"{DEFAULT_NUM_SLOTS}); a host ring (shm) stalls less on uneven "
                         "buckets with more")
    lk.add_argument("--max-read-mb", type=float, help="p2p: cap one READ (default: none)")
    lk.add_argument("--collective-direct-mb", type=float,
                    help="broadcast on a host links file (collective on CPU): tensors of at "
                         "least this many MiB go as their own broadcast, unpacked "
                         "(the engine's direct_min_bytes; default "
                         f"{COLLECTIVE_DIRECT_MIN >> 20}; 0: none)")
    lk.add_argument("--serve", choices=("auto", "staging"), default="auto",
                    help="p2p: where trainer ranks serve from (WEIGHTSYNC_NIXL_SERVE; "
                         "default auto: their own storage where no cast is needed)")
    lk.add_argument("--shared", choices=("none", "trainer", "receivers", "both"),
                    default="none",
                    help="ring on a host links file (shm): whose tensors live in torch shared "
                         "memory (model.share_memory()): none (default); trainer (shared read: "
                         "receivers copy direct tensors out of a mapping with memcpy); "
                         "receivers (push: the trainer writes every tensor into each "
                         "receiver's memory, no ring); both (push). Ring on a gpu links "
                         "file (cuda_ipc): trainer is zero-copy (receivers read the trainer's "
                         "tensors in place; WEIGHTSYNC_CUDA_IPC_ZERO_COPY), receivers or both "
                         "are pushes (the trainer writes into the receivers' tensors)")
    lk.add_argument("--trainer-device", choices=("cpu", "gpu"), default="cpu",
                    help="host links file only: cpu (default) or gpu (the trainer's tensors "
                         "are on a GPU of the host, copied device-to-host over links.d2h; "
                         "ring only)")
    lk.add_argument("--delta", type=float, metavar="FRACTION", default=None,
                    help="delta+<backend>: the fraction of each tensor's elements that "
                         "change between syncs (e.g. 0.005); the codec's records on the "
                         "wire, its encode and apply priced from links.codec (default: dense)")
    out = p.add_argument_group("output")
    out.add_argument("--label", default="", help="a title for the report")
    out.add_argument("--json", metavar="PATH", help="write the prediction as JSON ('-': stdout)")
    out.add_argument("--plot", metavar="PNG", help="write a plot (matplotlib)")
    fit = p.add_argument_group("fit a links file to your machine")
    fit.add_argument("--fit", metavar="BENCH_JSON",
                     help="write a links file from a 'weightsync bench --json' run: its "
                          "memcpy, memcpy-parallel, gloo-flat, nixl-raw, cma-raw and --tiny "
                          "rows set the rates they measured (no other input)")
    fit.add_argument("--out", metavar="PATH",
                     help="with --fit: the links file to write (default: stdout)")
    fit.add_argument("--base", default="cpu-2core",
                     help="with --fit: the host links preset or file every field the bench "
                          "did not measure comes from (default cpu-2core)")
    out.add_argument("--list-presets", action="store_true", help="list links and model presets")


def scenario_from_args(args: argparse.Namespace):
    from weightsync.tools.planner.errors import PlannerError
    from weightsync.tools.planner.links import load_links
    from weightsync.tools.planner.model import load_model
    from weightsync.tools.planner.scenario import Scenario
    if not args.model:
        raise PlannerError("model", "missing: give --model (see --list-presets)")
    if args.bucket_mb <= 0:
        raise PlannerError("bucket_size", f"must be > 0 MiB, got {args.bucket_mb}")
    if args.max_read_mb is not None and args.max_read_mb <= 0:
        raise PlannerError("max_read_bytes", f"must be > 0 MiB, got {args.max_read_mb}")
    if args.collective_direct_mb is not None and args.collective_direct_mb < 0:
        raise PlannerError("collective_direct_min",
                           f"must be >= 0 MiB, got {args.collective_direct_mb}")
    # the engine's direct size (the Scenario's default) unless given
    direct = {} if args.collective_direct_mb is None else \
        {"collective_direct_min": int(args.collective_direct_mb * 2**20)}
    sets = dict(args.link_set)
    links = load_links(args.links, sets)
    rlinks = load_links(args.rollout_links, sets) if args.rollout_links else None
    model = load_model(args.model, dict(args.set))
    bucket = int(args.bucket_mb * 2**20) // 256 * 256 or 256
    return Scenario(model=model, links=links, rollout_links=rlinks,
                    trainer_gpus=args.trainer_gpus, replicas=args.replicas, tp=args.tp,
                    ep=args.ep, src_dtype=args.src_dtype, dst_dtype=args.dst_dtype,
                    fp8_at=args.fp8_at, trainer_shard=args.trainer_shard,
                    trainer_tp=args.trainer_tp, trainer_ep=args.trainer_ep,
                    placement=args.placement, bucket_size=bucket, num_slots=args.num_slots,
                    max_read_bytes=int(args.max_read_mb * 2**20) if args.max_read_mb else None,
                    serve=args.serve,
                    shared=args.shared, trainer_device=args.trainer_device,
                    delta=args.delta, **direct,
                    strategies=tuple(s.strip() for s in args.strategies.split(",") if s.strip()),
                    label=args.label)


def _main(args: argparse.Namespace) -> int:
    from weightsync.tools.planner import links, model
    from weightsync.tools.planner.predict import predict
    from weightsync.tools.planner.report import format_table, plot, write_json
    if args.list_presets:
        print("links presets: " + ", ".join(links.preset_names()))
        print("model presets: " + ", ".join(model.model_presets()))
        return 0
    if args.fit:
        return _fit(args)
    doc = predict(scenario_from_args(args)).to_dict()
    doc["command"] = ("weightsync plan " + " ".join(sys.argv[2:])
                      if sys.argv[1:2] == ["plan"] else "")
    print(format_table(doc), file=sys.stderr if args.json == "-" else sys.stdout)
    if args.json:
        write_json(doc, args.json)
    if args.plot:
        plot(doc, args.plot)
    return 0


def _fit(args: argparse.Namespace) -> int:
    from weightsync.tools.planner.fit import fit_file
    doc = fit_file(args.fit, args.base)
    text = json.dumps(doc, indent=2) + "\n"
    summary = sys.stderr if not args.out or args.out == "-" else sys.stdout
    for field, got in doc["fitted"].items():
        unit = " GB/s" if field.endswith("GBps") else (" us" if field.endswith("_us") else "")
        rows = f"  ({got['method']}, median of {got['rows']} rows)" if got["rows"] else ""
        print(f"{field:<24} {got['value']:.4g}{unit}{rows}", file=summary)
    if not args.out or args.out == "-":
        sys.stdout.write(text)
    else:
        with open(args.out, "w") as f:
            f.write(text)
        print(f"wrote {args.out}: weightsync plan --links {args.out} ...", file=summary)
    return 0


def run(args: argparse.Namespace) -> int:
    from weightsync.tools.planner.errors import PlannerError
    try:
        return _main(args)
    except PlannerError as exc:
        print(f"weightsync plan: error: {exc}", file=sys.stderr)
        return 2
