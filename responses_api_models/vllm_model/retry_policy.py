"""Which failed vLLM calls are sent again: never one that may still be generating, and a turn at most twice in all.

Each failure is put in one of four classes by what it says about the engine's work:
- NEVER_SENT: the request did not reach an engine (connection refused, a connect timeout, 429, vLLM's 503). Sent
  again up to `max_attempts`: no turn was generated.
- MAYBE_GENERATED: the request reached an engine that may have started the turn, and the turn is lost (the
  connection dropped mid-call, a proxy's 502, vllm-router's own 500 when its worker died). Sent again once: the
  turn is then generated at most twice.
- TIMED_OUT: no answer in time (a read timeout, a gateway's 504). Not sent again: the engine may still be producing
  the turn, and a second copy would generate it twice at once.
- FINAL: the engine answered for this very request (vLLM's own 5xx, with its JSON error): the same request would fail
  the same way again.
"""

from __future__ import annotations

import asyncio
from typing import Literal

import aiohttp
import httpx

FailureClass = Literal["never_sent", "maybe_generated", "timed_out", "final"]
NEVER_SENT: FailureClass = "never_sent"
MAYBE_GENERATED: FailureClass = "maybe_generated"
TIMED_OUT: FailureClass = "timed_out"
FINAL: FailureClass = "final"

MAX_GENERATIONS = 2
"""Attempts per call that may have generated the turn, the first included."""

_NOT_SENT_ERRORS = (
    httpx.ConnectError,
    httpx.ConnectTimeout,
    httpx.PoolTimeout,
    aiohttp.ClientConnectorError,
    aiohttp.ConnectionTimeoutError,
)
_TIMEOUTS = (httpx.TimeoutException, aiohttp.ServerTimeoutError, asyncio.TimeoutError)
TRANSPORT_ERRORS = (
    httpx.TransportError,
    aiohttp.ClientConnectionError,
    aiohttp.ClientPayloadError,
    asyncio.TimeoutError,
)
"""Failures of the connection or its timing, as either client raises them."""


def classify_exception(exc: BaseException) -> FailureClass:
    """The class of a transport failure (TRANSPORT_ERRORS)."""
    if isinstance(exc, _NOT_SENT_ERRORS):  # before the timeouts: a connect timeout is one of them too
        return NEVER_SENT
    if isinstance(exc, _TIMEOUTS):
        return TIMED_OUT
    return MAYBE_GENERATED


def classify_status(status: int, body: bytes) -> FailureClass | None:
    """The class of an answer's status, None for an answer that is not a failure to handle here (2xx, 4xx but 429).
    A 5xx with a JSON object body is vLLM's own answer about this request; one without (a router's or proxy's text)
    says the request did not get one."""
    if status == 429:
        return NEVER_SENT
    if status < 500:
        return None
    if status == 504:
        return TIMED_OUT
    if status == 503 and _is_json_object(body):
        return NEVER_SENT  # vLLM not ready, or shedding load: the request was not taken
    if status == 502 or not _is_json_object(body):
        return MAYBE_GENERATED
    return FINAL


def _is_json_object(body: bytes) -> bool:
    return body.lstrip()[:1] == b"{"
