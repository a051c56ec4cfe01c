"""``GRPOTrainer``'s server mode through weightsync: a ``VLLMClient`` that syncs with it.

TRL 1.16's trainers that generate with a ``vllm serve`` process (``GRPOTrainer``,
``RLOOTrainer`` and the others built on ``trl.generation.vllm_generation.VLLMGeneration``)
make a ``trl.generation.vllm_client.VLLMClient``, call ``init_communicator(device)`` once
(an NCCL group; it raises ``NotImplementedError`` off CUDA) and then, every step,
``update_named_params(metadata, named_params)`` and ``reset_prefix_cache()``.
:func:`patch_vllm_client` puts :class:`WeightsyncVLLMClient` in its place (the names
``VLLMClient`` of ``trl.generation.vllm_client``, ``trl.generation.vllm_generation`` and of
any TRL module already imported that holds TRL's class), so the unchanged trainer syncs
through weightsync, on CPU as on GPU::

    from weightsync.integrations.trl import patch_vllm_client
    patch_vllm_client()                      # before the trainer is built
    trainer = GRPOTrainer(..., args=GRPOConfig(use_vllm=True, vllm_mode="server", ...))

with the server started as
``VLLM_SERVER_DEV_MODE=1 vllm serve <model> --weight-transfer-config '{"backend": "weightsync-shm"}'``.
Generation, ``/reset_prefix_cache`` and everything else stay TRL's own code. Each
``update_named_params`` is one complete weight version (see :mod:`.sync`); a sync made of
single ``update_named_param`` calls (TRL's ``weight_update()`` block) cannot be checked as a
whole and is refused with an error saying so.
"""

from __future__ import annotations

import atexit
import contextlib
import sys
from typing import Any, Iterator, Optional

import torch

from weightsync.integrations.trl.sync import ServerSync, SyncOptions

__all__ = ["WeightsyncVLLMClient", "patch_vllm_client", "unpatch_vllm_client"]

_TARGETS = ("trl.generation.vllm_client", "trl.generation.vllm_generation")
_PATCHED: dict[str, Any] = {}       # module name -> the class it held before


def _trl_client() -> type:
    from trl.generation.vllm_client import VLLMClient

    return _PATCHED.get("trl.generation.vllm_client", VLLMClient)


def _make_class() -> type:
    base = _trl_client()

    class WeightsyncVLLMClient(base):  # type: ignore[misc, valid-type]
        """TRL's ``VLLMClient`` whose weight sync goes through weightsync (see the
        module docstring); ``sync_options`` (a :class:`~.sync.SyncOptions`) is set by
        :func:`patch_vllm_client` or by a subclass."""

        sync_options: SyncOptions = SyncOptions()

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.sync: Optional[ServerSync] = None

        def init_communicator(self, device: Any = 0) -> None:
            """Join the server's workers through weightsync (any device; ``device`` is
            where TRL's tensors live, which the transport handles)."""
            self.sync = ServerSync(self.base_url, self.sync_options)
            self.sync.connect()
            atexit.register(self.close_communicator)

        def update_named_params(self, metadata: list, named_params: Iterator) -> None:
            """One complete weight version: ``metadata`` is ``[(name, dtype, shape)]``,
            ``named_params`` yields the tensors in that order."""
            if self.sync is None:
                raise RuntimeError("weightsync: init_communicator() first")
            self.sync.send(metadata, named_params)

        def update_model_params(self, model: torch.nn.Module) -> None:
            params = list(model.named_parameters())
            self.update_named_params(
                [(n, str(p.dtype).removeprefix("torch."), list(p.shape)) for n, p in params],
                ((n, p.data) for n, p in params))

        def update_named_param(self, name: str, weights: torch.Tensor) -> None:
            raise NotImplementedError(
                "weightsync syncs a whole weight version at once (checked against the "
                "model, applied completely or not at all); one parameter is not a version. "
                "Use update_named_params(metadata, pairs) or update_model_params(model)")

        @contextlib.contextmanager
        def weight_update(self) -> Iterator[None]:
            raise NotImplementedError(
                "weightsync syncs a whole weight version per update_named_params call; "
                "a weight_update() block of single parameters is not supported")
            yield  # pragma: no cover

        def close_communicator(self) -> None:
            sync, self.sync = self.sync, None
            if sync is not None:
                sync.close()

    WeightsyncVLLMClient.__module__ = __name__
    WeightsyncVLLMClient.__qualname__ = "WeightsyncVLLMClient"
    return WeightsyncVLLMClient


def __getattr__(name: str) -> Any:
    if name == "WeightsyncVLLMClient":     # built on first use: it subclasses TRL's class
        cls = _make_class()
        globals()[name] = cls
        return cls
    raise AttributeError(name)


def patch_vllm_client(backend: Optional[str] = None, *, weight_sync_timeout: float = 1800.0,
                      control_timeout: float = 300.0, **engine: Any) -> type:
    """Make TRL's trainers build :class:`WeightsyncVLLMClient` instead of TRL's
    ``VLLMClient``; returns the class. ``backend``: the weightsync backend (None: the one
    the server runs); ``weight_sync_timeout``: the bound of one sync; other keywords are
    weightsync engine options (``bucket_size``, ``num_slots``, ``checksum``, ``dtype``,
    ``host``, ``worker_host``). Call it before the trainer is built; calling it again
    replaces the options; :func:`unpatch_vllm_client` undoes it."""
    options = SyncOptions(backend=backend, weight_sync_timeout=weight_sync_timeout,
                          control_timeout=control_timeout, engine=dict(engine))
    import trl.generation.vllm_client  # noqa: F401  (the modules the patch edits)
    import trl.generation.vllm_generation  # noqa: F401

    base = globals()["WeightsyncVLLMClient"] if "WeightsyncVLLMClient" in globals() \
        else __getattr__("WeightsyncVLLMClient")
    cls = type("WeightsyncVLLMClient", (base,), {"sync_options": options,
                                                 "__module__": __name__})
    original = _trl_client()
    for name, module in list(sys.modules.items()):
        if module is None or not (name == "trl" or name.startswith("trl.")):
            continue
        held = getattr(module, "VLLMClient", None)
        if held is original or (isinstance(held, type) and issubclass(held, base)):
            _PATCHED.setdefault(name, original)
            setattr(module, "VLLMClient", cls)
    for name in _TARGETS:
        if name not in _PATCHED:
            raise RuntimeError(f"weightsync: {name}.VLLMClient is not TRL's VLLMClient; "
                               "cannot patch it")
    return cls


def unpatch_vllm_client() -> None:
    """Give TRL its own ``VLLMClient`` back."""
    for name, original in list(_PATCHED.items()):
        module = sys.modules.get(name)
        if module is not None:
            setattr(module, "VLLMClient", original)
        del _PATCHED[name]
