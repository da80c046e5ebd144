"""A bare forwarding process, P1's floor: each request's bytes to vLLM and the answer's bytes back, nothing else.

    python bench/benchkit/passthrough.py UPSTREAM_URL PORT

Served as the adapter is (uvicorn, its own process, the gym servers' keep-alive) and forwarding as the adapter does
(one aiohttp session with the adapter's pool: `http_pool.aiohttp_session`), it costs what any hop between a client
and vLLM costs on this machine before the hop does any work of its own: P1 reports it next to the adapter, so the
adapter's own share is visible.
"""

from __future__ import annotations

import sys

import aiohttp
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from nemo_gym_tok.servers.http_pool import SERVER_KEEPALIVE_SECONDS, aiohttp_session, pool_limits


def app(upstream: str) -> Starlette:
    session: aiohttp.ClientSession | None = None

    async def forward(request: Request) -> Response:
        nonlocal session
        if session is None:
            session = aiohttp_session(pool_limits(), aiohttp.ClientTimeout(total=600), {})
        body = await request.body()
        headers = {"content-type": request.headers.get("content-type", "application/json")}
        async with session.request(request.method, upstream + request.url.path, data=body, headers=headers) as answer:
            content = await answer.read()
            return Response(content, status_code=answer.status, media_type=answer.headers.get("content-type"))

    return Starlette(routes=[Route("/{path:path}", forward, methods=["GET", "POST"])])


if __name__ == "__main__":
    uvicorn.run(
        app(sys.argv[1].rstrip("/")),
        host="127.0.0.1",
        port=int(sys.argv[2]),
        log_level="warning",
        timeout_keep_alive=SERVER_KEEPALIVE_SECONDS,
    )
