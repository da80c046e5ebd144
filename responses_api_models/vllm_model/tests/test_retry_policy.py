"""retry_policy.py's classes: what each failure says about whether an engine generated the turn."""

from __future__ import annotations

import asyncio

import aiohttp
import httpx
import pytest

from responses_api_models.vllm_model.retry_policy import (
    FINAL,
    MAYBE_GENERATED,
    NEVER_SENT,
    TIMED_OUT,
    classify_exception,
    classify_status,
)

REQUEST = httpx.Request("POST", "http://vllm:8000/v1/chat/completions")
VLLM_ERROR = b'{"error": {"message": "boom", "type": "InternalServerError", "code": 500}}'
ROUTER_ERROR = b"Request failed: error sending request for url (http://127.0.0.1:1/v1/chat/completions)"


@pytest.mark.parametrize(
    ("exc", "failure"),
    [
        (httpx.ConnectError("refused", request=REQUEST), NEVER_SENT),
        (httpx.ConnectTimeout("slow connect", request=REQUEST), NEVER_SENT),
        (httpx.PoolTimeout("no connection free", request=REQUEST), NEVER_SENT),
        (aiohttp.ConnectionTimeoutError("slow connect"), NEVER_SENT),
        (httpx.ReadTimeout("no answer", request=REQUEST), TIMED_OUT),
        (aiohttp.SocketTimeoutError("no answer"), TIMED_OUT),
        (asyncio.TimeoutError(), TIMED_OUT),
        (httpx.RemoteProtocolError("closed mid-answer", request=REQUEST), MAYBE_GENERATED),
        (aiohttp.ServerDisconnectedError(), MAYBE_GENERATED),
    ],
)
def test_transport_failures(exc: BaseException, failure: str) -> None:
    assert classify_exception(exc) == failure


@pytest.mark.parametrize(
    ("status", "body", "failure"),
    [
        (200, b"{}", None),
        (400, VLLM_ERROR, None),  # a client's mistake: passed on, never sent again
        (429, VLLM_ERROR, NEVER_SENT),
        (503, VLLM_ERROR, NEVER_SENT),  # vLLM not taking requests
        (500, VLLM_ERROR, FINAL),  # vLLM's own answer about this request
        (500, ROUTER_ERROR, MAYBE_GENERATED),  # vllm-router's: its worker died, maybe mid-turn
        (502, b"Bad Gateway", MAYBE_GENERATED),
        (503, b"Service Unavailable", MAYBE_GENERATED),  # a proxy's, not vLLM's
        (504, b"Gateway Timeout", TIMED_OUT),
    ],
)
def test_statuses(status: int, body: bytes, failure: str | None) -> None:
    assert classify_status(status, body) == failure
