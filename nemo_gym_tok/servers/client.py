"""Async HTTP client that reaches gym servers by instance name instead of URL."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

import httpx

from nemo_gym_tok.common.exact_json import JSON_MEDIA_TYPE, dumps, loads_exact
from nemo_gym_tok.servers.http_pool import aiohttp_session, call_timeout, pool_limits, post_read_whole

if TYPE_CHECKING:
    import aiohttp


SESSION_HEADER = "x-session-id"
"""Names the episode on every call: the adapter keeps it on one vLLM URL, environments key state by it."""
AUTH_TOKEN_ENV = "NGT_AUTH_TOKEN"
"""The gym's bearer token when the config has no `auth_token`; what `ngt collect` sends; how `ngt run` hands the token
to its child servers (an environment variable, not a command line that `ps` shows). Defined here, in the light
client module, so that `ngt collect` needs no server imports."""


def auth_headers(token: str | None) -> dict[str, str]:
    """The header a gym client sends: `Authorization: Bearer <token>`, or nothing without a token."""
    return {"Authorization": f"Bearer {token}"} if token else {}


class UnknownServerError(LookupError):
    """A server name that the head server does not know."""


class ServerClient:
    """Resolves instance names to base URLs (given, or fetched once from the head server) and sends requests.

    `auth_token` is the gym's bearer token: sent on every request, and required by the server that owns this client
    (BaseServer.build_app), so one value configures both sides. `timeout` and `limits` default to the gym's
    (http_pool); a server passes its config's (`BaseServerConfig.http_timeout()`, `http_limits()`).
    """

    def __init__(
        self,
        servers: dict[str, str] | None = None,
        *,
        head_url: str | None = None,
        timeout: float | httpx.Timeout | None = None,
        auth_token: str | None = None,
        limits: httpx.Limits | None = None,
    ) -> None:
        self._servers = dict(servers or {})
        self._head_url = head_url.rstrip("/") if head_url else None
        self.auth_token = auth_token or None
        self._timeout = httpx.Timeout(call_timeout() if timeout is None else timeout)
        self._limits = limits or pool_limits()
        self._http = httpx.AsyncClient(
            timeout=self._timeout, limits=self._limits, headers=auth_headers(self.auth_token)
        )
        self._posts: aiohttp.ClientSession | None = None

    async def base_url(self, name: str) -> str:
        if name not in self._servers and self._head_url:
            response = await self._http.get(f"{self._head_url}/servers")
            response.raise_for_status()
            self._servers.update(loads_exact(response.content))
        try:
            return self._servers[name]
        except KeyError:
            known = ", ".join(sorted(self._servers)) or "none"
            raise UnknownServerError(f"no server named {name!r} (known: {known})") from None

    async def post(self, name: str, path: str, json: Any = None, **kwargs: Any) -> httpx.Response:
        """POST `json` to `path` on the server called `name`. The body is written by orjson (exact_json.dumps):
        histories carry thousands of token ids, which the stdlib encoder httpx uses takes a millisecond and more to
        write.

        A JSON body with at most `headers` besides goes over aiohttp (see `_post_json`); anything else over httpx.
        Either way the answer is an httpx.Response and a failed connection an httpx.TransportError."""
        url = f"{await self.base_url(name)}/{path.lstrip('/')}"
        if json is None or "content" in kwargs:
            return await self._http.post(url, json=json, **kwargs)
        headers = httpx.Headers(kwargs.pop("headers", None))
        headers.setdefault("content-type", JSON_MEDIA_TYPE)
        if kwargs:
            return await self._http.post(url, content=dumps(json), headers=headers, **kwargs)
        return await self._post_json(url, dumps(json), headers)

    async def _post_json(self, url: str, content: bytes, headers: httpx.Headers) -> httpx.Response:
        """The POST an agent makes on every model call and environment step, over aiohttp: with dozens of calls in
        flight, httpx's connection pool (httpcore) spends most of an agent's CPU choosing a connection for each
        request (bench/p4_collect.py, profiled); aiohttp's pool does not. Same limits, timeouts and auth."""
        import aiohttp  # lazy: this module is the light client `ngt collect` imports for its names

        if self._posts is None:  # made on first use: an aiohttp session belongs to the running loop
            # httpx's read timeout is the longest wait for the next bytes, as aiohttp's sock_read is.
            timeout = aiohttp.ClientTimeout(sock_connect=self._timeout.connect, sock_read=self._timeout.read)
            self._posts = aiohttp_session(self._limits, timeout, auth_headers(self.auth_token))
        try:
            return await post_read_whole(self._posts, url, content, dict(headers))
        except aiohttp.ClientConnectorError as exc:
            raise httpx.ConnectError(str(exc), request=httpx.Request("POST", url)) from exc
        except aiohttp.ConnectionTimeoutError as exc:
            raise httpx.ConnectTimeout(str(exc) or "connect timed out", request=httpx.Request("POST", url)) from exc
        except (aiohttp.ServerTimeoutError, asyncio.TimeoutError) as exc:
            raise httpx.ReadTimeout(str(exc) or "timed out", request=httpx.Request("POST", url)) from exc
        except aiohttp.ClientError as exc:
            raise httpx.ReadError(f"{type(exc).__name__}: {exc}", request=httpx.Request("POST", url)) from exc

    async def get(self, name: str, path: str, **kwargs: Any) -> httpx.Response:
        url = f"{await self.base_url(name)}/{path.lstrip('/')}"
        return await self._http.get(url, **kwargs)

    async def delete(self, name: str, path: str, **kwargs: Any) -> httpx.Response:
        url = f"{await self.base_url(name)}/{path.lstrip('/')}"
        return await self._http.delete(url, **kwargs)

    async def aclose(self) -> None:
        await self._http.aclose()
        if self._posts is not None:
            await self._posts.close()
