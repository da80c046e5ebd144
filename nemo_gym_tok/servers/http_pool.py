"""Connection pools and timeouts of the gym's HTTP clients (collector to agent, agent to servers, adapter to vLLM)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import httpx

if TYPE_CHECKING:
    import aiohttp

DEFAULT_MAX_CONNECTIONS = 512
"""Connections one client holds open at most, in the collector, in every server's client and in the adapter's client
to vLLM alike. A call past it waits for a free connection, so it caps the calls in flight per process; httpx's own
default (100) did that below the concurrency a collection asks for. 512 is far above `ngt collect --concurrency`'s
default (8) and `ngt demo`'s (4); a larger --concurrency needs `max_connections` raised to match on the agent and
the adapter (the collector sizes its own pool to it)."""
DEFAULT_KEEPALIVE_EXPIRY_SECONDS = 4.0
"""An idle connection is dropped after this: under the 5 s an idle connection stays open on uvicorn and on vLLM by
default (VLLM_HTTP_TIMEOUT_KEEP_ALIVE), so a gym client never sends on a connection that a server it did not start
is closing."""
SERVER_KEEPALIVE_SECONDS = 30
"""How long a gym server, and a vLLM started by `ngt vllm-serve`, keeps an idle connection open: longer than common
clients keep one (httpx and the OpenAI SDK 5 s, aiohttp 15 s, the gym's own clients 4 s). The client must be the side
that drops an idle connection: when the server drops it just as the client sends on it, the server's kernel answers
the unread request with a reset, and the client's call fails with a read error: the likely cause of one CI run's
`httpx.ReadError` (vLLM at its 5 s, a test's httpx client at httpx's 5 s, 20 conversations at once)."""
DEFAULT_CONNECT_TIMEOUT_SECONDS = 10.0
"""Opening a connection takes milliseconds on a working network; a host that does not answer within this is down, and
the call fails (and, in the adapter, is retried or fails over) in seconds rather than after the whole call's timeout."""
DEFAULT_REQUEST_TIMEOUT_SECONDS = 600.0
"""Longest wait for one call's answer (httpx's read, write and pool timeouts): a long generation fits in it."""


def pool_limits(
    max_connections: int = DEFAULT_MAX_CONNECTIONS,
    max_keepalive_connections: int | None = None,
) -> httpx.Limits:
    """httpx limits of a gym client: `max_connections` in all, as many kept alive unless `max_keepalive_connections`
    says fewer (a connection closed after each call costs a new TCP handshake on the next)."""
    keepalive = max_connections if max_keepalive_connections is None else max_keepalive_connections
    return httpx.Limits(
        max_connections=max_connections,
        max_keepalive_connections=keepalive,
        keepalive_expiry=DEFAULT_KEEPALIVE_EXPIRY_SECONDS,
    )


def call_timeout(
    request_seconds: float = DEFAULT_REQUEST_TIMEOUT_SECONDS,
    connect_seconds: float = DEFAULT_CONNECT_TIMEOUT_SECONDS,
) -> httpx.Timeout:
    """httpx timeouts of a gym client: `connect_seconds` to open a connection, `request_seconds` for the rest (each
    read and write, and the wait for a free connection from the pool)."""
    return httpx.Timeout(request_seconds, connect=min(connect_seconds, request_seconds))


def aiohttp_session(
    limits: httpx.Limits,
    timeout: aiohttp.ClientTimeout,
    headers: Mapping[str, str],
    trace_configs: list[aiohttp.TraceConfig] | None = None,
) -> aiohttp.ClientSession:
    """An aiohttp.ClientSession with a gym client's pool (`limits`: size and idle expiry) and `timeout`. It reads no
    proxy or netrc settings from the environment (reading netrc costs a thread hop per request) and keeps no cookies:
    gym clients talk to their own servers. Make it on the running loop."""
    import aiohttp  # lazy: `ngt collect` imports the light client module, which never makes one

    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(
            limit=limits.max_connections or 0,
            keepalive_timeout=limits.keepalive_expiry or DEFAULT_KEEPALIVE_EXPIRY_SECONDS,
        ),
        timeout=timeout,
        headers=dict(headers),
        cookie_jar=aiohttp.DummyCookieJar(),
        trace_configs=trace_configs,
    )


async def post_read_whole(
    session: aiohttp.ClientSession,
    url: str,
    content: bytes,
    headers: Mapping[str, str],
    trace_context: Mapping[str, Any] | None = None,
) -> httpx.Response:
    """POST `content` over `session` and read the answer whole, as an httpx.Response: callers downstream do not know
    which client read it. aiohttp's exceptions pass through. `trace_context`: what the session's trace signals of this
    request get as `trace_request_ctx`."""
    async with session.post(url, data=content, headers=headers, trace_request_ctx=trace_context) as answer:
        body = await answer.read()
        return httpx.Response(
            answer.status, content=body, headers=list(answer.raw_headers), request=httpx.Request("POST", url)
        )
