"""`on_sent`: work the adapter does while vLLM works on a call starts only once the call's body is on its way."""

from __future__ import annotations

import asyncio
import threading

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from nemo_gym_tok.servers.inprocess import serve_in_thread
from responses_api_models.vllm_model.upstream import VLLMUpstream

WAIT_SECONDS = 10.0


def test_work_started_on_sent_runs_after_the_body_reached_the_server() -> None:
    """The callback scheduled from `on_sent` blocks the client's loop until the server thread has read the whole body:
    had it run before the body was written (as a callback scheduled before the send did), the server would never get
    it while the loop is blocked, and the wait would time out."""
    body_read = threading.Event()

    async def chat(request: Request) -> JSONResponse:
        received = await request.json()
        body_read.set()
        return JSONResponse({"echo": len(received["ids"])})

    app = Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"])])
    seen: list[bool] = []

    async def call(url: str) -> int:
        upstream = VLLMUpstream(api_key="k", timeout=30.0, max_attempts=1, backoff_seconds=0.01)
        loop = asyncio.get_running_loop()

        def sent() -> None:
            loop.call_soon(lambda: seen.append(body_read.wait(WAIT_SECONDS)))

        try:
            response = await upstream.post(url, "/v1/chat/completions", {"ids": list(range(50_000))}, on_sent=sent)
        finally:
            await upstream.aclose()
        return response.json()["echo"]

    with serve_in_thread(app) as url:
        assert asyncio.run(call(url)) == 50_000
    assert seen == [True]
