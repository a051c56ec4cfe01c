"""What each rollout worker keeps of each tensor: the TP/EP slicing table, and FP8 blocks.

Owns :data:`TABLE` (name pattern -> rule, first match wins) and :func:`planned_tensors`,
which turns a model's tensors into :class:`PlannedTensor` s: per worker of one replica, the
boxes (a ``(start, stop)`` per dimension) it keeps, and the dtypes on each side. The
rules are vLLM's layer types, written down here (a planning tool does not run vLLM's
loaders): column-parallel q/k/v/gate/up split dim 0, row-parallel o/down split dim 1,
embeddings and lm_head split their (padded) vocab rows, k/v heads replicated when there
are fewer than ``tp``, norms/router/MLA ``*_a_proj`` replicated, MoE experts split over
the replica's ``tp x ep`` GPUs with expert parallelism (whole experts) or TP-split like
dense layers without it. Workers of a replica are numbered ``g = e * tp + t`` (EP group
``e``, TP rank ``t``).

FP8 (``dst_dtype="fp8"``): 2-D (and fused 3-D expert) linear weights become
``float8_e4m3fn`` with a float32 ``<name>_scale_inv`` of one scale per 128 x 128 block
(DeepSeek-V3's checkpoint layout); embeddings, lm_head, norms and the router stay in the
source dtype. A worker keeps the scale blocks its weight slice touches; a slice edge that
is not a multiple of 128 is noted (vLLM refuses such block-FP8 layouts).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from weightsync.core.plan import DTYPES, itemsize
from weightsync.tools.planner.errors import PlannerError
from weightsync.tools.planner.model import ModelSpec

__all__ = ["TABLE", "PlannedTensor", "planned_tensors", "kept_bytes", "rule_of", "FP8", "BLOCK"]

FP8, BLOCK, VOCAB_PAD = "float8_e4m3fn", 128, 64
Box = tuple[tuple[int, int], ...]

#: (name pattern, rule, what it is). First match wins; "unknown" is planned replicated.
TABLE: tuple[tuple[str, str, str], ...] = (
    (r"(embed_tokens|wte|word_embeddings|embed_in)\.weight$", "vocab",
     "VocabParallelEmbedding: rows of the vocab (padded to 64 x tp) split"),
    (r"(^|\.)(lm_head|embed_out)\.weight$", "vocab", "ParallelLMHead: vocab rows split"),
    (r"\.experts\.gate_up_proj$", "experts_gate_up",
     "fused experts [E, 2I, H]: EP: experts split; else the gate and up rows split (dim 1)"),
    (r"\.experts\.down_proj$", "experts_down",
     "fused experts [E, H, I]: EP: experts split; else dim 2 split"),
    (r"\.experts\.\d+\.(gate_proj|up_proj|w1|w3)\.weight$", "expert_column",
     "one expert's gate/up: EP: whole on its owner; else rows split"),
    (r"\.experts\.\d+\.(down_proj|w2)\.weight$", "expert_row",
     "one expert's down: EP: whole on its owner; else columns split"),
    (r"\.(k_proj|v_proj)\.(weight|bias)$", "kv",
     "QKVParallelLinear k/v: heads split; each head replicated when kv heads < tp"),
    (r"\.(q_proj|q_b_proj|kv_b_proj|gate_proj|up_proj|gate_up_proj|qkv_proj|query_key_value"
     r"|c_fc|fc1)\.(weight|bias)$", "column", "ColumnParallelLinear: dim 0 split"),
    (r"\.(o_proj|down_proj|dense|c_proj|fc2|out_proj)\.weight$", "row",
     "RowParallelLinear: dim 1 split"),
    (r"(norm|\.bias$|\.gate\.weight$|e_score_correction_bias|q_a_proj|kv_a_proj_with_mqa)",
     "replicated", "norms, row-parallel biases, router, MLA q_a/kv_a projections: full tensor"),
    (r".", "unknown", "not in the table: planned as the full tensor on every worker (noted)"),
)
_COMPILED = tuple((re.compile(p), rule) for p, rule, _ in TABLE)
_EXPERT_INDEX = re.compile(r"^(.*\.experts)\.(\d+)\.")
_QUANTIZED = {"column", "row", "kv", "experts_gate_up", "experts_down", "expert_column",
              "expert_row"}


@dataclass(frozen=True)
class PlannedTensor:
    """One tensor as the plan sees it: served as ``src_dtype``, kept as ``dst_dtype``;
    ``boxes[g]``: the boxes worker ``g`` of a replica keeps (empty: nothing); ``held[g]``:
    the boxes trainer rank ``g`` of a tensor-/expert-parallel group holds (None: every
    rank's is the whole tensor before data-parallel sharding)."""

    name: str
    shape: tuple[int, ...]
    rule: str
    src_dtype: str
    dst_dtype: str
    boxes: tuple[tuple[Box, ...], ...]
    held: tuple[tuple[Box, ...], ...] | None = None


def rule_of(name: str) -> str:
    return next(rule for pat, rule in _COMPILED if pat.search(name))


def _split(n: int, parts: int, index: int, name: str, dim: int, field: str) -> tuple[int, int]:
    if n % parts:
        raise PlannerError(field, f"{name}: dim {dim} ({n}) is not divisible by {parts}")
    step = n // parts
    return index * step, (index + 1) * step


def _on(shape: tuple[int, ...], dim: int, span: tuple[int, int]) -> Box:
    return tuple(span if d == dim else (0, n) for d, n in enumerate(shape))


def _boxes(pt_name: str, shape: tuple[int, ...], rule: str, g: int, tp: int, ep: int,
           model: ModelSpec, experts: dict[str, int], side: str = "rollout") -> tuple[Box, ...]:
    """The boxes worker ``g`` keeps (see the module doc); ``side``: whose layout it is
    (``rollout``, or ``trainer`` for a tensor-/expert-parallel trainer rank's shard),
    named in the errors."""
    t, n_ep = g % tp, tp * max(ep, 1)
    full = tuple((0, n) for n in shape)
    if rule in ("replicated", "unknown") or not shape:
        return (full,)
    if rule == "vocab":
        padded = -(-shape[0] // (VOCAB_PAD * tp)) * VOCAB_PAD * tp
        per = padded // tp
        a, b = min(t * per, shape[0]), min((t + 1) * per, shape[0])
        return (_on(shape, 0, (a, b)),) if b > a else ()
    if rule in ("experts_gate_up", "experts_down") and ep:
        return (_on(shape, 0, _split(shape[0], n_ep, g, pt_name, 0, f"{side}.ep")),)
    if rule in ("expert_column", "expert_row") and ep:
        m = _EXPERT_INDEX.match(pt_name)
        count = experts[m.group(1)]
        if count % n_ep:
            raise PlannerError(f"{side}.ep", f"{m.group(1)}: {count} experts are not "
                                             f"divisible by tp x ep = {n_ep}")
        return (full,) if int(m.group(2)) // (count // n_ep) == g else ()
    if rule == "experts_gate_up":
        half = shape[1] // 2
        a, b = _split(half, tp, t, pt_name, 1, f"{side}.tp")
        return (_on(shape, 1, (a, b)), _on(shape, 1, (half + a, half + b)))
    if rule == "experts_down":
        return (_on(shape, 2, _split(shape[2], tp, t, pt_name, 2, f"{side}.tp")),)
    if rule == "kv" and model.kv_heads and model.kv_heads >= tp and model.kv_heads % tp:
        raise PlannerError(f"{side}.tp", f"{pt_name}: {model.kv_heads} kv heads are not "
                                         f"divisible by tp {tp}")
    if rule == "kv" and model.kv_heads and model.kv_heads < tp:
        if tp % model.kv_heads:
            raise PlannerError(f"{side}.tp", f"{pt_name}: {model.kv_heads} kv heads: tp {tp} "
                                             "is not a multiple of them")
        head = t // (tp // model.kv_heads)
        rows = shape[0] // model.kv_heads
        return (_on(shape, 0, (head * rows, (head + 1) * rows)),)
    if rule in ("column", "kv", "expert_column"):
        return (_on(shape, 0, _split(shape[0], tp, t, pt_name, 0, f"{side}.tp")),)
    if rule in ("row", "expert_row") and len(shape) >= 2:
        return (_on(shape, 1, _split(shape[1], tp, t, pt_name, 1, f"{side}.tp")),)
    return (full,)


def _scale_boxes(shape: tuple[int, ...], boxes: tuple[Box, ...], notes: set) -> tuple[Box, ...]:
    out = []
    for box in boxes:
        lead, tail = box[:-2], []
        for (a, b), n in zip(box[-2:], shape[-2:]):
            if a % BLOCK or (b % BLOCK and b != n):
                notes.add(f"slice [{a}, {b}) of a dim of {n} is not a multiple of the "
                          f"{BLOCK}-block: boundary scales are read by two workers (vLLM "
                          "refuses block-FP8 layouts like this)")
            tail.append((a // BLOCK, -(-b // BLOCK)))
        out.append(tuple(lead) + tuple(tail))
    return tuple(out)


def _scale_name(name: str) -> str:
    return name + "_scale_inv"      # x.weight -> x.weight_scale_inv, as DeepSeek-V3's files


def _check(tp: int, ep: int, src: str, dst: str) -> None:
    if not isinstance(tp, int) or tp < 1:
        raise PlannerError("rollout.tp", f"must be an integer >= 1, got {tp!r}")
    if not isinstance(ep, int) or ep < 0:
        raise PlannerError("rollout.ep", f"must be an integer >= 0, got {ep!r}")
    if src not in DTYPES or not DTYPES[src].is_floating_point:
        raise PlannerError("dtype.src", f"unknown floating dtype {src!r}")
    if dst != "fp8" and (dst not in DTYPES or not DTYPES[dst].is_floating_point):
        raise PlannerError("dtype.dst", f"must be a floating dtype or 'fp8', got {dst!r}")


def planned_tensors(model: ModelSpec, tp: int, ep: int, src_dtype: str, dst_dtype: str,
                    fp8_at: str = "trainer", trainer_tp: int = 1, trainer_ep: int = 0
                    ) -> tuple[list[PlannedTensor], list[str]]:
    """Every tensor (and FP8 scale) with what each worker of one replica keeps and, with
    ``trainer_tp``/``trainer_ep``, what each trainer rank of a TP x EP group holds (the
    same table: Megatron's column/row-parallel splits are vLLM's); notes."""
    _check(tp, ep, src_dtype, dst_dtype)
    if not isinstance(trainer_tp, int) or trainer_tp < 1:
        raise PlannerError("trainer.tp", f"must be an integer >= 1, got {trainer_tp!r}")
    if not isinstance(trainer_ep, int) or trainer_ep < 0:
        raise PlannerError("trainer.ep", f"must be an integer >= 0, got {trainer_ep!r}")
    holders = range(trainer_tp * max(trainer_ep, 1))
    if fp8_at not in ("trainer", "receiver"):
        raise PlannerError("dtype.fp8_at", f"must be 'trainer' or 'receiver', got {fp8_at!r}")
    experts: dict[str, int] = {}
    for name, _ in model.tensors:
        m = _EXPERT_INDEX.match(name)
        if m:
            experts[m.group(1)] = max(experts.get(m.group(1), 0), int(m.group(2)) + 1)
    out, unknown, scale_notes = [], [], set()
    workers = range(tp * max(ep, 1))
    for name, shape in model.tensors:
        rule = rule_of(name)
        unknown += [name] if rule == "unknown" else []
        boxes = tuple(_boxes(name, shape, rule, g, tp, ep, model, experts) for g in workers)
        held = None if len(holders) == 1 else tuple(
            _boxes(name, shape, rule, g, trainer_tp, trainer_ep, model, experts, "trainer")
            for g in holders)
        fp8 = dst_dtype == "fp8" and rule in _QUANTIZED and len(shape) >= 2
        fp8 = fp8 or (dst_dtype == "fp8" and rule == "replicated" and len(shape) == 2
                      and not name.endswith(".gate.weight"))
        dst = FP8 if fp8 else (src_dtype if dst_dtype == "fp8" else dst_dtype)
        src = FP8 if fp8 and fp8_at == "trainer" else src_dtype
        out.append(PlannedTensor(name, shape, rule, src, dst, boxes, held))
        if fp8 and fp8_at == "trainer":
            sshape = shape[:-2] + tuple(-(-n // BLOCK) for n in shape[-2:])
            sboxes = tuple(_scale_boxes(shape, b, scale_notes) for b in boxes)
            sheld = None if held is None else tuple(_scale_boxes(shape, b, scale_notes)
                                                    for b in held)
            out.append(PlannedTensor(_scale_name(name), sshape, rule + "_scale", "float32",
                                     "float32", sboxes, sheld))
    notes = sorted(scale_notes)
    if unknown:
        notes.append(f"{len(unknown)} tensor(s) not in the slicing table, planned as full "
                     f"copies on every worker: {', '.join(unknown[:5])}"
                     f"{' ...' if len(unknown) > 5 else ''}")
    return out, notes


def kept_bytes(pt: PlannedTensor, g: int) -> int:
    """Bytes worker ``g`` keeps of ``pt`` (its dtype), FP8 scales of receiver casts included."""
    n = sum(math.prod(b - a for a, b in box) for box in pt.boxes[g])
    extra = 0
    if pt.dst_dtype == FP8 and pt.src_dtype != FP8:      # scales made on the receiver
        extra = sum(math.prod(-(-(b - a) // BLOCK) for a, b in box[-2:]) *
                    math.prod(b - a for a, b in box[:-2]) for box in pt.boxes[g]) * 4
    return n * itemsize(pt.dst_dtype) + extra
