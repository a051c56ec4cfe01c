"""Sleep/wake of a model's weights inside one process (vLLM's sleep levels).

Level 1 copies every weight to host memory and frees the device copy (kept: wake_up
restores it); level 2 frees them (discarded: wake_up re-allocates them filled with NaN for
floating tensors, so a weight that no sync restored can never pass for a real one).
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["WeightParking"]


class WeightParking:
    def __init__(self) -> None:
        self.level = 0                  # 0: awake; 1 or 2: weights asleep at that level
        self._parked: dict[int, tuple] = {}   # id -> (name, tensor, backup, shape, dtype, dev)
        self._discarded: dict[int, str] = {}         # id -> name; cleared as syncs restore

    @property
    def asleep(self) -> bool:
        return self.level > 0

    def park(self, tensors: dict[str, torch.Tensor], level: int) -> None:
        if self.asleep:
            if level > self.level:   # deepen: drop the host copies too
                for key, (name, t, _, shape, dtype, dev) in self._parked.items():
                    self._parked[key] = (name, t, None, shape, dtype, dev)
                    self._discarded[key] = name
                self.level = level
            return
        seen = set()
        for name, t in tensors.items():
            if id(t) in seen:
                continue
            seen.add(id(t))
            backup = t.data.to("cpu", copy=True) if level == 1 else None
            self._parked[id(t)] = (name, t, backup, tuple(t.shape), t.dtype, t.device)
            if level >= 2:
                self._discarded[id(t)] = name
            t.data = torch.empty(0, dtype=t.dtype, device=t.device)
        self.level = level

    def restore(self) -> None:
        if not self.asleep:
            return
        for _, t, backup, shape, dtype, dev in self._parked.values():
            if backup is not None:
                t.data = backup.to(dev)
            elif dtype.is_floating_point:
                t.data = torch.full(shape, float("nan"), dtype=dtype, device=dev)
            else:
                t.data = torch.zeros(shape, dtype=dtype, device=dev)
        self._parked.clear()
        self.level = 0

    def loaded(self, t: torch.Tensor) -> None:
        self._discarded.pop(id(t), None)

    def unrestored(self, live: Optional[dict[str, torch.Tensor]] = None) -> list[str]:
        """Names discarded by level 2 that no sync has written since (among ``live``)."""
        if live is not None:
            ids = {id(t) for t in live.values()}
            for key in [k for k in self._discarded if k not in ids]:
                del self._discarded[key]
        return sorted(self._discarded.values())
