"""The rollout half of a codec engine: one sync as the codec runs it.

1. Post ``held`` (the base id held from each trainer rank; nothing once a sync failed or
   delta is off), then read every trainer rank's mode. From here until the sync completes
   this receiver holds no base (a failure anywhere means dense next time).
2. Round 1 through the inner engine. Each dense tensor lands in ``params[name]`` (with
   ``receive_into``) or in the receiver's base store; each delta record is applied in
   place onto its base after the base digest matched, and checked after. A record whose
   base is missing or differs, or whose result differs, is withheld (not yielded) and
   named in ``needs``. When no trainer rank sends deltas, round 1 is the inner engine's
   own ``receive_into``/``receive_weights`` (its zero-copy paths included).
3. Post ``needs``; read everybody's. If any receiver needs a resend, every receiver takes
   part in round 2 (a broadcast), applies the tensors it needed and yields them; the rest
   it drains. Each name is yielded exactly once per sync.
4. Hold the new base ids. ``last_receive`` has this sync's counts (applied, dense,
   base_mismatch, result_mismatch, resent, ...).
"""

from __future__ import annotations

import time
from typing import Any, AsyncIterator, Mapping, Optional

import torch

from weightsync.core.errors import IntegrityError
from weightsync.transport.codec import delta
from weightsync.transport.codec.state import STAGED, ReceiveStats

__all__ = ["CodecReceiver"]

Params = Optional[Mapping[str, torch.Tensor]]


class CodecReceiver:
    """Mixed into :class:`~weightsync.transport.codec.engine.CodecEngine`."""

    def receive_weights(self, version: Any = None) -> AsyncIterator[tuple[str, torch.Tensor]]:
        """Dense tensors, each name once. With delta on they are the receiver's base copies
        (memory: the weight set; each dense tensor is copied into it once): prefer
        :meth:`receive_into`, which applies deltas straight into the caller's tensors."""
        return self._receive(version, None)

    def receive_into(self, params: Mapping[str, torch.Tensor], version: Any = None
                     ) -> AsyncIterator[tuple[str, torch.Tensor]]:
        if not isinstance(params, Mapping):
            raise ValueError("params must be a mapping of name -> tensor, got "
                             f"{type(params).__name__}")
        return self._receive(version, params)

    def _abort_unread(self, error: BaseException, version: Any) -> None:
        """:meth:`abort_receive`: this receiver's ``held`` of the sync it skips is the
        error, so every trainer rank fails where it gathers them (before the inner engine
        moves a byte, which keeps the inner engines in step)."""
        self._ready("rollout")
        self._seq += 1
        self.rx.held = {}
        self._link.post_error(self._seq, "held", error)

    async def _receive(self, version: Any, params: Params
                       ) -> AsyncIterator[tuple[str, torch.Tensor]]:
        self._ready("rollout")
        self._seq += 1
        seq, link, rx = self._seq, self._link, self.rx
        link.forget_before(seq - 1)   # a peer may still read seq - 1
        stats, stage = ReceiveStats(), "held"
        self.last_receive = stats.as_dict()
        try:
            held, rx.held = (dict(rx.held) if self._delta_on else {}), {}
            await self._offload(link.post, seq, "held", {"held": held})
            stage = "needs/1"
            modes = await self._gather(seq, "mode", "trainer", version)
            stats.lap("modes")
            records = any(bool(m.get("delta")) for m in modes)
            async for pair in self._round_one(version, params, records, stats):
                yield pair
            stats.lap("round1")
            await self._offload(link.post, seq, "needs/1", {"needs": stats.needs})
            needs = await self._gather(seq, "needs/1", "rollout", version)
            stats.lap("needs")
            stage = "needs/2"
            if any(v.get("needs") for v in needs):
                async for pair in self._round_two(version, params, records, stats):
                    yield pair
                await self._offload(link.post, seq, "needs/2", {"needs": stats.needs})
                if stats.needs:
                    raise IntegrityError(f"codec: {stats.needs[:10]} were not resent",
                                         phase="codec", version=version)
            stage = None
            if self._delta_on:
                rx.held = {str(t): str(m.get("new")) for t, m in enumerate(modes)}
            rx.version = version
            await self._offload(link.done, seq)
        except BaseException as exc:
            rx.held = {}
            if stage is not None:
                link.post_error(seq, stage, exc)
            raise
        finally:
            self.last_receive = stats.as_dict()

    async def _round_one(self, version: Any, params: Params, records: bool,
                         stats: ReceiveStats) -> AsyncIterator[tuple[str, torch.Tensor]]:
        if not records and params is not None:
            stream = self.inner.receive_into(params, version)
        else:
            stream = self.inner.receive_weights(version)
        rx, done = self.rx, False
        try:
            async for name, t in stream:
                start = time.perf_counter()
                if records and rx.is_record(name, t, params):
                    out = rx.take_record(name, t, params, stats)
                else:
                    stats.dense += 1
                    out = rx.take_dense(name, t, params)
                stats.apply_seconds += time.perf_counter() - start
                if out is STAGED:
                    continue
                if out is None:
                    stats.needs.append(name)
                    continue
                yield name, out
            start = time.perf_counter()
            landed = rx.finish_records(stats)
            stats.apply_seconds += time.perf_counter() - start
            done = True
            for name, out in landed:
                if out is None:
                    stats.needs.append(name)
                    continue
                yield name, out
        finally:
            if not done:
                rx.drop_staged()
            await stream.aclose()

    async def _round_two(self, version: Any, params: Params, records: bool,
                         stats: ReceiveStats) -> AsyncIterator[tuple[str, torch.Tensor]]:
        wanted, stats.needs = set(stats.needs), []
        got = set()
        stream = self.inner.receive_weights(version)
        try:
            async for name, t in stream:
                if name not in wanted:
                    continue              # another receiver needed it; this one holds it
                if records and delta.is_record(t):
                    head = delta.parse(t)
                    if head.enc != delta.RAW:
                        continue          # a resend is always dense; leave it missing
                    t = delta.dense_view(head, t)
                got.add(name)
                stats.resent += 1
                yield name, self.rx.take_dense(name, t, params)
        finally:
            await stream.aclose()
        stats.needs = sorted(wanted - got)
