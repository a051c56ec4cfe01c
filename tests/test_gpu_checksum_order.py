"""Issue 14 item 5: the checksum of a CUDA bucket is taken after the copies that pack it.

The caller packs on its own (non-default) stream; the header and its checksum are made in
the engine's thread, whose current stream is the default one. Waiting on that thread's
stream let the checksum read a bucket whose copies were still queued behind the caller's
work, so a healthy sync failed as ``IntegrityError``. NCCL needs two GPUs for a real
broadcast; what is checked here is the trainer's half (what goes into the header), on one
GPU, with the group replaced by a recorder. Marked ``gpu``: run on the device
(``benchmarks/run_gpu.sh``)."""

import asyncio

import pytest
import torch

from weightsync import CheckpointEngineRegistry
from weightsync.transport.tensors import as_bytes, checksum

pytestmark = pytest.mark.timeout(120)

_SLEEP_CYCLES = int(3e9)  # ~1-2 s of GPU time queued ahead of the pack copies


def _recording_trainer(bucket: int, device: str):
    e = CheckpointEngineRegistry.new("collective", role="trainer", device=device,
                                     checksum=True, timeout=60, bucket_size=bucket)
    e._cuda, e._rank, e._world, e._num_receivers = device == "cuda", 0, 1, 0
    e._bufs = [torch.zeros(bucket, dtype=torch.uint8, device=device)
               for _ in range(e.config.num_slots)]
    sent: list = []
    e._tx_publish = lambda slot, msg: sent.append(msg)
    e._tx_wait_free = lambda slot, state: None
    e._finish_stream = lambda state: None
    return e, sent


def _check_headers(engine, sent, weights) -> None:
    assert len(sent) >= 2
    flat = {name: as_bytes(t).cpu() for name, t in weights.items()}
    for msg in sent:
        expect = torch.zeros(msg.nbytes, dtype=torch.uint8)
        assert msg.entries, "a first sync carries its layout"
        for e in msg.entries:
            expect[e.offset: e.offset + e.nbytes] = \
                flat[e.name][e.chunk_offset: e.chunk_offset + e.nbytes]
        assert msg.checksum == checksum(expect), f"bucket {msg.index} hashed before packed"


def _weights(device: str) -> dict:
    return {f"w{i}": torch.randn(256, 1024, device=device) for i in range(6)}  # 1 MiB each


def test_recorder_sees_the_packed_bytes_on_cpu():
    """The harness itself (CPU): what the recorder checks is what a receiver would."""
    engine, sent = _recording_trainer(4 << 20, "cpu")
    weights = _weights("cpu")
    asyncio.run(engine.send_weights(weights.items(), version=1))
    _check_headers(engine, sent, weights)


@pytest.mark.gpu
@pytest.mark.parametrize("caller_stream", ["side", "default"])
def test_collective_checksum_waits_for_the_stream_that_packed(caller_stream):
    engine, sent = _recording_trainer(4 << 20, "cuda")
    weights = _weights("cuda")
    torch.cuda.synchronize()
    stream = torch.cuda.Stream() if caller_stream == "side" else torch.cuda.current_stream()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(_SLEEP_CYCLES)  # the caller's stream is busy: the copies queue
        asyncio.run(engine.send_weights(weights.items(), version=1))
    torch.cuda.synchronize()
    _check_headers(engine, sent, weights)
