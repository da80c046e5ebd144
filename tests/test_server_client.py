"""ServerClient's JSON POST (the agents' every call, over aiohttp): what a caller of the replaced httpx client saw."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from nemo_gym_tok.common.net import free_port
from nemo_gym_tok.servers.client import SESSION_HEADER, ServerClient
from nemo_gym_tok.servers.inprocess import serve_in_thread


async def echo(request: Request) -> JSONResponse:
    return JSONResponse(
        {
            "body": await request.json(),
            "auth": request.headers.get("authorization"),
            "session": request.headers.get(SESSION_HEADER),
            "type": request.headers.get("content-type"),
        },
        status_code=201,
        headers={"x-echo": "1"},
    )


async def slow(request: Request) -> JSONResponse:
    await asyncio.sleep(2)
    return JSONResponse({})


@pytest.fixture(scope="module")
def url():
    app = Starlette(routes=[Route("/echo", echo, methods=["POST"]), Route("/slow", slow, methods=["POST"])])
    with serve_in_thread(app) as served:
        yield served


def post(client: ServerClient, path: str, **kwargs) -> httpx.Response:
    async def run() -> httpx.Response:
        try:
            return await client.post("server", path, **kwargs)
        finally:
            await client.aclose()

    return asyncio.run(run())


def test_a_json_post_answers_as_httpx_would(url) -> None:
    client = ServerClient({"server": url}, auth_token="secret")
    answer = post(client, "/echo", json={"ids": [1, 2, 3]}, headers={SESSION_HEADER: "s1"})
    assert isinstance(answer, httpx.Response) and answer.status_code == 201
    assert answer.headers["x-echo"] == "1"
    assert answer.json() == {
        "body": {"ids": [1, 2, 3]},
        "auth": "Bearer secret",
        "session": "s1",
        "type": "application/json",
    }


def test_an_unreachable_server_is_an_httpx_connect_error() -> None:
    client = ServerClient({"server": f"http://127.0.0.1:{free_port('127.0.0.1')}"})
    with pytest.raises(httpx.ConnectError):
        post(client, "/echo", json={})


def test_a_slow_answer_is_an_httpx_read_timeout(url) -> None:
    client = ServerClient({"server": url}, timeout=httpx.Timeout(0.3, connect=5))
    with pytest.raises(httpx.ReadTimeout):
        post(client, "/slow", json={})
