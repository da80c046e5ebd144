"""HTTP calls to vLLM with bounded retries: unreachable or 5xx becomes a clear 503/502, 4xx passes through."""

from __future__ import annotations

import re
from typing import Any

import httpx
from tenacity import AsyncRetrying, RetryError, retry_if_exception, stop_after_attempt, wait_exponential

from nemo_gym_tok.http_errors import error_message
from nemo_gym_tok.servers.errors import ApiError

_CONTEXT_OVERFLOW = re.compile(r"maximum context length|longer than the maximum model length", re.IGNORECASE)


class UpstreamStatusError(Exception):
    """vLLM answered 5xx; retried, then reported as 502."""

    def __init__(self, response: httpx.Response) -> None:
        super().__init__(f"HTTP {response.status_code}")
        self.response = response


def root_url(base_url: str) -> str:
    """`http://host:port` from a base URL given with or without a trailing `/v1`."""
    return re.sub(r"/v1/?$", "", base_url.rstrip("/"))


def is_context_overflow(response: httpx.Response) -> bool:
    return response.status_code == 400 and bool(_CONTEXT_OVERFLOW.search(response.text))


class VLLMUpstream:
    """POSTs JSON to a vLLM server; raises ApiError for anything the caller must see as an error."""

    def __init__(self, *, api_key: str, timeout: float, max_attempts: int, backoff_seconds: float) -> None:
        self._http = httpx.AsyncClient(timeout=timeout, headers={"Authorization": f"Bearer {api_key}"})
        self._max_attempts = max_attempts
        self._backoff_seconds = backoff_seconds

    async def post(self, base_url: str, path: str, body: dict[str, Any]) -> httpx.Response:
        """The response for a 2xx or 4xx answer; 5xx and transport errors are retried, then raised as ApiError."""
        url = f"{root_url(base_url)}{path}"
        retrying = AsyncRetrying(
            stop=stop_after_attempt(self._max_attempts),
            wait=wait_exponential(multiplier=self._backoff_seconds, max=10),
            retry=retry_if_exception(lambda e: isinstance(e, (httpx.TransportError, UpstreamStatusError))),
        )
        try:
            async for attempt in retrying:
                with attempt:
                    response = await self._http.post(url, json=body)
                    if response.status_code >= 500:
                        raise UpstreamStatusError(response)
                    return response
        except RetryError as exc:
            last = exc.last_attempt.exception()
            if isinstance(last, UpstreamStatusError):
                raise ApiError(
                    502,
                    f"vLLM at {url} answered HTTP {last.response.status_code} {self._max_attempts} times: "
                    f"{error_message(last.response)}",
                ) from None
            raise ApiError(
                503, f"vLLM at {url} is unreachable after {self._max_attempts} attempts: {type(last).__name__}: {last}"
            ) from None
        raise AssertionError("unreachable")

    async def aclose(self) -> None:
        await self._http.aclose()
