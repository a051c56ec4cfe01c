"""Validation before bytes and weight digests for the vLLM replica.

*Check* (``check_weights``): each vLLM worker checks the trainer's description of a
weight set (``[name, shape, dtype]`` per tensor, no bytes) against the checkpoint the
model was started from (its safetensors headers, read at start): names, shapes, and
dtypes castable into the dtype vLLM holds them in (floating tensors in the model dtype),
with the same rules as the HF replica (:func:`weightsync.core.digests.check_weight_set`);
a full or base weight set must cover every checkpoint tensor. Adapter tensors must be
``lora_A [r, in]`` / ``lora_B [out, r]`` of a 2-D checkpoint weight, ``r`` within vLLM's
``max_lora_rank``. Nothing is loaded or changed.

*Digests* (``weight_digests``): vLLM fuses and repacks weights (q/k/v, gate/up, CPU
packing), so the HF tensors cannot be read back from the model. Instead, each worker
hashes every tensor of a sync as it hands it to vLLM's loader (cast to the dtype vLLM
holds it in, with :func:`weightsync.core.digests.tensor_digest`, as the trainer side of
``verify`` hashes) and keeps the map of the last *complete* version. So ``verify`` proves
that the loader received exactly the trainer's weights; it does not read the repacked
parameters in memory. Where it is exact, live parameters are hashed too: parameters of
modules that are not linear layers (embeddings, norms) whose live bytes equalled the
received ones right after the load are hashed again at every ``verify``, so a later
change of those in memory is caught. Adapter tensors are hashed in the workers, from the
copy each holds in memory (:mod:`weightsync.rollout.vllm.lora`).

The functions run in the vLLM workers (called by :mod:`.extension`); :class:`VLLMChecks`
runs in the driver (mixed into :class:`~weightsync.rollout.vllm.VLLMRolloutReplica`).
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional, Sequence

import torch

from weightsync.core.errors import WeightSyncError
from weightsync.core.digests import check_weight_set, tensor_digest
from weightsync.core.plan import dtype_name
from weightsync.rollout.protocol import WEIGHT_KINDS, SyncFence

__all__ = ["normalize_offered", "merge_problems", "check_offered", "calibrate_live", "live_digests",
           "adapter_digests", "VLLMChecks"]

logger = logging.getLogger(__name__)
_ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
              "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32,
              "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}
_PEFT_PREFIX = "base_model.model."
_LORA_PARTS = (".lora_A.weight", ".lora_B.weight")


# -- in a vLLM worker ------------------------------------------------------------------------
def _held(code: str, float_dtype: torch.dtype) -> torch.dtype:
    dt = _ST_DTYPES.get(code)
    return float_dtype if dt is None or dt.is_floating_point else dt


def check_offered(header: dict, offered: list, kind: str, float_dtype: torch.dtype,
                  max_lora_rank: Optional[int]) -> list[list[str]]:
    """Problems (``[name, why]``) of loading ``offered`` as ``kind`` into a model started
    from a checkpoint with ``header`` (``{name: (shape, safetensors dtype)}``)."""
    if kind == "adapter":
        return _check_adapter(header, offered, max_lora_rank)
    targets = {n: torch.empty(shape, dtype=_held(code, float_dtype), device="meta")
               for n, (shape, code) in header.items()}
    return check_weight_set(targets, offered, complete=True)


def _check_adapter(header: dict, offered: list, max_rank: Optional[int]) -> list[list[str]]:
    problems = []
    for entry in offered:
        if not (isinstance(entry, (list, tuple)) and len(entry) == 3):
            raise ValueError(f"bad weight description {entry!r}: want [name, shape, dtype]")
        name, shape, dtype = entry
        part = next((p for p in _LORA_PARTS if name.endswith(p)), None)
        path = name[len(_PEFT_PREFIX):] if name.startswith(_PEFT_PREFIX) else name
        base = header.get(path[: -len(part)] + ".weight") if part else None
        if base is None or len(base[0]) != 2:
            problems.append([name, "not a LoRA tensor of a 2-D weight of the model"])
            continue
        out_f, in_f = base[0]
        a = part == ".lora_A.weight"
        rank = shape[0] if a and len(shape) == 2 else (shape[1] if len(shape) == 2 else None)
        if len(shape) != 2 or shape[1 if a else 0] != (in_f if a else out_f):
            problems.append([name, f"shape {tuple(shape)} does not fit the weight "
                                   f"({out_f}, {in_f})"])
        elif max_rank is not None and rank > max_rank:
            problems.append([name, f"rank {rank} exceeds vLLM's max_lora_rank {max_rank}"])
        elif not str(dtype).startswith(("float", "bfloat")):
            problems.append([name, f"dtype {dtype} sent, LoRA tensors are floating point"])
    return problems


def _live_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Parameters of modules that are not linear layers, under their HF names."""
    from vllm.model_executor.layers.linear import LinearBase

    out = {}
    for mod_name, module in model.named_modules():
        if isinstance(module, LinearBase):
            continue
        for pname, p in module.named_parameters(recurse=False):
            full = f"{mod_name}.{pname}" if mod_name else pname
            out[full.replace(".base_layer.", ".")] = p
    return out


def _live_digest(p: torch.Tensor, shape: Sequence[int], dtype: str) -> Optional[str]:
    if dtype_name(p.dtype) != dtype or p.dim() != len(shape) or p.device.type == "meta":
        return None
    if tuple(p.shape) != tuple(shape):          # vocab rows padded past the checkpoint's
        if not shape or p.shape[0] < shape[0] or tuple(p.shape[1:]) != tuple(shape[1:]):
            return None
        p = p[: shape[0]]
    with torch.no_grad():
        return tensor_digest(p)


def live_digests(model: torch.nn.Module, names: Sequence[str], manifest: dict,
                 dtypes: dict) -> dict[str, str]:
    """Digests of the live parameters ``names`` (HF names; those that cannot be read
    back exactly any more are left out)."""
    params, out = _live_params(model), {}
    for name in names:
        p = params.get(name)
        d = None if p is None else _live_digest(p, manifest[name], dtypes[name])
        if d is not None:
            out[name] = d
    return out


def calibrate_live(model: torch.nn.Module, digests: dict, manifest: Optional[dict],
                   dtypes: dict) -> list[str]:
    """Names whose live parameter right after a load hashes like the received tensor
    (so hashing it later is an exact check of what is in memory)."""
    if not manifest:
        return []
    names = [n for n in _live_params(model) if n in digests and n in manifest]
    live = live_digests(model, names, manifest, dtypes)
    return sorted(n for n, d in live.items() if d == digests[n])


# -- in the driver ----------------------------------------------------------------------------
def normalize_offered(offered: Any) -> list:
    """A weight description (``[[name, shape, dtype], ...]``) in plain types, or a
    ``ValueError``."""
    if not isinstance(offered, (list, tuple)):
        raise ValueError("offered must be a list of [name, shape, dtype], got "
                         f"{offered!r:.200}")
    bad = [e for e in offered if not (isinstance(e, (list, tuple)) and len(e) == 3)]
    if bad:
        raise ValueError(f"bad weight description {bad[0]!r:.200}: want [name, shape, dtype]")
    return [[str(n), [int(d) for d in s], str(dt)] for n, s, dt in offered]


def adapter_digests(replies: Sequence, who: str, path: str, version: Any) -> dict:
    """``weight_digests("adapter")`` from every vLLM worker's digests of the adapter it holds
    under ``path``: they must agree."""
    first = replies[0]
    if any(r["digests"] != first["digests"] for r in replies[1:]):
        raise WeightSyncError(f"{who}: the vLLM workers hold different adapters under {path}",
                              phase="verify", version=version)
    return {"digests": dict(first["digests"]), "dtypes": dict(first["dtypes"]),
            "version": version, "live": []}


def merge_problems(replies: Sequence) -> list:
    """The workers' ``[name, why]`` problems, each once, in order."""
    problems, seen = [], set()
    for reply in replies:
        for name, why in reply:
            if (name, why) not in seen:
                seen.add((name, why))
                problems.append([name, why])
    return problems


class VLLMChecks:
    """The replica's optional hooks ``check_weights`` and ``weight_digests`` (mixed into
    ``VLLMRolloutReplica``; ``begin_sync``, ``fence``, ``sync_state`` come with
    :class:`~weightsync.rollout.protocol.ReplicaControls`)."""

    # provided by VLLMDriver / VLLMRolloutReplica
    name: str
    sleep_mode: bool
    weights_asleep: bool
    _fence: SyncFence
    _base_version: Any
    _lora_request: Any
    _rpc: Callable[..., list]
    current_version: Callable[[], Any]

    def check_weights(self, offered: list, *, kind: str = "full",
                      adapter_config: Optional[dict] = None) -> list[list[str]]:
        """Problems (``[name, why]``) of loading ``offered`` ([name, shape, dtype] per
        tensor) as ``kind``, checked in every vLLM worker; nothing is changed."""
        if kind not in WEIGHT_KINDS:
            raise ValueError(f"kind must be one of {WEIGHT_KINDS}, got {kind!r}")
        offered = normalize_offered(offered)
        return merge_problems(self._rpc("weightsync_check", offered, kind, phase="validate"))

    def weight_digests(self, kind: str = "full") -> dict:
        """``{"digests": {name: xxh3}, "dtypes": {name: dtype}, "version", "live"}``: the
        digests of what vLLM's loader received in the last complete sync (see the module
        docstring: not the repacked parameters), live-parameter digests (``live``: their
        names) where exact, or of the active adapter's tensors for ``kind="adapter"``."""
        if kind not in WEIGHT_KINDS:
            raise ValueError(f"kind must be one of {WEIGHT_KINDS}, got {kind!r}")
        version = self.current_version()
        if self._fence.blocked:
            raise WeightSyncError(f"{self.name} holds no complete version: "
                                  f"{self._fence.blocked}", phase="verify", version=version)
        if kind == "adapter":
            return self._adapter_digests(version)
        if self.sleep_mode and self.weights_asleep:
            raise WeightSyncError(f"{self.name} is asleep; wake_up before verify",
                                  phase="verify", version=version)
        replies = self._rpc("weightsync_digests", phase="verify", version=version)
        base = self._base_version
        for r in replies:
            if str(r["version"]) != str(base):
                raise WeightSyncError(f"{self.name}: the vLLM worker's digests are of "
                                      f"version {r['version']!r}, the replica loaded {base!r}",
                                      phase="verify", version=version)
        digests: dict[str, str] = {}
        dtypes: dict[str, str] = {}
        # tensor parallel: a tensor each worker received whole, under its name (all must
        # agree); or the boxes each one kept of it, under their box keys
        for r in replies:
            dtypes.update(r["dtypes"])
            for name, d in {**r["digests"], **r["live"]}.items():
                if digests.setdefault(name, d) != d:
                    digests[name] = "workers-disagree"
        live = sorted(set.intersection(*(set(r["live"]) for r in replies)))
        return {"digests": digests, "dtypes": dtypes, "version": version, "live": live}

    def _adapter_digests(self, version: Any) -> dict:
        request = self._lora_request
        if request is None:
            raise WeightSyncError(f"{self.name} has no LoRA adapter to verify",
                                  phase="verify", version=version)
        replies = self._rpc("weightsync_adapter_digests", request.lora_path, phase="verify",
                            version=version)
        return adapter_digests(replies, self.name, request.lora_path, version)
