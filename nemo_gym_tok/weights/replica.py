"""One vLLM server's weight routes over HTTP (vLLM's own, served with VLLM_SERVER_DEV_MODE=1), each failure named."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal

import httpx

from nemo_gym_tok.common.exact_json import loads_exact
from nemo_gym_tok.common.keys import key_headers
from nemo_gym_tok.common.net import server_root
from nemo_gym_tok.common.remote_errors import error_message
from nemo_gym_tok.router import is_vllm_router, list_workers

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

    @property
    def unreachable(self) -> bool:
        """The server gave no HTTP answer at all (connection refused, reset, timed out): it is down, not refusing."""
        return self.status is None and isinstance(self.__cause__, httpx.TransportError)


class Replica:
    """The weight routes of the vLLM server at `url` (its root or its `/v1` base URL)."""

    def __init__(self, url: str, http: httpx.Client, api_key: str | None = None) -> None:
        self.url = server_root(url)
        self._http = http
        self._headers = key_headers(api_key)

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
                f"{method} {path} answered 401: the server requires its API key for the weight routes (its "
                "--weights-api-key when started with one, which its inference --api-key does not replace; else its "
                "--api-key / VLLM_API_KEY); pass it as --api-key",
            )
        if response.status_code == 404 and not path.startswith("/v1/"):  # a /v1 404 is vLLM's own (a model unknown)
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

    def _json(self, method: str, path: str, **kwargs: Any) -> Any:
        """The route's answer read as JSON; an answer that is not (a proxy's page, a cut body) names the server."""
        response = self._call(method, path, **kwargs)
        try:
            return loads_exact(response.content)
        except ValueError as exc:
            raise ReplicaError(self.url, f"{method} {path} answered {response.status_code}, not JSON: {exc}") from exc

    def weight_version(self) -> str:
        """The label vLLM's engine has for the weights it serves (`default` until a version was set)."""
        answer = self._json("GET", "/weight_info")
        if not isinstance(answer, dict) or "weight_version" not in answer:
            raise ReplicaError(self.url, f"GET /weight_info answered without a weight_version: {str(answer)[:200]}")
        label = answer["weight_version"]
        if not isinstance(label, str) or not label:
            # Never str() it: a null label would become the version "None", and a rollback would set it back.
            raise ReplicaError(self.url, f"GET /weight_info answered a weight_version that is not a label: {label!r}")
        return label

    def reload_status(self) -> dict[str, Any] | None:
        """What the worker-side exact reload reports (nemo_gym_tok.vllm.exact_reload), or None: a vLLM without it."""
        try:
            response = self._call("POST", "/collective_rpc", json={"method": STATUS_METHOD}, last_on_connection=True)
        except ReplicaError as exc:
            if exc.status != 500:
                raise
            return None  # vLLM answers 500 for a method its worker does not have
        try:
            answer = loads_exact(response.content)
        except ValueError as exc:
            raise ReplicaError(self.url, f"POST /collective_rpc ({STATUS_METHOD}) answered, not JSON: {exc}") from exc
        results = (answer.get("results") if isinstance(answer, dict) else None) or [None]
        return results[0] if isinstance(results[0], dict) else None

    def served_weights(self) -> tuple[str, str, bool | None]:
        """(weights path, device type, tied embeddings or None) from vLLM's `/server_info`, for a server without
        the exact reload."""
        answer = self._json("GET", "/server_info", params={"config_format": "json"})
        info = (answer.get("vllm_config") if isinstance(answer, dict) else None) or {}
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
        answer = self._json("POST", "/reset_prefix_cache", params=params)
        if isinstance(answer, dict) and answer.get("success") is False:
            raise ReplicaError(self.url, "POST /reset_prefix_cache answered success=false (blocks still held)")

    def set_weight_version(self, version: str) -> None:
        self._call("POST", "/update_weight_version", json={"new_version": version})

    def served_model(self) -> str:
        """The name the server serves its model under (the first of `GET /v1/models`)."""
        answer = self._json("GET", "/v1/models")
        models = answer.get("data") if isinstance(answer, dict) else None
        if not models or not isinstance(models[0], dict) or not models[0].get("id"):
            raise ReplicaError(self.url, f"GET /v1/models lists no model: {str(answer)[:200]}")
        return str(models[0]["id"])

    def prompt_log_probs(self, token_ids: Sequence[int], model: str) -> list[float]:
        """log p(token_ids[i+1] | token_ids[:i+1]) as the server computes them (its prompt log probs, one greedy
        token generated beside them): what the weight probe compares."""
        body = {"model": model, "prompt": list(token_ids), "max_tokens": 1, "prompt_logprobs": 0, "temperature": 0}
        answer = self._json("POST", "/v1/completions", json=body)
        try:
            positions = answer["choices"][0]["prompt_logprobs"]
            return [float(positions[i + 1][str(token_ids[i + 1])]["logprob"]) for i in range(len(token_ids) - 1)]
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            raise ReplicaError(
                self.url, f"POST /v1/completions answered without the prompt's log probs ({exc!r}): {str(answer)[:200]}"
            ) from exc


def server_roots(urls: Sequence[str], http: httpx.Client) -> list[str]:
    """The vLLM servers `urls` name, each once, by its root: a URL where vllm-router answers stands for every worker
    it lists, and a server named twice (its root and its /v1 URL, or by itself and by its router) counts once."""
    return list(routed_roots(urls, http))


def routed_roots(urls: Sequence[str], http: httpx.Client) -> dict[str, str | None]:
    """server_roots, each with the router that listed it (its root URL), or None for a server named by itself: a
    server named both ways counts as named by itself."""
    roots: dict[str, str | None] = {}
    for url in urls:
        root = server_root(url)
        if is_vllm_router(root, http):
            for worker in list_workers(root, http=http):
                roots.setdefault(server_root(worker), root)
        else:
            roots[root] = None
    return roots


def try_each(replicas: Sequence[Replica], action: Callable[[Replica], object]) -> list[ReplicaError]:
    """`action` on every server at once (a thread each); the failures, in the servers' order, as ReplicaErrors. Any
    other exception a server's call raised (an answer unlike vLLM's, a bug) becomes one naming that server, the
    original as its cause: one server's surprise must not leave the others' outcomes unknown."""
    if not replicas:
        return []

    def attempt(replica: Replica) -> ReplicaError | None:
        try:
            action(replica)
        except ReplicaError as exc:
            return exc
        except Exception as exc:
            error = ReplicaError(replica.url, f"failed unexpectedly: {type(exc).__name__}: {exc}")
            error.__cause__ = exc
            return error
        return None

    with ThreadPoolExecutor(max_workers=len(replicas)) as pool:
        outcomes = list(pool.map(attempt, replicas))
    return [outcome for outcome in outcomes if outcome is not None]
