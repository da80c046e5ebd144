"""A running vLLM router's worker list over HTTP: list, add, remove, and telling a router from a plain vLLM."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from urllib.parse import urlsplit

import httpx

from nemo_gym_tok.common.exact_json import loads_exact
from nemo_gym_tok.common.keys import key_headers
from nemo_gym_tok.common.net import server_root, shared_ssl_context

ADMIN_TIMEOUT = 10.0
"""Seconds for the router's own routes, which answer from memory."""
ADD_WORKER_TIMEOUT = 60.0
"""Seconds to wait for /add_worker: the router answers only once the new worker answers GET /health, or after its own
--worker-startup-timeout-secs."""


class RouterError(RuntimeError):
    """A router refused a request on its worker list, or did not answer; the message says what it answered."""

    def __init__(self, router_url: str, message: str, status: int | None = None) -> None:
        super().__init__(f"vllm-router at {router_url}: {message}")
        self.router_url = router_url
        self.status = status
        """The HTTP status the router answered, None when it did not answer."""


def worker_base_url(url: str) -> str:
    """`url` as the router wants a worker: `http(s)://host:port`, a trailing `/v1` and `/` stripped.

    The router compares worker URLs as strings (it lists `http://h:8000` and `http://h:8000/` as two workers) and
    appends `/v1/...` itself, so every URL the gym hands it goes through here. Raises ValueError saying what to fix.
    """
    if not isinstance(url, str) or not url.strip():
        raise ValueError(f"a worker URL must be a non-empty string like http://127.0.0.1:8000, not {url!r}")
    base = server_root(url)
    parts = urlsplit(base)
    hint = "give the vLLM server's base URL, like http://127.0.0.1:8000 (a trailing /v1 is fine)"
    if parts.scheme not in ("http", "https"):
        raise ValueError(f"worker URL {url!r} does not start with http:// or https://; {hint}")
    try:
        parts.port  # urlsplit checks the port only when it is read
    except ValueError:
        raise ValueError(f"worker URL {url!r} has an invalid port; {hint}") from None
    if not parts.hostname:
        raise ValueError(f"worker URL {url!r} names no host; {hint}")
    if parts.path or parts.query or parts.fragment:
        raise ValueError(f"worker URL {url!r} has a path, query or fragment the router would not use; {hint}")
    return base


@contextmanager
def _client(http: httpx.Client | None, timeout: float) -> Iterator[httpx.Client]:
    if http is not None:
        yield http
        return
    with httpx.Client(timeout=timeout, verify=shared_ssl_context()) as own:
        yield own


def _request(
    router_url: str,
    method: str,
    path: str,
    *,
    http: httpx.Client | None,
    api_key: str | None,
    timeout: float,
    params: dict[str, str] | None = None,
) -> httpx.Response:
    root = server_root(router_url)
    with _client(http, timeout) as client:
        try:
            response = client.request(
                method, f"{root}{path}", params=params, headers=key_headers(api_key), timeout=timeout
            )
        except httpx.TimeoutException as exc:
            raise RouterError(root, f"{method} {path} got no answer within {timeout:.0f}s") from exc
        except httpx.TransportError as exc:
            raise RouterError(root, f"{method} {path} failed: {exc or type(exc).__name__}") from exc
    if response.status_code != 200:
        answer = response.text.strip()[:500] or "(empty body)"
        raise RouterError(root, f"{method} {path} answered {response.status_code}: {answer}", response.status_code)
    return response


def _urls(router_url: str, response: httpx.Response) -> list[str]:
    try:
        body = loads_exact(response.content)
    except ValueError:
        body = None
    urls = body.get("urls") if isinstance(body, dict) else None
    if not isinstance(urls, list) or not all(isinstance(u, str) for u in urls):
        raise RouterError(
            server_root(router_url), f"GET /list_workers did not answer {{'urls': [...]}}: {response.text[:300]!r}"
        )
    return urls


def list_workers(
    router_url: str, *, http: httpx.Client | None = None, api_key: str | None = None, timeout: float = ADMIN_TIMEOUT
) -> list[str]:
    """The worker URLs the router at `router_url` routes to, in its order (unhealthy ones included)."""
    response = _request(router_url, "GET", "/list_workers", http=http, api_key=api_key, timeout=timeout)
    return _urls(router_url, response)


def add_worker(
    router_url: str,
    worker_url: str,
    *,
    http: httpx.Client | None = None,
    api_key: str | None = None,
    timeout: float = ADD_WORKER_TIMEOUT,
) -> str:
    """Adds `worker_url` (normalized by `worker_base_url`) to the router; returns the URL as the router lists it.

    The router answers once the worker answers GET /health, so a worker still starting holds this call up to
    `timeout`. When that runs out the router goes on waiting (up to its --worker-startup-timeout-secs) and may add the
    worker later: the error says so. A worker the router lists already is refused (400, "already exists").
    """
    url = worker_base_url(worker_url)
    try:
        _request(router_url, "POST", "/add_worker", http=http, api_key=api_key, timeout=timeout, params={"url": url})
    except RouterError as exc:
        if exc.status is None and isinstance(exc.__cause__, httpx.TimeoutException):
            raise RouterError(
                exc.router_url,
                f"POST /add_worker?url={url} got no answer within {timeout:.0f}s: the router waits until the worker "
                "answers GET /health (up to its --worker-startup-timeout-secs) and may still add it; check that "
                f"{url}/health answers from the router's host, then call list_workers",
            ) from exc
        raise
    return url


def remove_worker(
    router_url: str,
    worker_url: str,
    *,
    http: httpx.Client | None = None,
    api_key: str | None = None,
    timeout: float = ADMIN_TIMEOUT,
) -> str:
    """Removes `worker_url` (normalized by `worker_base_url`) from the router; returns the URL removed.

    Refused with RouterError when the router does not list it: the router itself answers 200 to an unknown URL and
    removes nothing, which would hide a misspelt URL.
    """
    url = worker_base_url(worker_url)
    listed = list_workers(router_url, http=http, api_key=api_key, timeout=timeout)
    if url not in listed:
        raise RouterError(
            server_root(router_url), f"{url} is not one of its workers (it lists {listed}); nothing removed"
        )
    _request(router_url, "POST", "/remove_worker", http=http, api_key=api_key, timeout=timeout, params={"url": url})
    return url


def is_vllm_router(url: str, http: httpx.Client | None = None, *, timeout: float = ADMIN_TIMEOUT) -> bool:
    """True when the server at `url` (its root or `/v1` base URL) answers GET /list_workers as vllm-router does.

    A plain vLLM answers 404 there. False as well when nothing answers at `url`: the caller's next request says why.
    """
    with _client(http, timeout) as client:
        try:
            response = client.get(f"{server_root(url)}/list_workers", timeout=timeout)
        except httpx.TransportError:
            return False
    if response.status_code != 200:
        return False
    try:
        body = loads_exact(response.content)
    except ValueError:
        return False
    return (
        isinstance(body, dict)
        and set(body) == {"urls"}
        and isinstance(body["urls"], list)
        and all(isinstance(u, str) for u in body["urls"])
    )
