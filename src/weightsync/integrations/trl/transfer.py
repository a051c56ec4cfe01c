"""``AsyncGRPOTrainer(weight_transfer=...)`` through weightsync.

TRL 1.16's ``trl.experimental.async_grpo.AsyncGRPOTrainer`` takes any object that follows
its ``WeightTransferProtocol`` (``init_weight_transfer``, ``pause``,
``send_weights(iterator)``, ``resume``, ``destroy``); its default is an NCCL group, which
needs CUDA. :class:`WeightsyncWeightTransfer` is that object for a ``vllm serve`` started
with a weightsync backend::

    from weightsync.integrations.trl import WeightsyncWeightTransfer
    trainer = AsyncGRPOTrainer(model, reward_funcs, args=config, train_dataset=dataset,
                               weight_transfer=WeightsyncWeightTransfer(config))

It reads the server's URL (``vllm_server_base_url``), ``vllm_server_timeout`` and
``weight_sync_timeout`` from the trainer's config. Each ``send_weights`` is one complete
weight version, checked by the server's workers before a byte moves, applied completely or
not at all, and bounded by ``weight_sync_timeout`` (see :mod:`.sync`). ``pause`` and
``resume`` are vLLM's ``/pause?mode=keep`` and ``/resume`` as in TRL's own client; a
failed ``send_weights`` resumes the server itself (it serves the previous version whole,
where TRL's NCCL client leaves it paused on partially updated weights).

With a custom ``weight_transfer`` TRL syncs a PEFT model by merging the adapter and sending
the merged weights (its adapter-only mode is off); that is what this object receives.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Iterator, Optional

import torch

from weightsync.integrations.trl.sync import ServerSync, SyncOptions

__all__ = ["WeightsyncWeightTransfer"]

logger = logging.getLogger(__name__)


class WeightsyncWeightTransfer:
    """TRL's ``WeightTransferProtocol`` over weightsync (see the module docstring).

    ``args``: the trainer's config (``AsyncGRPOConfig``; anything with
    ``vllm_server_base_url``); ``base_url``, ``weight_sync_timeout``, ``server_timeout``
    override what it says. ``backend``: the weightsync backend (None: the one the server
    runs); other keywords are weightsync engine options (``bucket_size``, ``num_slots``,
    ``checksum``, ``dtype``, ``host``, ``worker_host``).
    """

    def __init__(self, args: Any = None, *, base_url: Optional[str] = None,
                 backend: Optional[str] = None, weight_sync_timeout: Optional[float] = None,
                 server_timeout: Optional[float] = None, control_timeout: float = 300.0,
                 **engine: Any) -> None:
        base_url = base_url or getattr(args, "vllm_server_base_url", None)
        if not base_url:
            raise ValueError("pass the trainer's config (args=, with vllm_server_base_url) "
                             "or base_url= (the vLLM server, http://host:port)")
        if weight_sync_timeout is None:
            weight_sync_timeout = getattr(args, "weight_sync_timeout", None) or 1800.0
        self.server_timeout = float(server_timeout if server_timeout is not None else
                                    getattr(args, "vllm_server_timeout", None) or 240.0)
        self.options = SyncOptions(backend=backend, weight_sync_timeout=weight_sync_timeout,
                                   control_timeout=control_timeout, engine=dict(engine))
        self.sync = ServerSync(base_url, self.options)
        self.last: dict = {}
        self._paused = False

    # -- WeightTransferProtocol ---------------------------------------------------------
    def init_weight_transfer(self) -> None:
        """Wait for the server (``vllm_server_timeout``), check it runs a weightsync
        backend, and join its workers."""
        self.sync.wait_ready(self.server_timeout)
        self.sync.connect()

    def pause(self) -> None:
        self.sync.http.pause(mode="keep", timeout=self.options.control_timeout)
        self._paused = True

    def send_weights(self, iterator: Iterator[tuple[str, torch.Tensor]]) -> None:
        """One complete version. On a failure the server still holds the previous version
        whole, so this resumes it (TRL's sync raises past its own ``resume()``) and says
        so in the error."""
        start = time.perf_counter()
        try:
            self.last = self.sync.send(None, iterator)
        except Exception as exc:
            if self._paused:
                try:
                    self.resume()
                    exc.add_note(f"the vLLM server at {self.sync.base_url} was resumed: it "
                                 "generates with the previous weights")
                except Exception as again:
                    exc.add_note(f"resuming the vLLM server at {self.sync.base_url} failed "
                                 f"too ({again}); it is still paused")
            raise
        logger.debug("weightsync: send_weights took %.3f s", time.perf_counter() - start)

    def resume(self) -> None:
        self.sync.http.resume(timeout=self.options.control_timeout)
        self._paused = False

    def destroy(self) -> None:
        self.sync.close()
