"""HTTP calls to vLLM: retries only where a retry can help, vLLM's own errors reach the caller at once, with reasons.

The adapter's one call per model turn (POST, answer read whole) goes over aiohttp: its client costs the adapter less
CPU per call than httpx, httpcore and anyio (bench/p4_collect.py: 2.99 -> 1.80 ms per model call; most of what
is left is the sockets of the extra hop). Streams, GETs and health probes stay on httpx; every answer reaches the
caller as an httpx.Response, so nothing downstream knows which client read it.
"""

from __future__ import annotations

import asyncio
import contextvars
import re
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import httpx
from tenacity import AsyncRetrying, retry_if_exception, stop_after_attempt, wait_exponential

from nemo_gym_tok.common.exact_json import JSON_HEADERS, dumps, loads_exact
from nemo_gym_tok.common.keys import key_headers
from nemo_gym_tok.common.net import server_root
from nemo_gym_tok.common.remote_errors import error_message
from nemo_gym_tok.servers.api_errors import ApiError
from nemo_gym_tok.servers.client import SESSION_HEADER
from nemo_gym_tok.servers.http_pool import aiohttp_session, call_timeout, pool_limits, post_read_whole
from responses_api_models.vllm_model.retry_policy import (
    FINAL,
    MAX_GENERATIONS,
    MAYBE_GENERATED,
    NEVER_SENT,
    TIMED_OUT,
    TRANSPORT_ERRORS,
    FailureClass,
    classify_exception,
    classify_status,
)

_CONTEXT_OVERFLOW = re.compile(r"maximum context length|longer than the maximum model length", re.IGNORECASE)


SMALL_GET_SECONDS = 30.0
"""How long `get_small` waits for its answer at most."""
conversation: contextvars.ContextVar[str | None] = contextvars.ContextVar("vllm_conversation", default=None)
"""The conversation key of the call being served (session_key.py), sent on every request it makes to vLLM as the
`x-session-id` header vllm-router keeps a conversation on one replica by. A context variable: every upstream request
of one call (the chat call, the /tokenize fallback, the template proof, the weight-version reads) carries it without
each signature naming it, and concurrent calls each see their own."""


def _session_headers() -> dict[str, str]:
    key = conversation.get()
    return {SESSION_HEADER: key} if key else {}


class UpstreamStatusError(Exception):
    """vLLM (or a proxy before it) answered a status retry_policy.py puts in a class other than FINAL."""

    def __init__(self, response: httpx.Response, failure: FailureClass) -> None:
        super().__init__(f"HTTP {response.status_code}")
        self.response, self.failure = response, failure


class UpstreamUnavailable(ApiError):
    """The vLLM at `url` is at fault, not the request (unreachable: 503; 502/503/504 on every attempt, or a 5xx while
    its /health fails: 502)."""

    def __init__(self, status: int, message: str, url: str) -> None:
        super().__init__(status, message)
        self.url = url


def is_context_overflow(response: httpx.Response) -> bool:
    return response.status_code == 400 and bool(_CONTEXT_OVERFLOW.search(response.text))


def answer_json(response: httpx.Response, what: str) -> Any:
    """The JSON of vLLM's answer, read by orjson (an answer carries the prompt's ids twice: the stdlib takes
    milliseconds for them); a body that is not JSON (a proxy's error page) is a 502 naming `what` answered it."""
    try:
        return loads_exact(response.content)
    except ValueError:
        raise ApiError(
            502,
            f"{what} answered HTTP {response.status_code} with a body that is not JSON: {response.text[:200]!r}",
        ) from None


class VLLMUpstream:
    """Calls a vLLM server (POST JSON, GET); raises ApiError for anything the caller must see as an error."""

    def __init__(
        self,
        *,
        api_key: str,
        timeout: float | httpx.Timeout,
        max_attempts: int,
        backoff_seconds: float,
        limits: httpx.Limits | None = None,
    ) -> None:
        """`timeout` and `limits`: the adapter's config (BaseServerConfig.http_timeout(), http_limits()); a bare
        number of seconds times the whole call, with the gym's connect timeout."""
        self._timeout = timeout if isinstance(timeout, httpx.Timeout) else call_timeout(timeout)
        self._limits = limits or pool_limits()
        self._headers = key_headers(api_key)
        self._http = httpx.AsyncClient(timeout=self._timeout, limits=self._limits, headers=self._headers)
        self._posts: aiohttp.ClientSession | None = None
        self._gets: aiohttp.ClientSession | None = None
        self._max_attempts = max_attempts
        self._backoff_seconds = backoff_seconds
        self._epochs: dict[str, int] = {}

    def epoch(self, base_url: str) -> int:
        """How many connections this client opened to the server at `base_url`, plus its failed calls to it. A
        restarted server can only be reached over a new connection, so what was proven about the server (the
        adapter's template proofs) holds while this number stands still."""
        return self._epochs.get(_server_of(base_url), 0)

    def _new_epoch(self, url: str) -> None:
        server = _server_of(url)
        self._epochs[server] = self._epochs.get(server, 0) + 1

    async def post(
        self, base_url: str, path: str, body: dict[str, Any], *, on_sent: Callable[[], None] | None = None
    ) -> httpx.Response:
        """The response for a 2xx or 4xx answer (429 after its retries). Transport errors and 502/503/504 are retried,
        then raised as UpstreamUnavailable; any other 5xx is raised at once (see `_status_error`). `on_sent` is called
        as the body is written (before its write returns; on each attempt), for work that should wait until vLLM has
        the request and then overlap with it."""
        return await self._send("POST", base_url, path, body, on_sent=on_sent)

    async def get(self, base_url: str, path: str) -> httpx.Response:
        """GET with the same retries and errors as `post`."""
        return await self._send("GET", base_url, path, None)

    async def get_small(self, base_url: str, path: str) -> tuple[int, bytes] | None:
        """(status, body) of one GET of a small answer, or None when vLLM cannot be reached or does not answer within
        SMALL_GET_SECONDS. No retries, and no epoch counted (its connections are its own): for reads whose failure
        only loses what they tell (the weight version, weight_versions.py). Over aiohttp, whose GET costs the adapter
        about a third of httpx's CPU."""
        try:
            async with self._small_session().get(
                f"{server_root(base_url)}{path}", headers=_session_headers()
            ) as answer:
                return answer.status, await answer.read()
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return None

    async def post_small(
        self, base_url: str, path: str, body: dict[str, Any], timeout: float = SMALL_GET_SECONDS
    ) -> tuple[int, bytes] | None:
        """(status, body) of one POST with a small answer, or None when the server cannot be reached or does not answer
        within `timeout`. No retries, no epoch counted: for asking a server something, as `get_small`."""
        url = f"{server_root(base_url)}{path}"
        try:
            async with self._small_session().post(
                url, data=dumps(body), headers=JSON_HEADERS, timeout=aiohttp.ClientTimeout(total=timeout)
            ) as answer:
                return answer.status, await answer.read()
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return None

    def _small_session(self) -> aiohttp.ClientSession:
        if self._gets is None:  # made on first use: an aiohttp session belongs to the running loop
            timeout = aiohttp.ClientTimeout(total=min(self._timeout.read or SMALL_GET_SECONDS, SMALL_GET_SECONDS))
            self._gets = aiohttp_session(self._limits, timeout, self._headers)
        return self._gets

    async def open_stream(
        self, base_url: str, path: str, body: dict[str, Any], *, on_sent: Callable[[], None] | None = None
    ) -> httpx.Response:
        """POST for a streamed answer, with the same retries and errors as `post`: the response once its status and
        headers are in, its body still to read (`aiter_lines`); the caller must `aclose()` it. `on_sent`: as in
        `post`, called once the body is written."""
        return await self._send("POST", base_url, path, body, stream=True, on_sent=on_sent)

    async def _send(
        self,
        method: str,
        base_url: str,
        path: str,
        body: dict[str, Any] | None,
        *,
        stream: bool = False,
        on_sent: Callable[[], None] | None = None,
    ) -> httpx.Response:
        """One call, sent again only as retry_policy.py allows: a failure that never reached an engine up to
        max_attempts, one that may have generated the turn once (MAX_GENERATIONS), a timeout or vLLM's own error
        never."""
        url = f"{server_root(base_url)}{path}"
        # Written once, by orjson, for every attempt: the body carries the history's ids.
        content = None if body is None else dumps(body)
        headers = {**(JSON_HEADERS if body is not None else {}), **_session_headers()}
        generations = 0

        def send_again(exc: BaseException) -> bool:
            nonlocal generations
            failure = exc.failure if isinstance(exc, UpstreamStatusError) else classify_exception(exc)
            if failure == MAYBE_GENERATED:
                generations += 1
                return generations < MAX_GENERATIONS
            return failure == NEVER_SENT

        retrying = AsyncRetrying(
            stop=stop_after_attempt(self._max_attempts),
            wait=wait_exponential(multiplier=self._backoff_seconds, max=10),
            retry=retry_if_exception(lambda e: isinstance(e, RETRIED_ERRORS) and send_again(e)),
            reraise=True,
        )
        try:
            async for attempt in retrying:
                with attempt:
                    response = await self._attempt(method, url, content, headers, stream, on_sent)
                    failure = classify_status(response.status_code, response.content if not stream else b"{")
                    if failure is None:
                        return response
                    if stream:  # read the error text for the message and the class, and give the connection back
                        await response.aread()
                        await response.aclose()
                        failure = classify_status(response.status_code, response.content)
                    if failure == FINAL:
                        raise await self._status_error(base_url, url, response)
                    raise UpstreamStatusError(response, failure)
        except UpstreamStatusError as exc:
            return self._after_status(exc, url, base_url)
        except TRANSPORT_ERRORS as exc:
            raise self._after_transport(exc, url, base_url) from None
        raise AssertionError("unreachable")

    async def _attempt(
        self,
        method: str,
        url: str,
        content: bytes | None,
        headers: dict[str, str],
        stream: bool,
        on_sent: Callable[[], None] | None = None,
    ) -> httpx.Response:
        try:
            if stream:
                request = self._http.build_request(
                    method,
                    url,
                    content=content,
                    headers=headers,
                    extensions={"trace": self._stream_trace(url, on_sent)},
                )
                response = await self._http.send(request, stream=True)
            elif method == "POST":
                response = await self._post(url, content or b"", headers, on_sent)
            else:
                response = await self._http.request(method, url, content=content, headers=headers)
        except TRANSPORT_ERRORS:
            self._new_epoch(url)
            raise
        if response.status_code >= 500:
            self._new_epoch(url)
        return response

    def _after_status(self, exc: UpstreamStatusError, url: str, base_url: str) -> httpx.Response:
        """The answer to pass on (429 on every attempt: like any 4xx), or the UpstreamUnavailable that says why the
        call was not sent again."""
        status = exc.response.status_code
        if status < 500:
            return exc.response
        why = {
            NEVER_SENT: f"{self._max_attempts} times",
            MAYBE_GENERATED: f"after {MAX_GENERATIONS} attempts that may each have generated the turn (not sent again)",
            TIMED_OUT: "(a timeout: not sent again, the engine may still be producing the turn)",
        }[exc.failure]
        raise UpstreamUnavailable(
            502 if exc.failure != TIMED_OUT else 504,
            f"vLLM at {url} answered HTTP {status} {why}: {error_message(exc.response)}",
            base_url,
        )

    def _after_transport(self, exc: BaseException, url: str, base_url: str) -> UpstreamUnavailable:
        failure = classify_exception(exc)
        if failure == TIMED_OUT:
            return UpstreamUnavailable(
                504,
                f"vLLM at {url} did not answer within the adapter's timeout ({type(exc).__name__}); not sent again: "
                "the engine may still be producing this turn, and a second copy would generate it twice. Raise the "
                "adapter's request_timeout_seconds for longer turns",
                base_url,
            )
        if failure == MAYBE_GENERATED:
            return UpstreamUnavailable(
                502,
                f"vLLM at {url} dropped the call {MAX_GENERATIONS} times ({type(exc).__name__}: {exc}); not sent "
                "again, so the turn is generated at most twice",
                base_url,
            )
        return UpstreamUnavailable(
            503,
            f"vLLM at {url} is unreachable after {self._max_attempts} attempts: {type(exc).__name__}: {exc}",
            base_url,
        )

    async def _post(
        self, url: str, content: bytes, headers: dict[str, str], on_sent: Callable[[], None] | None
    ) -> httpx.Response:
        """POST a JSON body over aiohttp and read the answer whole (see the module docstring)."""
        if self._posts is None:  # made on first use: an aiohttp session belongs to the running loop
            timeout = aiohttp.ClientTimeout(total=self._timeout.read, connect=self._timeout.connect)
            tracing = aiohttp.TraceConfig()
            tracing.on_request_start.append(_remember_url)
            tracing.on_connection_create_end.append(self._on_connection_created)
            tracing.on_request_chunk_sent.append(_body_written)
            self._posts = aiohttp_session(self._limits, timeout, self._headers, trace_configs=[tracing])
        context = None if on_sent is None else {ON_SENT_KEY: on_sent}
        return await post_read_whole(self._posts, url, content, headers, trace_context=context)

    async def _on_connection_created(self, _session: Any, context: Any, _params: Any) -> None:
        self._new_epoch(context.url)

    def _stream_trace(self, url: str, on_sent: Callable[[], None] | None) -> Any:
        """httpcore's trace callback for a streamed request to `url`: a new connection is a new epoch; `on_sent` is
        called once the body is written."""

        async def trace(event: str, _info: dict[str, Any]) -> None:
            if event == "connection.connect_tcp.complete":
                self._new_epoch(url)
            elif event == "http11.send_request_body.complete" and on_sent is not None:
                on_sent()

        return trace

    async def _status_error(self, base_url: str, url: str, response: httpx.Response) -> ApiError:
        """A 5xx that is not retried: the request's own error (502 with vLLM's reason) while the server's /health
        answers 200, else the server's failure (UpstreamUnavailable, 502 saying so)."""
        reason = f"vLLM at {url} answered HTTP {response.status_code}: {error_message(response)}"
        if await self.healthy(base_url):
            return ApiError(502, reason, error_type="upstream_error")
        return UpstreamUnavailable(502, f"{reason} (and its GET /health does not answer 200)", base_url)

    async def healthy(self, base_url: str, timeout: float = 5.0) -> bool:
        """True when vLLM's `GET /health` answers 200 within `timeout`."""
        try:
            response = await self._http.get(f"{server_root(base_url)}/health", timeout=timeout)
        except httpx.HTTPError:
            return False
        return response.status_code == 200

    async def aclose(self) -> None:
        await self._http.aclose()
        if self._posts is not None:
            await self._posts.close()
        if self._gets is not None:
            await self._gets.close()


def _server_of(url: str) -> str:
    parts = urlsplit(str(url))
    return f"{parts.scheme}://{parts.netloc}"


async def _remember_url(_session: Any, context: Any, params: Any) -> None:
    context.url = str(params.url)  # the connection-created signal of the same request reads it


ON_SENT_KEY = "on_sent"
"""The key of a POST's trace context holding its `on_sent` callback."""


async def _body_written(_session: Any, context: Any, _params: Any) -> None:
    # aiohttp signals each chunk just before writing it, with nothing awaited in between: a callback that only
    # schedules work (TurnMeasurement.start) sees it run after the write.
    callback = (context.trace_request_ctx or {}).get(ON_SENT_KEY)
    if callback is not None:
        callback()


RETRIED_ERRORS = (*TRANSPORT_ERRORS, UpstreamStatusError)
"""What `_send` may send again, as retry_policy.py classes it."""
