"""The calls :class:`~weightsync.orchestration.manager.CheckpointEngineManager` makes on its
workers, typed once: :class:`TrainerWorker` (one trainer rank) and :class:`RolloutWorker`
(one rollout replica), and the name of each call (the constants below; no other module
spells them).

A worker is a Ray actor handle or a plain object in this process; the manager reaches it
only through :func:`~weightsync.orchestration.calls.call_all` with these names. Every call
is synchronous on the worker and bounded by the manager's timeout. The mixins of
:mod:`weightsync.integrations.ray` implement both protocols; a class that implements them
itself is driven the same way. Both are ``runtime_checkable``: ``isinstance(obj,
TrainerWorker)`` says whether a plain object has every method (a Ray handle cannot be
checked that way).

``kind`` of a sync: ``"full"`` (every weight, merged if LoRA), ``"base"`` (base weights of
a LoRA model, unmerged), ``"adapter"`` (LoRA tensors plus PEFT's ``adapter_config``).
"""

from __future__ import annotations

from typing import Any, Optional, Protocol, Sequence, runtime_checkable

__all__ = ["TrainerWorker", "RolloutWorker", "TRAINER_CALLS", "ROLLOUT_CALLS",
           "PREPARE", "INIT", "SEND", "RECEIVE", "FINALIZE", "DESCRIBE", "DIGEST",
           "LORA_CONFIG", "OFFLOAD", "RELOAD", "PAUSE", "RESUME", "SLEEP", "WAKE_UP",
           "RESET_CACHES", "VERSION", "BEGIN_SYNC", "COMMIT", "ABORT", "RELEASE",
           "CHECK_WEIGHTS", "FENCE", "SYNC_STATE", "CAPABILITIES", "CALL_LOG"]

# -- the names of the calls (both sides) ---------------------------------------------------
PREPARE = "ws_prepare"
INIT = "ws_init"
FINALIZE = "ws_finalize"
DIGEST = "ws_digest"
# trainer ranks
SEND = "ws_send"
DESCRIBE = "ws_describe"
LORA_CONFIG = "ws_lora_config"
OFFLOAD = "ws_offload"
RELOAD = "ws_reload"
# rollout replicas
RECEIVE = "ws_receive"
PAUSE = "ws_pause"
RESUME = "ws_resume"
SLEEP = "ws_sleep"
WAKE_UP = "ws_wake_up"
RESET_CACHES = "ws_reset_caches"
VERSION = "ws_version"
BEGIN_SYNC = "ws_begin_sync"
COMMIT = "ws_commit"
ABORT = "ws_abort"
RELEASE = "ws_release"
CHECK_WEIGHTS = "ws_check_weights"
FENCE = "ws_fence"
SYNC_STATE = "ws_sync_state"
CAPABILITIES = "ws_capabilities"
CALL_LOG = "ws_call_log"

#: Every call a trainer worker answers.
TRAINER_CALLS = (PREPARE, INIT, SEND, DESCRIBE, DIGEST, FINALIZE, LORA_CONFIG, OFFLOAD, RELOAD)
#: Every call a rollout worker answers.
ROLLOUT_CALLS = (PREPARE, INIT, RECEIVE, FINALIZE, PAUSE, RESUME, SLEEP, WAKE_UP, RESET_CACHES,
                 VERSION, BEGIN_SYNC, COMMIT, ABORT, RELEASE, CHECK_WEIGHTS, DIGEST, FENCE,
                 SYNC_STATE, CAPABILITIES, CALL_LOG)


@runtime_checkable
class TrainerWorker(Protocol):
    """One trainer rank, as the manager drives it (every rank gets every call)."""

    def ws_prepare(self, backend: str, engine_kwargs: dict) -> dict:
        """Build a trainer engine of ``backend`` (replacing any earlier one, whose delta
        bases carry over) and return its ``prepare()`` metadata."""

    def ws_init(self, kwargs: dict) -> None:
        """Join the group: ``init_process_group(**kwargs)`` (this rank's topology entry)."""

    def ws_send(self, version: Any, *, kind: str = "full") -> dict:
        """Export ``kind`` of the model and send it as ``version``; the send's metrics."""

    def ws_describe(self, kind: str = "full", dtype: Optional[str] = None) -> list:
        """``[[name, shape, dtype], ...]`` of what ``ws_send(kind)`` would send, after the
        cast to ``dtype`` (a dtype name; default: the engine's). No bytes move."""

    def ws_digest(self, kind: str = "full", cast_to: Optional[dict] = None,
                  dtype: Optional[str] = None, quantize: Optional[str] = None,
                  quantize_skip: Optional[list] = None) -> dict:
        """Digests of the tensors this rank exports (a collective: every rank), cast to
        ``cast_to`` (name -> dtype name) and, with ``quantize``, as the FP8 codec would
        send them."""

    def ws_finalize(self) -> None:
        """Release the engine (idempotent)."""

    def ws_lora_config(self) -> Optional[dict]:
        """The active adapter's PEFT config (JSON-able), or None for a model without LoRA."""

    def ws_offload(self) -> None:
        """Colocated mode: free training state before the rollout wakes."""

    def ws_reload(self) -> None:
        """Colocated mode: bring back what ``ws_offload`` freed."""


@runtime_checkable
class RolloutWorker(Protocol):
    """One rollout replica, as the manager drives it (the replica may host several
    receiving ranks: its ``ws_prepare`` returns one metadata entry per rank)."""

    def ws_prepare(self, backend: str, engine_kwargs: dict) -> list:
        """Build the replica's receiving engines of ``backend``; their ``prepare()``
        metadata, one entry per receiving rank."""

    def ws_init(self, kwargs_list: list) -> None:
        """Join the group: one ``init_process_group`` keyword dict per receiving rank."""

    def ws_receive(self, version: Any, *, kind: str = "full",
                   adapter_config: Optional[dict] = None) -> dict:
        """Receive ``version`` of ``kind`` and apply it (``adapter_config``: the PEFT
        config of an ``"adapter"`` sync); the receive's stats."""

    def ws_finalize(self) -> None:
        """Release the engines (idempotent)."""

    def ws_pause(self, abort: bool = True) -> None:
        """Stop generating (``abort``: end the requests in flight) until ``ws_resume``."""

    def ws_resume(self) -> None:
        """Generate again."""

    def ws_sleep(self, level: int = 1) -> None:
        """Free device memory: level 1 moves the weights off the device and drops the KV
        cache, level 2 discards both (a sync must restore the weights)."""

    def ws_wake_up(self, tags: Optional[Sequence[str]] = None) -> None:
        """Bring back ``tags`` (``"weights"``, ``"kv_cache"``; None: both)."""

    def ws_reset_caches(self) -> None:
        """Drop caches computed with older weights (prefix cache)."""

    def ws_version(self) -> Any:
        """The weight version the replica serves (None before its first sync)."""

    def ws_begin_sync(self, version: Any, kinds: list, staged: bool = False) -> bool:
        """Refuse generation until every round of ``kinds`` of ``version`` is applied;
        ``staged``: receive into a staging copy instead (atomic syncs). False: the replica
        cannot fence."""

    def ws_commit(self, version: Any) -> dict:
        """Atomic syncs: swap the staged copy of ``version`` in (the old one is kept)."""

    def ws_abort(self, version: Any) -> dict:
        """Atomic syncs: back to the version held before the sync; what it serves now."""

    def ws_release(self, version: Any) -> dict:
        """Atomic syncs: ``version`` is committed everywhere; free the old copy."""

    def ws_check_weights(self, offered: list, kind: str = "full",
                         adapter_config: Optional[dict] = None) -> Optional[list]:
        """``[[name, why], ...]`` of what would not load if ``offered`` (``[[name, shape,
        dtype], ...]``) were sent as ``kind``; None: the replica cannot check."""

    def ws_digest(self, kind: str = "full") -> dict:
        """Digests of the weights the replica holds: ``{"digests": ..., "dtypes": ...}``."""

    def ws_fence(self, reason: str) -> bool:
        """Refuse generation until a sync completes; False: the replica cannot fence."""

    def ws_sync_state(self) -> dict:
        """``{"version": ..., "fenced": why or None}``."""

    def ws_capabilities(self) -> dict:
        """What the replica can do (weight kinds, staged kinds, sleep levels...) and
        ``self_name``: the name its own errors give it."""

    def ws_call_log(self) -> list:
        """The calls the replica received, oldest first (for tests and debugging)."""
