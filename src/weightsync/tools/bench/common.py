"""The base class of every bench method and the gloo group helpers they share.

Imported by :mod:`weightsync.tools.bench.methods` (weightsync backends and limits) and
:mod:`weightsync.tools.bench.baselines` (what users do today).
"""

from __future__ import annotations

import datetime
from typing import Any, ClassVar

import torch.distributed as dist

__all__ = ["Method", "gloo_group", "shutdown_group"]


class Method:
    """One way of moving the weights; subclasses set ``kind`` and implement ``step``."""

    kind: ClassVar[str] = "limit"        # "weightsync" | "baseline" | "limit"
    verify: ClassVar[bool] = True        # receivers must end with the trainer's bytes
    trainer_only: ClassVar[bool] = False

    def __init__(self, ctx, opts: dict) -> None:
        self.ctx = ctx
        self.opts = opts

    def participates(self) -> bool:
        return self.ctx.is_trainer or not self.trainer_only

    def setup(self) -> None:
        pass

    def before_step(self, version: int) -> None:
        """Untimed work before the barrier of a step (e.g. freeing the previous version)."""

    def step(self, version: int) -> None:
        raise NotImplementedError

    def teardown(self) -> None:
        pass

    def info(self) -> dict:
        return {}


def gloo_group(ctx, tag: str) -> tuple[Any, Any]:
    """A gloo group of the trainer and every receiver, built from a trainer-hosted store."""
    td = datetime.timedelta(seconds=ctx.timeout)
    server = None
    if ctx.is_trainer:
        server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                               timeout=td, use_libuv=True)
        port = server.port
    else:
        port = None
    port = ctx.gather(port)[0]
    store = server if server is not None else dist.TCPStore(
        "127.0.0.1", port, is_master=False, timeout=td, use_libuv=True)
    pg = dist.ProcessGroupGloo(dist.PrefixStore(tag, store), ctx.rank, ctx.receivers + 1, td)
    return pg, store


def shutdown_group(pg: Any) -> None:
    """Shut a process group down if it can be (best effort: the bench is ending)."""
    if pg is None:
        return
    fn = getattr(pg, "shutdown", None)
    if fn is not None:
        try:
            fn()
        except Exception:
            pass
