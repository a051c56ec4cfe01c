"""Clients of vLLM's weight-sync control plane (vLLM's ``VLLMWeightSyncClient`` protocol).

* :class:`OfflineLLMClient` drives an offline ``vllm.LLM`` in this process (its methods
  take request objects, not the plain dicts the protocol passes).
* :class:`HTTPWeightSyncClient` drives a ``vllm serve`` process over its RL endpoints
  (``VLLM_SERVER_DEV_MODE=1``): ``/init_weight_transfer_engine``, ``/start_weight_update``,
  ``/update_weights``, ``/finish_weight_update``, plus ``/pause``, ``/resume``,
  ``/weight_info``, ``/get_world_size``, ``/health`` and greedy ``/v1/completions``. Every
  request is bounded by ``timeout``; an error answer raises :class:`VLLMServerError` with
  the HTTP status and the server's message (vLLM's own client raises a bare status).

Plain ``urllib``: no dependency beyond the standard library.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from typing import Any, Optional, Sequence

__all__ = ["OfflineLLMClient", "HTTPWeightSyncClient", "VLLMServerError"]


class VLLMServerError(RuntimeError):
    """An error answer of a vLLM server: ``status`` (HTTP) and ``message`` (its text)."""

    def __init__(self, path: str, status: int, message: str) -> None:
        super().__init__(f"vLLM server {path}: HTTP {status}: {message}")
        self.path, self.status, self.message = path, status, message


class OfflineLLMClient:
    """The weight-sync client of an offline ``vllm.LLM``."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        self.llm.init_weight_transfer_engine(WeightTransferInitRequest(init_info=init_info))

    def start_weight_update(self) -> None:
        self.llm.start_weight_update()

    def update_weights(self, update_info: Any) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        self.llm.update_weights(WeightTransferUpdateRequest(update_info=update_info))

    def finish_weight_update(self, weight_version: Optional[str] = None) -> None:
        self.llm.finish_weight_update(weight_version)

    def shutdown_weight_transfer_engine(self) -> None:
        self.llm.shutdown_weight_transfer_engine()


class HTTPWeightSyncClient:
    """A ``vllm serve`` process at ``base_url`` (e.g. ``http://127.0.0.1:8000``)."""

    def __init__(self, base_url: str, timeout: float = 300.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout = float(timeout)

    def request(self, method: str, path: str, body: Any = None,
                timeout: Optional[float] = None) -> Any:
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
    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self.request("POST", "/init_weight_transfer_engine", {"init_info": init_info})

    def start_weight_update(self) -> None:
        self.request("POST", "/start_weight_update")

    def update_weights(self, update_info: Any) -> None:
        self.request("POST", "/update_weights", {"update_info": update_info})

    def finish_weight_update(self, weight_version: Optional[str] = None) -> None:
        body = None if weight_version is None else {"weight_version": str(weight_version)}
        self.request("POST", "/finish_weight_update", body)

    def shutdown_weight_transfer_engine(self) -> None:
        self.request("POST", "/shutdown_weight_transfer_engine")

    # -- the rest of the server ---------------------------------------------------------
    def pause(self, mode: str = "abort") -> None:
        self.request("POST", f"/pause?mode={mode}")

    def resume(self) -> None:
        self.request("POST", "/resume")

    def is_paused(self) -> bool:
        return bool(self.request("GET", "/is_paused")["is_paused"])

    def weight_version(self) -> str:
        return str(self.request("GET", "/weight_info")["weight_version"])

    def world_size(self) -> int:
        return int(self.request("GET", "/get_world_size")["world_size"])

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

    def model_id(self) -> str:
        return str(self.request("GET", "/v1/models")["data"][0]["id"])

    def complete(self, prompt: Sequence[int], max_tokens: int, *, model: Optional[str] = None,
                 logprobs: Optional[int] = None) -> dict:
        """One greedy completion of a token-id prompt: ``{"tokens", "version", "raw"}``."""
        body = {"model": model or self.model_id(), "prompt": [int(t) for t in prompt],
                "max_tokens": int(max_tokens), "temperature": 0.0, "ignore_eos": True,
                "return_token_ids": True}
        if logprobs is not None:
            body["logprobs"] = int(logprobs)
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
