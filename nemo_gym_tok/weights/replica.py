"""One vLLM server's weight routes over HTTP (vLLM's own, served with VLLM_SERVER_DEV_MODE=1), each failure named."""

from __future__ import annotations

from typing import Any, Literal

import httpx

from nemo_gym_tok.common.exact_json import loads_exact
from nemo_gym_tok.common.remote_errors import error_message

PauseMode = Literal["wait", "keep"]
PAUSE_MODES: tuple[PauseMode, ...] = ("wait", "keep")
"""`wait`: in-flight requests finish on the old weights before the reload; `keep`: they are frozen and go on with the
new weights after it (their bundles then carry `weight_version_spans`). vLLM's third mode, `abort`, loses them."""
STATUS_METHOD = "nemo_gym_tok_reload_status"
"""The worker method nemo_gym_tok.vllm.exact_reload adds (spelled there too: tests/test_weights.py keeps them equal)."""
DEV_MODE_ENV = "VLLM_SERVER_DEV_MODE"


class ReplicaError(RuntimeError):
    """A weight route of one vLLM server failed; the message names the server, the route and what it answered."""

    def __init__(self, url: str, message: str, status: int | None = None) -> None:
        super().__init__(f"{url}: {message}")
        self.url = url
        self.status = status
        """The HTTP status the server answered, None when it did not answer."""


def server_root(url: str) -> str:
    """The server's root for a base URL as configs give it (`http://host:8000/v1` -> `http://host:8000`)."""
    root = url.rstrip("/")
    return root[: -len("/v1")] if root.endswith("/v1") else root


class Replica:
    """The weight routes of the vLLM server at `url` (its root or its `/v1` base URL)."""

    def __init__(self, url: str, http: httpx.Client, api_key: str | None = None) -> None:
        self.url = server_root(url)
        self._http = http
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key and api_key != "EMPTY" else {}

    def _call(self, method: str, path: str, *, last_on_connection: bool = False, **kwargs: Any) -> httpx.Response:
        # vLLM's server drops the connection after answering 500 (a worker method it lacks): a call that may get one
        # closes its connection itself, so the next call never goes out on a connection the server has closed.
        headers = {**self._headers, "Connection": "close"} if last_on_connection else self._headers
        try:
            response = self._http.request(method, f"{self.url}{path}", headers=headers, **kwargs)
        except httpx.TimeoutException as exc:
            raise ReplicaError(self.url, f"{method} {path} timed out ({type(exc).__name__})") from exc
        except httpx.TransportError as exc:
            raise ReplicaError(self.url, f"{method} {path} failed: {exc or type(exc).__name__}") from exc
        if response.status_code == 401:
            raise ReplicaError(
                self.url,
                f"{method} {path} answered 401: the server requires its API key (--api-key / VLLM_API_KEY); pass it "
                "as --api-key, or the adapter's api_key in the config",
            )
        if response.status_code == 404:
            raise ReplicaError(
                self.url,
                f"{method} {path} answered 404: the server does not serve vLLM's weight routes; start it with "
                f"{DEV_MODE_ENV}=1 (docs/training.md)",
                404,
            )
        if response.status_code >= 400:
            message = f"{method} {path} answered {response.status_code}: {error_message(response)}"
            raise ReplicaError(self.url, message, response.status_code)
        return response

    def weight_version(self) -> str:
        """The label vLLM's engine has for the weights it serves (`default` until a version was set)."""
        return str(loads_exact(self._call("GET", "/weight_info").content)["weight_version"])

    def reload_status(self) -> dict[str, Any] | None:
        """What the worker-side exact reload reports (nemo_gym_tok.vllm.exact_reload), or None: a vLLM without it."""
        try:
            response = self._call("POST", "/collective_rpc", json={"method": STATUS_METHOD}, last_on_connection=True)
        except ReplicaError as exc:
            if exc.status != 500:
                raise
            return None  # vLLM answers 500 for a method its worker does not have
        results = loads_exact(response.content).get("results") or [None]
        return results[0] if isinstance(results[0], dict) else None

    def served_weights(self) -> tuple[str, str, bool | None]:
        """(weights path, device type, tied embeddings or None) from vLLM's `/server_info`, for a server without
        the exact reload."""
        answer = self._call("GET", "/server_info", params={"config_format": "json"})
        info = loads_exact(answer.content).get("vllm_config", {})
        model = info.get("model_config") or {}
        device = (info.get("device_config") or {}).get("device_type") or (info.get("device_config") or {}).get("device")
        hf_config = model.get("hf_config")
        tied = hf_config.get("tie_word_embeddings") if isinstance(hf_config, dict) else None
        return str(model.get("model", "")), str(device or "unknown"), tied

    def pause(self, mode: PauseMode) -> None:
        self._call("POST", "/pause", params={"mode": mode})

    def resume(self) -> None:
        self._call("POST", "/resume")

    def reload(self, weights_path: str) -> None:
        """vLLM's in-place reload from a checkpoint directory (a path the server can read)."""
        body = {"method": "reload_weights", "kwargs": {"weights_path": weights_path}}
        self._call("POST", "/collective_rpc", json=body, last_on_connection=True)  # a refused reload answers 500

    def reset_prefix_cache(self, *, running_requests: bool) -> None:
        """Drop the KV blocks computed with the old weights; `running_requests` also those of frozen requests
        (pause mode `keep`), which vLLM then computes again with the new weights."""
        params = {"reset_running_requests": "true" if running_requests else "false"}
        answer = loads_exact(self._call("POST", "/reset_prefix_cache", params=params).content)
        if isinstance(answer, dict) and answer.get("success") is False:
            raise ReplicaError(self.url, "POST /reset_prefix_cache answered success=false (blocks still held)")

    def set_weight_version(self, version: str) -> None:
        self._call("POST", "/update_weight_version", json={"new_version": version})
