"""Fewer bytes on the wire, on every transport: delta updates and FP8 on the fly.

This package owns the codec layer, which sits above every transport backend:

* :mod:`.engine`: :class:`CodecEngine`, an engine that wraps another backend's engine and
  keeps the engine contract; registered as ``delta+<b>``, ``fp8+<b>``, ``delta+fp8+<b>``
  for ``b`` in inproc, shm, collective, cuda_ipc, nixl (lazily, :mod:`.wrapped`);
* :mod:`.sender` / :mod:`.receiver`: one sync on each side (rounds, resends);
* :mod:`.state`: what each side keeps between syncs (base copies, held ids) and one
  sync's encode;
* :mod:`.delta`: delta records (changed positions + values, a change digest) and their
  checked in-place application; :mod:`.kernels`: the same work on the host (numpy);
  :mod:`.gpu`: on a GPU, as device kernels over many tensors per launch;
* :mod:`.fp8`: block (128 x 128, ``weight_scale_inv``) and per-tensor FP8 quantization;
* :mod:`.control`: the small per-sync control exchange; :mod:`.options`: options + env.

The codec names are registered with the registry by :mod:`weightsync.transport` itself
(lazily: nothing here is imported until a name is asked for).
"""

from weightsync.transport.codec.engine import (CodecEngine, PREFIXES, carry_codec_state,
                                               codec_backend_name, codec_options, resolve_backend,
                                               split_backend_name)
from weightsync.transport.codec.fp8 import Quantizer
from weightsync.transport.codec.options import CodecOptions

__all__ = ["CodecEngine", "CodecOptions", "Quantizer", "codec_backend_name", "INNER_BACKENDS",
           "codec_names", "codec_options", "carry_codec_state", "resolve_backend", "split_backend_name"]

INNER_BACKENDS = ("inproc", "shm", "collective", "cuda_ipc", "nixl")


def codec_names() -> list[str]:
    """Every codec backend name (registered or not yet loaded)."""
    return [f"{p}+{b}" for b in INNER_BACKENDS for p in PREFIXES]
