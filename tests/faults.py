"""Fault-injection hooks for weightsync.testing.GroupSpec(hook="faults:NAME").

Each runs inside a worker process before init_process_group and wraps the engine.
"""

import os

import torch

KILL_AFTER = 40  # tensors into the second sync


def _kill_receiver(engine, rank_to_kill):
    orig = engine.receive_weights
    syncs = {"n": 0}

    async def wrapped(version=None):
        syncs["n"] += 1
        count = 0
        async for item in orig(version):
            count += 1
            if syncs["n"] == 2 and count == KILL_AFTER:
                os._exit(17)
            yield item

    engine.receive_weights = wrapped


def kill_rollout_1(engine, role, rank):
    if role == "rollout" and rank == 1:
        _kill_receiver(engine, rank)


def kill_rollout_2(engine, role, rank):
    if role == "rollout" and rank == 2:
        _kill_receiver(engine, rank)


def kill_trainer_0(engine, role, rank):
    if role != "trainer" or rank != 0:
        return
    orig = engine.send_weights
    syncs = {"n": 0}

    async def wrapped(named_tensors, version=None):
        syncs["n"] += 1

        def items():
            for i, item in enumerate(named_tensors):
                if syncs["n"] == 2 and i == KILL_AFTER:
                    os._exit(17)
                yield item

        return await orig(items(), version)

    engine.send_weights = wrapped


def corrupt_rollout_0(engine, role, rank):
    """Flip one byte of every bucket rollout rank 0 receives (after transport, before use),
    fetched or posted ahead."""
    if role != "rollout" or rank != 0:
        return
    orig = engine._rx_fetch

    def fetch(stream, msg):
        buf = orig(stream, msg)
        if msg.nbytes:
            buf[msg.nbytes // 2] ^= 0x5A
        return buf

    engine._rx_fetch = fetch
    # a bucket whose broadcast a receiver posted ahead (collective on CPU) lands through
    # _rx_fetch_post and _rx_complete instead: flip it there, once its bytes are in
    orig_post, orig_complete, posted = engine._rx_fetch_post, engine._rx_complete, {}

    def post(stream, msg):
        out = orig_post(stream, msg)
        if out is not None:
            posted[id(msg)] = out[0]
        return out

    def complete(stream, msg, handle):
        orig_complete(stream, msg, handle)
        buf = posted.pop(id(msg), None)
        if buf is not None and msg.nbytes:
            buf[msg.nbytes // 2] ^= 0x5A

    engine._rx_fetch_post, engine._rx_complete = post, complete


def never_init_rollout_1(engine, role, rank):
    if role == "rollout" and rank == 1:
        def stuck(**kwargs):
            import time
            time.sleep(3600)
        engine.init_process_group = stuck


LINGER_S = 6.0


def linger_rollouts_on_error(engine, role, rank):
    """A rollout rank that fails (e.g. version mismatch) but whose process stays alive
    ``LINGER_S`` longer."""
    if role != "rollout":
        return
    orig = engine.receive_weights

    async def wrapped(version=None):
        try:
            async for item in orig(version):
                yield item
        except Exception:
            import asyncio
            await asyncio.sleep(LINGER_S)
            raise

    engine.receive_weights = wrapped


# -- nixl: pulls are one-sided, so faults land inside the pull itself ----------------------

def _on_second(counter, key):
    counter[key] = counter.get(key, 0) + 1
    return counter[key] == 2


def nixl_kill_rollout_1_mid_pull(engine, role, rank):
    """Rollout rank 1 dies in its second sync after the trainers offered the version and
    before its reads finish (the trainers wait for its PulledMsg)."""
    if role != "rollout" or rank != 1:
        return
    orig, seen = engine._ensure_plan, {}

    def ensure(*args):
        plan = orig(*args)
        if _on_second(seen, "n"):
            os._exit(17)
        return plan
    engine._ensure_plan = ensure


def nixl_kill_trainer_0_mid_pull(engine, role, rank):
    """Trainer rank 0 dies right after offering its second version; receivers post their
    reads of its memory after it is gone."""
    if role == "rollout":
        orig, seen = engine._ensure_plan, {}

        def slow(*args):
            plan = orig(*args)
            if _on_second(seen, "n"):
                import time
                time.sleep(1.0)
            return plan
        engine._ensure_plan = slow
        return
    if rank != 0:
        return
    push, seen = engine._hub_push, {}

    def pushed(msg):
        push(msg)
        if type(msg).__name__ == "PullMsg" and _on_second(seen, "n"):
            os._exit(17)
    engine._hub_push = pushed


def nixl_receivers_leave_before_trainer_0_ends_its_last_sync(engine, role, rank):
    """Every receiver finishes the third sync, finalizes and closes its links before
    trainer rank 0 sends its last note of that sync (the ``own`` StagedMsg of ``_serve``):
    each receiver waited only for the blocks it reads from rank 0, and reported. Both
    sides meet through files in ``$WS_FAULT_DIR``."""
    import glob
    import time

    where = os.environ["WS_FAULT_DIR"]
    if role == "rollout":
        orig_fin = engine.finalize

        def finalize():
            orig_fin()
            open(os.path.join(where, f"rollout{rank}"), "w").close()
        engine.finalize = finalize
        return
    engine._serve_mode = "staging"    # receivers wait on no "own" block of rank 0
    if rank != 0:
        return
    orig, seen = engine._serve, {}

    def serve(seq, version, pipelined=False):
        if seen.setdefault("n", 0) == 2:
            deadline = time.monotonic() + 30
            while len(glob.glob(os.path.join(where, "rollout*"))) < engine._num_receivers \
                    and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(0.3)           # their closes (resets) have reached this end
        seen["n"] += 1
        return orig(seq, version, pipelined)
    engine._serve = serve


def nixl_mutate_after_send(engine, role, rank):
    """Serve from the tensors' own memory (no staging copy) and scribble over every tensor
    the instant send_weights returns: a pull still reading would see the scribbles."""
    if role != "trainer":
        return
    engine._serve_mode = "params"
    orig = engine.send_weights

    async def wrapped(named_tensors, version=None):
        items = list(named_tensors)
        out = await orig(iter(items), version)
        for _, t in items:
            if not t.numel():
                continue
            if t.dtype.is_floating_point or t.dtype.is_complex:
                t.fill_(float("nan"))
            elif t.dtype == torch.bool:
                t.logical_not_()
            elif t.is_contiguous():
                t.unsqueeze(0).view(torch.uint8).bitwise_not_()
        return out
    engine.send_weights = wrapped


def nixl_shape_disagrees_on_rank_1(engine, role, rank):
    """Trainer rank 1 yields one tensor with another shape than rank 0 does."""
    if role != "trainer" or rank != 1:
        return
    orig = engine.send_weights

    async def wrapped(named_tensors, version=None):
        def items():
            done = False
            for name, t in named_tensors:
                if not done and t.numel() > 1:
                    done, t = True, t.reshape(-1)[:-1].clone()
                yield name, t
        return await orig(items(), version)
    engine.send_weights = wrapped


def kill_rollout_0(engine, role, rank):
    if role == "rollout" and rank == 0:
        _kill_receiver(engine, rank)


def slow_trainer_gpu(engine, role, rank):
    """A GPU trainer whose stream is busy (a long kernel every 50 tensors): its bucket
    copies, so its broadcasts, run late; a receiver that reads a slot before the broadcast
    into it completed then reads stale bytes."""
    if role != "trainer":
        return
    orig = engine.send_weights

    async def wrapped(named_tensors, version=None):
        def items():
            for i, item in enumerate(named_tensors):
                if i % 50 == 0:
                    torch.cuda._sleep(50_000_000)
                yield item
        return await orig(items(), version)

    engine.send_weights = wrapped


def collective_reads_unordered(engine, role, rank):
    """Mutant of ``collective``'s receive: the consumer reads a slot without waiting for the
    broadcast into it to complete (with ``slow_trainer_gpu``)."""
    slow_trainer_gpu(engine, role, rank)
    if role == "rollout":
        engine._wait_work = lambda work, version, **kw: None


REFUSAL = "injected: the loader refuses this version"


def refuse_rollout_1(engine, role, rank):
    """Rollout rank 1's second sync fails before it reads a byte (its loader refuses): it
    tells the group with ``abort_receive`` and raises, as a replica's failed load does."""
    if role != "rollout" or rank != 1:
        return
    orig = engine.receive_weights
    syncs = {"n": 0}

    def wrapped(version=None):
        syncs["n"] += 1
        if syncs["n"] != 2:
            return orig(version)

        async def refused():
            error = RuntimeError(REFUSAL)
            engine.abort_receive(error, version)
            raise error
            yield  # noqa: unreachable - makes this an async generator

        return refused()

    engine.receive_weights = wrapped


def refuse_rollout_1_while_0_confirms(engine, role, rank):
    """``refuse_rollout_1``, and rollout rank 0 confirms the first sync a moment late (its
    consumer holds the last tensor 1 s; the spec's ``tiny`` must be 50): rollout rank 1's
    report of the second sync reaches the trainer while it still waits for that one."""
    refuse_rollout_1(engine, role, rank)
    if role != "rollout" or rank != 0:
        return
    from weightsync.testing.harness import make_tensors

    total = len(make_tensors(0, bucket_size=engine.config.bucket_size, tiny=50))
    orig = engine.receive_weights
    syncs = {"n": 0}

    async def wrapped(version=None):
        import asyncio
        syncs["n"] += 1
        count = 0
        async for item in orig(version):
            count += 1
            yield item
            if syncs["n"] == 1 and count == total:
                await asyncio.sleep(1.0)      # before asking on: its confirmation is late

    engine.receive_weights = wrapped
