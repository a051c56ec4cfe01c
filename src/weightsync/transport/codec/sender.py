"""The trainer half of a codec engine: one sync as the codec runs it.

1. Wait for every receiver's ``held`` report; this rank sends deltas only if *every*
   receiver holds this rank's current base id (the inner transports deliver one stream to
   all receivers, so a per-receiver choice would need per-receiver streams; the price is
   one dense sync whenever a receiver joins, restarts, missed a version or failed).
2. Post this rank's mode; read every trainer rank's (if any sends deltas, dense tensors
   that look like records travel wrapped, so receivers can tell them apart).
3. Stream the tensors through the inner engine: cast, FP8-quantize, then per tensor a
   delta record or the dense tensor (:class:`~weightsync.transport.codec.state.EncodeRun`:
   device tensors are diffed in groups by device kernels, host tensors one by one).
4. Read every receiver's ``needs``: names whose base or result digest did not match. If any,
   a second round sends them dense (from the base copies, which hold the new values);
   their count is ``codec.resent`` in the metrics. A name still missing after that is an
   ``IntegrityError``.
5. Only then is the new base id in force; a failure anywhere leaves none (next sync dense).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from weightsync.core.errors import IntegrityError, WireError
from weightsync.transport.codec import delta, gpu
from weightsync.transport.codec.state import EncodeRun, SendStats, new_id
from weightsync.transport.tensors import CASTABLE, aiter_items

__all__ = ["CodecSender"]

#: Tensors from this size are encoded off the event loop's thread (smaller ones inline: a
#: thread hop per tensor costs more than it overlaps).
_OFFLOAD_BYTES = 64 << 20


class CodecSender:
    """Mixed into :class:`~weightsync.transport.codec.engine.CodecEngine`."""

    async def send_weights(self, named_tensors: Any, version: Any = None) -> dict[str, Any]:
        self._ready("trainer")
        self._seq += 1
        seq, link = self._seq, self._link
        link.forget_before(seq - 1)   # a peer may still read seq - 1
        start = time.perf_counter()
        stats, posted, rounds = SendStats(), False, []
        lap = stats.lap
        self.bases.lasting.begin()
        try:
            held = await self._gather(seq, "held", "rollout", version)
            lap("held")
            allow, reason = self._decide(held)
            mode = {"delta": allow, "base": self.bases.id, "new": new_id(), "reason": reason}
            await self._offload(link.post, seq, "mode", mode)
            posted = True
            modes = await self._gather(seq, "mode", "trainer", version)
            lap("modes")
            wrap = any(bool(m.get("delta")) for m in modes)
            items = self._encoded(named_tensors, EncodeRun(
                self.bases, allow=allow, wrap=wrap, stats=stats, version=version))
            rounds.append(await self.inner.send_weights(items, version))
            lap("round1")
            needs = await self._gather(seq, "needs/1", "rollout", version)
            lap("needs")
            union = sorted({n for v in needs for n in _names(v)})
            if union:
                stats.resent = len(union)
                rounds.append(await self.inner.send_weights(
                    self.bases.resend(union, wrap), version))
                left = await self._gather(seq, "needs/2", "rollout", version)
                still = sorted({n for v in left for n in _names(v)})
                if still:
                    raise IntegrityError(f"codec: {still[:10]} still wrong after a dense "
                                         "resend", phase="codec", version=version)
            self.bases.id = mode["new"] if self._delta_on else None
            if not link.hosts:           # rank 0 hosts the store: nobody waits for its done
                await self._offload(link.done, seq)
            self._done_seq = seq
        except BaseException as exc:
            self.bases.id = None
            self.bases.lasting.reset()   # a failed sync: trust no storage from before it
            if not posted:
                link.post_error(seq, "mode", exc)
            raise
        self.bases.lasting.finish()
        return self._metrics(rounds, stats, mode, needs, time.perf_counter() - start)

    def _decide(self, held: list[dict]) -> tuple[bool, str]:
        if not self._delta_on:
            return False, "delta off"
        if self.bases.id is None:
            return False, "no base yet (first sync, new engine, or the last sync failed)"
        me = str(self._group["rank"])
        for r, report in enumerate(held):
            got = report.get("held")
            if not isinstance(got, dict) or got.get(me) != self.bases.id:
                return False, f"rollout rank {r} does not hold this rank's base"
        return True, "every receiver holds the base"

    async def _encoded(self, named_tensors: Any, run: EncodeRun):
        async for name, tensor in aiter_items(named_tensors):
            nbytes = tensor.numel() * tensor.element_size()
            if tensor.device.type == "cpu" and nbytes >= _OFFLOAD_BYTES:
                pieces = await self._offload(self._encode_item, name, tensor, run)
            else:
                pieces = self._encode_item(name, tensor, run)
            for pair in pieces:
                yield pair
        for pair in run.close():
            yield pair

    def _encode_item(self, name: str, t: torch.Tensor, run: EncodeRun
                     ) -> list[tuple[str, torch.Tensor]]:
        cast, stats = self.config.dtype, run.stats
        pieces = self._quantizer.expand(name, t) if self._quantizer else [(name, t)]
        if cast is not None and t.dtype in CASTABLE and t.dtype != cast:
            pieces = [(n, p.to(cast) if p is t else p) for n, p in pieces]
        size = cast.itemsize if cast is not None and t.dtype in CASTABLE else t.element_size()
        stats.source_bytes += size * t.numel()
        out = []
        for n, p in pieces:
            if not self._delta_on:
                stats.tensors += 1
                stats.dense += 1
                stats.dense_bytes += p.numel() * p.element_size()
                stats.sent_dense_bytes += p.numel() * p.element_size()
                out.append((n, delta.raw_record(p) if run.wrap and delta.is_record(p) else p))
                continue
            # the caller's own tensor, diffed by the device kernels: may its diff wait for
            # a group? (the host diffs at once)
            mine = p is t and p.is_contiguous() and gpu.available(p.device)
            out += run.add(n, p, own=not mine, lasting=mine and run.lasting(n, p))
        return out

    def _metrics(self, rounds: list[dict], stats: SendStats, mode: dict, needs: list,
                 seconds: float) -> dict[str, Any]:
        out = dict(rounds[0])
        out["bytes"] = sum(int(r.get("bytes", 0)) for r in rounds)
        out["seconds"] = seconds
        out["gbps"] = out["bytes"] / seconds / 1e9 if seconds > 0 else 0.0
        out["rounds"] = len(rounds)
        out["backend"] = self.backend_name
        codec = stats.as_dict()
        codec.update(mode="delta" if mode["delta"] else "dense", reason=mode["reason"],
                     base_bytes=self.bases.nbytes, delta_option=self.options.delta,
                     quantize=self.options.quantize,
                     resend_requests=[len(_names(v)) for v in needs])
        out["codec"] = codec
        return out


def _names(value: dict) -> list[str]:
    names = value.get("needs", [])
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise WireError("codec: malformed needs list from a receiver", phase="codec")
    return names
