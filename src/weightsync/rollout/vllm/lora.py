"""LoRA adapters into vLLM from memory: no PEFT folder is written.

vLLM (0.32) loads an adapter only from a directory: ``add_lora(LoRARequest(name, id,
path))`` reaches each worker's ``WorkerLoRAManager._load_adapter``, which reads
``adapter_config.json`` and ``adapter_model.safetensors`` from ``path`` and builds a
``LoRAModel`` with ``LoRAModel.from_lora_tensors``. This module keeps received adapters
in the worker process (:func:`register`, under a name and a version) and makes
``_load_adapter`` build the ``LoRAModel`` from those tensors when the request's path is
one of :func:`memory_path`'s (``weightsync-mem:<name>@<version>``) — the same steps as
vLLM's own loader (``PEFTHelper`` from the config, ``validate_legal`` against
``max_lora_rank``, the model's weight-name mapper and skipped prefixes, the unexpected
module check, the ``LoRAModel`` validations) minus the file reads. Every other path goes
to vLLM's loader as before. :func:`install` patches the class once per process; the
weightsync vLLM plugin calls it in every vLLM process, the worker extension too.

So an adapter is loaded through vLLM's ordinary ``add_lora`` (offline) or
``/v1/load_lora_adapter`` (``vllm serve``, ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``) with the
memory path, and vLLM's LoRA manager (its CPU cache, eviction, ``load_inplace``) works as
for a folder. A version is registered only once all its tensors arrived and were checked,
and vLLM's ``load_inplace`` loads the new ``LoRAModel`` before it drops the old one, so
the old adapter serves until the new one is complete. The last :data:`KEEP` registered
versions stay resolvable (an adapter vLLM evicted from its cache is rebuilt from them).

Relies on vLLM 0.32.0's internals: ``vllm.lora.worker_manager.WorkerLoRAManager.
_load_adapter(lora_request)`` (and its attributes ``_adapter_manager``, ``lora_config``,
``max_position_embeddings``, ``vocab_size``, ``_lora_model_cls``), ``vllm.lora.
peft_helper.PEFTHelper.from_dict`` / ``validate_legal``, ``vllm.lora.lora_model.LoRAModel.
from_lora_tensors`` and ``vllm.lora.utils.parse_fine_tuned_lora_name``. :func:`install`
checks they are there and says so when they are not.
"""

from __future__ import annotations

import collections
import functools
import logging
import threading
from typing import Any, Optional

import torch

from weightsync.core.errors import PlanMismatch

__all__ = ["SCHEME", "KEEP", "memory_path", "register", "lookup", "install", "installed",
           "adapter_digests"]

logger = logging.getLogger(__name__)

#: The ``lora_path`` prefix of an adapter held in memory.
SCHEME = "weightsync-mem:"
#: How many registered versions stay resolvable in a process.
KEEP = 8
_MARK = "_weightsync_memory_adapters"
_lock = threading.Lock()
_held: "collections.OrderedDict[str, tuple[dict, dict]]" = collections.OrderedDict()


def memory_path(name: str, version: Any) -> str:
    """The ``lora_path`` under which adapter ``name`` at ``version`` is held."""
    if not isinstance(name, str) or not name or "@" in name:
        raise ValueError(f"an adapter name is a non-empty str without '@', got {name!r}")
    return f"{SCHEME}{name}@{version}"


def register(name: str, version: Any, tensors: dict[str, torch.Tensor], config: dict,
             keep: int = KEEP) -> str:
    """Hold an adapter's tensors (PEFT names: ``...lora_A.weight`` / ``lora_B.weight``) and
    its PEFT config in this process; returns its :func:`memory_path`. The oldest versions
    beyond ``keep`` are dropped."""
    if not tensors:
        raise PlanMismatch("an adapter sync delivered no tensors", phase="receive",
                           version=version)
    bad = [n for n in tensors if ".lora_A." not in n and ".lora_B." not in n
           and "lora_embedding_" not in n]
    if bad:
        raise PlanMismatch(f"an adapter sync carries non-LoRA tensors: {sorted(bad)[:5]}",
                           phase="receive", version=version)
    if not isinstance(config, dict) or "r" not in config:
        raise ValueError("an adapter needs its PEFT config (a dict with 'r', 'lora_alpha', "
                         "'target_modules', ...)")
    path = memory_path(name, version)
    with _lock:
        _held.pop(path, None)
        _held[path] = (dict(tensors), {"peft_type": "LORA", **config})
        while len(_held) > max(1, int(keep)):
            _held.popitem(last=False)
    return path


def lookup(path: str) -> Optional[tuple[dict, dict]]:
    """``(tensors, config)`` held under ``path``, or None."""
    with _lock:
        return _held.get(path)


def adapter_digests(path: str) -> dict:
    """Digests and wire dtypes of the adapter held under ``path`` (for ``verify``)."""
    from weightsync.core.digests import tensor_digest
    from weightsync.core.plan import dtype_name

    held = lookup(path)
    if held is None:
        raise KeyError(f"no adapter is held in memory under {path!r}")
    tensors = held[0]
    return {"digests": {n: tensor_digest(t) for n, t in tensors.items()},
            "dtypes": {n: dtype_name(t.dtype) for n, t in tensors.items()}}


def installed() -> bool:
    try:
        from vllm.lora.worker_manager import WorkerLoRAManager
    except ImportError:
        return False
    return bool(getattr(WorkerLoRAManager._load_adapter, _MARK, False))


def install() -> bool:
    """Make vLLM's worker LoRA manager resolve memory paths (idempotent); True if done
    now. Raises ``RuntimeError`` when this vLLM lacks the internals it relies on."""
    try:
        from vllm.lora.lora_model import LoRAModel
        from vllm.lora.peft_helper import PEFTHelper
        from vllm.lora.worker_manager import WorkerLoRAManager
    except ImportError as exc:
        raise RuntimeError(f"weightsync's in-memory LoRA loading needs vLLM's "
                           f"vllm.lora.worker_manager / peft_helper / lora_model ({exc})") from None
    original = WorkerLoRAManager._load_adapter
    if getattr(original, _MARK, False):
        return False
    if not hasattr(LoRAModel, "from_lora_tensors") or not hasattr(PEFTHelper, "from_dict"):
        raise RuntimeError("weightsync's in-memory LoRA loading needs vLLM's "
                           "LoRAModel.from_lora_tensors and PEFTHelper.from_dict (vLLM 0.32)")

    @functools.wraps(original)
    def _load_adapter(self: Any, lora_request: Any) -> Any:
        path = str(getattr(lora_request, "lora_path", ""))
        if not path.startswith(SCHEME):
            return original(self, lora_request)
        return _from_memory(self, lora_request, path)

    setattr(_load_adapter, _MARK, True)
    WorkerLoRAManager._load_adapter = _load_adapter
    return True


def _expected_modules(manager: Any) -> set:
    """The module names an adapter may target (as vLLM's ``_load_adapter`` lists them)."""
    adapter_manager = manager._adapter_manager
    packed = adapter_manager.packed_modules_mapping
    out: list = []
    for module in adapter_manager.supported_lora_modules:
        out.extend(packed[module] if module in packed else [module])
        if module == "experts":
            out.append(module)
    return set(out)


def _from_memory(manager: Any, lora_request: Any, path: str) -> Any:
    """vLLM's ``_load_adapter`` with the tensors and config held under ``path``."""
    from vllm.lora.peft_helper import PEFTHelper
    from vllm.lora.utils import is_base_embedding_weights, parse_fine_tuned_lora_name

    held = lookup(path)
    if held is None:
        from vllm.exceptions import LoRAAdapterNotFoundError

        raise LoRAAdapterNotFoundError(lora_request.lora_name, f"{path} (weightsync holds only "
                                       f"the last {KEEP} adapter versions in memory)")
    tensors, config = held
    adapter_manager = manager._adapter_manager
    if getattr(adapter_manager, "moe_ep_load_spec", None) is not None:
        raise NotImplementedError("weightsync's in-memory LoRA loading does not cover "
                                  "expert-parallel MoE adapters; load those from a folder")
    peft_helper = PEFTHelper.from_dict({**config, "vllm_max_position_embeddings":
                                        manager.max_position_embeddings})
    peft_helper.validate_legal(manager.lora_config)
    model = adapter_manager.model
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    if mapper is not None:
        mapper = mapper.get_rename_mapper()
    skip = getattr(model, "lora_skip_prefixes", None)
    expected = _expected_modules(manager)
    unexpected = []
    for name in tensors:
        if is_base_embedding_weights(name) or "base_layer" in name:
            continue
        module, _ = parse_fine_tuned_lora_name(name, mapper)
        base = module.rsplit(".", 1)[-1]
        if ".experts" in module:
            base = module[module.find(".experts") + 1:]
        if base not in expected and base not in (peft_helper.modules_to_save or ()):
            unexpected.append(module)
    if unexpected:
        raise ValueError(f"While loading {path}, expected target modules in {expected} but "
                         f"received {unexpected}. Please verify that the loaded LoRA module "
                         "is correct")
    # copies: vLLM's LoRA manager scales lora_B in place when it activates the adapter,
    # and the held tensors must stay as received (a rebuild after an eviction, verify)
    lora = manager._lora_model_cls.from_lora_tensors(
        lora_model_id=lora_request.lora_int_id,
        tensors={n: t.clone() for n, t in tensors.items()}, peft_helper=peft_helper,
        device="cpu", dtype=manager.lora_config.lora_dtype, model_vocab_size=manager.vocab_size,
        weights_mapper=mapper, skip_prefixes=skip)
    lora.is_3d_lora_weight = getattr(lora_request, "is_3d_lora_weight", False)
    adapter_manager._validate_moe_lora_format(lora)
    adapter_manager._validate_modules_to_save(lora)
    adapter_manager._validate_token_classification_lora(lora)
    logger.info("weightsync: LoRA adapter %r (id %d) built from memory (%s, %d tensors)",
                lora_request.lora_name, lora_request.lora_int_id, path, len(tensors))
    return lora
