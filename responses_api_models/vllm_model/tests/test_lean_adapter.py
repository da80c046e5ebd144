"""A lean adapter (issue 11, point 3): pools sized from config, orjson on the id-heavy paths, bad input still clear."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from nemo_gym_tok.common.exact_json import dumps, has_wide_integer, loads_exact
from nemo_gym_tok.servers import serve
from nemo_gym_tok.servers.api_errors import ApiError
from nemo_gym_tok.servers.base import BaseServerConfig
from nemo_gym_tok.servers.bodies import parse_json_object
from nemo_gym_tok.servers.client import ServerClient
from nemo_gym_tok.servers.http_pool import (
    DEFAULT_CONNECT_TIMEOUT_SECONDS,
    DEFAULT_KEEPALIVE_EXPIRY_SECONDS,
    DEFAULT_MAX_CONNECTIONS,
    pool_limits,
)
from nemo_gym_tok.servers.inprocess import serve_in_thread
from nemo_gym_tok.servers.json_response import JSONBytesResponse
from responses_api_models.vllm_model.app import VLLMModel, VLLMModelConfig
from responses_api_models.vllm_model.tests.fake_upstream import FakeUpstream, chat_completion
from responses_api_models.vllm_model.token_capture import attach_bundles, check_required_prefix

USER = {"role": "user", "content": "hi"}
HTTPX_DEFAULT_POOL = 100
"""httpx's own max_connections, which capped the adapter's and the agents' calls in flight before."""
MANY = HTTPX_DEFAULT_POOL + 30


@dataclass
class HoldingUpstream:
    """A vLLM stand-in that holds every chat call until told to answer, counting how many it holds at once."""

    held: int = 0
    most_held: int = 0
    release: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def app(self) -> FastAPI:
        app = FastAPI()

        @app.post("/v1/chat/completions")
        async def chat(request: Request) -> JSONResponse:
            body = await request.json()
            with self.lock:
                self.held += 1
                self.most_held = max(self.most_held, self.held)
            while not self.release.is_set():
                await asyncio.sleep(0.01)
            with self.lock:
                self.held -= 1
            return JSONResponse(chat_completion(body.get("model", "m"), {"role": "assistant", "content": "ok"}))

        return app

    def wait_for(self, target: int, then_seconds: float, limit_seconds: float = 60.0) -> None:
        """Until `target` calls are held (or `limit_seconds` pass), then `then_seconds` more: time for calls past a
        pool's cap to arrive if the cap did not hold them back."""
        deadline = time.monotonic() + limit_seconds
        while self.held < target and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(then_seconds)


async def most_held(
    upstream: HoldingUpstream,
    calls: int,
    send: Callable[[], Awaitable[httpx.Response]],
    cap: int | None,
) -> int:
    """Make `calls` chat calls at once through `send`; the most `upstream` held at once (then all are answered).
    With a `cap`, waits for that many and then a second for more; without, waits for all of them."""
    tasks = [asyncio.create_task(send()) for _ in range(calls)]
    await asyncio.to_thread(upstream.wait_for, cap or calls, 1.0 if cap else 0.0)
    upstream.release.set()
    answers = await asyncio.gather(*tasks)
    assert [answer.status_code for answer in answers] == [200] * calls
    return upstream.most_held


def adapter_calls_held(adapter: str, upstream: HoldingUpstream, calls: int, cap: int | None = None) -> int:
    async def run() -> int:
        async with httpx.AsyncClient(timeout=120, limits=pool_limits(calls + 10)) as http:
            return await most_held(
                upstream,
                calls,
                lambda: http.post(f"{adapter}/v1/chat/completions", json={"model": "m", "messages": [USER]}),
                cap,
            )

    return asyncio.run(run())


def server_client_calls_held(
    url: str,
    upstream: HoldingUpstream,
    calls: int,
    cap: int | None = None,
    **options: Any,
) -> int:
    async def run() -> int:
        client = ServerClient({"model": url}, **options)
        try:
            return await most_held(
                upstream,
                calls,
                lambda: client.post("model", "/v1/chat/completions", json={"model": "m", "messages": [USER]}),
                cap,
            )
        finally:
            await client.aclose()

    return asyncio.run(run())


@pytest.fixture
def holding() -> Iterator[tuple[str, HoldingUpstream]]:
    upstream = HoldingUpstream()
    with serve_in_thread(upstream.app()) as url:
        yield url, upstream


def adapter_url(base_url: str, **fields: Any) -> Iterator[str]:
    config = VLLMModelConfig(base_url=base_url, model="m", **fields)
    with serve_in_thread(VLLMModel("policy_model", config).build_app()) as url:
        yield url


# Pools and timeouts from config.


def test_every_server_has_pool_and_timeout_keys_with_the_gyms_defaults() -> None:
    config = BaseServerConfig()
    assert config.max_connections == DEFAULT_MAX_CONNECTIONS == 512
    limits, timeout = config.http_limits(), config.http_timeout()
    assert limits.max_connections == 512 and limits.max_keepalive_connections == 512
    assert limits.keepalive_expiry == DEFAULT_KEEPALIVE_EXPIRY_SECONDS < 5  # under uvicorn's and vLLM's keep-alive
    assert timeout.connect == DEFAULT_CONNECT_TIMEOUT_SECONDS and timeout.read == 600.0 and timeout.pool == 600.0
    custom = BaseServerConfig(
        max_connections=40, max_keepalive_connections=8, connect_timeout_seconds=2, request_timeout_seconds=30
    )
    assert (custom.http_limits().max_connections, custom.http_limits().max_keepalive_connections) == (40, 8)
    assert (custom.http_timeout().connect, custom.http_timeout().read) == (2, 30)
    with pytest.raises(ValueError):
        BaseServerConfig(max_connections=0)
    # The adapter's timeout key is the same one (one vLLM call), so a config written before keeps working.
    assert VLLMModelConfig(base_url="http://x", model="m", request_timeout_seconds=5).http_timeout().read == 5


def test_the_adapter_has_more_calls_in_flight_to_vllm_than_httpx_default_pool(holding) -> None:
    url, upstream = holding
    for adapter in adapter_url(url):
        assert adapter_calls_held(adapter, upstream, MANY) == MANY


def test_the_adapter_pool_is_its_config(holding) -> None:
    url, upstream = holding
    for adapter in adapter_url(url, max_connections=3):
        assert adapter_calls_held(adapter, upstream, 12, cap=3) == 3


def test_the_servers_client_has_more_calls_in_flight_than_httpx_default_pool(holding) -> None:
    url, upstream = holding
    assert server_client_calls_held(url, upstream, MANY) == MANY


def test_the_servers_client_pool_is_what_it_is_given(holding) -> None:
    url, upstream = holding
    assert server_client_calls_held(url, upstream, 12, cap=4, limits=pool_limits(4)) == 4


def test_ngt_run_children_build_their_client_from_their_config(monkeypatch: pytest.MonkeyPatch) -> None:
    built: dict[str, Any] = {}

    class RecordingClient(ServerClient):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            built.update(kwargs)
            super().__init__(*args, **kwargs)

    spec = {
        "name": "env",
        "kind": "resources_servers",
        "implementation": "number_guess",
        "fields": {"port": 0, "max_connections": 64, "request_timeout_seconds": 90, "connect_timeout_seconds": 3},
        "servers": {},
        "head_url": None,
        "listen_fd": None,
    }
    monkeypatch.setenv(serve.SPEC_ENV, json.dumps(spec))
    monkeypatch.setattr(serve, "ServerClient", RecordingClient)
    monkeypatch.setattr(serve.uvicorn.Server, "run", lambda self, sockets=None: None)
    assert serve.main() == 0
    assert built["limits"].max_connections == 64 and built["limits"].max_keepalive_connections == 64
    assert (built["timeout"].read, built["timeout"].connect) == (90, 3)


# JSON: orjson where it is exact, the stdlib's answers (and messages) everywhere else.


def test_an_integer_past_64_bits_reaches_vllm_exact() -> None:
    fake = FakeUpstream("fake")
    with serve_in_thread(fake.app()) as url:
        for adapter in adapter_url(url):
            schema = {"type": "object", "properties": {"x": {"enum": [10**30]}}}
            body = {
                "messages": [USER],
                "response_format": {"type": "json_schema", "json_schema": {"schema": schema}},
                "seed": 2**64 + 1,
            }
            answer = httpx.post(
                f"{adapter}/v1/chat/completions", content=json.dumps(body), headers={"content-type": "application/json"}
            )
            assert answer.status_code == 200, answer.text
    sent = fake.requests[-1]  # the stand-in reads with the stdlib: a float would show as 1e+30
    assert sent["seed"] == 2**64 + 1 and isinstance(sent["seed"], int)
    assert sent["response_format"]["json_schema"]["schema"]["properties"]["x"]["enum"] == [10**30]


@pytest.mark.parametrize(
    "raw, message",
    [
        (b'{"messages": [1,]}', "request body is not valid JSON: Expecting value"),  # orjson's words would differ
        (b'{"a": 1} x', "request body is not valid JSON: Extra data"),
        (b'{"a": NaN}', "NaN is not a JSON number"),
        (b'{"a": "\\udfff"}', "a: a string has a lone UTF-16 surrogate"),
        (b'{"a": 1e999}', "out of range for a 64-bit float"),
    ],
)
def test_the_adapter_names_what_is_wrong_with_a_body_as_before(raw: bytes, message: str) -> None:
    fake = FakeUpstream("fake")
    with serve_in_thread(fake.app()) as url:
        for adapter in adapter_url(url):
            answer = httpx.post(
                f"{adapter}/v1/chat/completions", content=raw, headers={"content-type": "application/json"}
            )
    assert answer.status_code == 400, answer.text
    assert message in answer.json()["error"]["message"]
    assert fake.requests == []


def test_parse_json_object_agrees_with_the_stdlib_on_good_bodies() -> None:
    bodies = [
        {"messages": [USER], "ids": list(range(0, 300000, 7)), "p": [-0.5, 1e-300, 5e-324, 1.7976931348623157e308]},
        {"text": "é \u2028 \U0001f600 \\ud800 (escaped backslash)", "nested": [[[[{"a": None}]]]], "big": 2**63},
    ]
    for body in bodies:
        raw = json.dumps(body, ensure_ascii=False).encode()
        assert parse_json_object(raw) == json.loads(raw)
    assert parse_json_object(b"\xef\xbb\xbf" + json.dumps(bodies[0]).encode()) == bodies[0]  # a BOM, as before
    assert parse_json_object(b'{"n": 123456789012345678901234567890}') == {"n": 123456789012345678901234567890}


def test_wide_integer_detection() -> None:
    assert has_wide_integer(b'{"a": 1000000000000000000}')  # 19 digits
    assert has_wide_integer(b'{"a": "id 12345678901234567890"}')  # in a string: the stdlib reads it, just as well
    assert not has_wide_integer(b'{"a": [123456789012345678, 1, 2]}')  # 18 digits: orjson's int is exact


def test_dumps_writes_what_orjson_cannot_through_the_stdlib() -> None:
    assert dumps({"a": [1, 2], "s": "é"}) == '{"a":[1,2],"s":"é"}'.encode()
    assert json.loads(dumps({"n": 10**30})) == {"n": 10**30}
    assert json.loads(dumps({1: "int key"})) == {"1": "int key"}
    assert JSONBytesResponse({"n": 10**30, "ids": [1, 2]}).body == b'{"n":1000000000000000000000000000000,"ids":[1,2]}'


def test_loads_of_an_answer_keeps_the_stdlib_leniency() -> None:
    assert loads_exact(b'{"ids": [1, 2]}') == {"ids": [1, 2]}
    assert loads_exact('{"a": NaN}')["a"] != loads_exact('{"a": NaN}')["a"]  # NaN: what response.json() gave before
    assert loads_exact(b'{"n": 123456789012345678901234567890}')["n"] == 123456789012345678901234567890  # not a float
    with pytest.raises(ValueError):
        loads_exact(b"<html>")


def test_a_vllm_answer_that_is_not_json_is_a_502_naming_vllm() -> None:
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat() -> Response:
        return Response(b"<html>proxy error</html>", media_type="text/html")

    with serve_in_thread(app) as url:
        for adapter in adapter_url(url):
            answer = httpx.post(f"{adapter}/v1/chat/completions", json={"messages": [USER]})
    assert answer.status_code == 502, answer.text
    message = answer.json()["error"]["message"]
    assert (
        message.startswith("vLLM at http://127.0.0.1:") and "answered HTTP 200 with a body that is not JSON" in message
    )
    assert "'<html>proxy error</html>'" in message


# Forwarding what was validated, unchanged.


def hooked_stand_in(received: list[dict[str, Any]]) -> FastAPI:
    """A hooked vLLM as the adapter sees it: records each body, answers with the prefix + one id and its bundle."""
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> JSONResponse:
        body = await request.json()
        received.append(body)
        last = next(m for m in reversed(body["messages"]) if m.get("prompt_token_ids") is not None)
        prompt = [*last["prompt_token_ids"], *last["generation_token_ids"], 8]
        message = {
            "role": "assistant",
            "content": "ok",
            "prompt_token_ids": prompt,
            "generation_token_ids": [9],
            "generation_log_probs": [-0.1],
        }
        answer = chat_completion("m", message)
        answer["prompt_token_ids"] = prompt
        answer["choices"][0].update(token_ids=[9], logprobs={"content": [{"token": "token_id:9", "logprob": -0.1}]})
        return JSONResponse(answer)

    return app


def test_vllm_gets_the_callers_body_as_validated() -> None:
    history = [
        USER,
        {
            "role": "assistant",
            "content": "a",
            "reasoning": "thought",
            "custom": {"kept": [1, 2]},
            "prompt_token_ids": [5, 6],
            "generation_token_ids": [7],
            "generation_log_probs": [-1],
        },
        {"role": "user", "content": "b"},
    ]
    body = {"model": "x", "messages": history, "stream": "false", "n": "1", "vllm_xargs": {"k": "v"}, "top_k": 3}
    received: list[dict[str, Any]] = []
    with serve_in_thread(hooked_stand_in(received)) as url:
        for adapter in adapter_url(url, splice="hook", return_token_id_information=True):
            answer = httpx.post(f"{adapter}/v1/chat/completions", json=body)
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["message"]["prompt_token_ids"] == [5, 6, 7, 8]
    sent = received[-1]
    assert sent["model"] == "m" and sent["stream"] is False and sent["n"] == 1  # what the adapter read, coerced
    assert sent["vllm_xargs"] == {"k": "v"} and sent["top_k"] == 3 and sent["return_token_ids"] is True
    assistant = sent["messages"][1]
    # reasoning is renamed as the validated model reads it; every other field, bundle included, goes as sent
    assert assistant == {
        "role": "assistant",
        "content": "a",
        "reasoning_content": "thought",
        "custom": {"kept": [1, 2]},
        "prompt_token_ids": [5, 6],
        "generation_token_ids": [7],
        "generation_log_probs": [-1],
    }
    assert sent["messages"][0] == USER and sent["messages"][2] == history[2]


def test_sources_that_disagree_are_still_refused_naming_the_position() -> None:
    ids = list(range(100, 7100))
    result = {
        "prompt_token_ids": [*ids[:4000], 1, *ids[4001:]],
        "choices": [
            {
                "index": 0,
                "token_ids": [9],
                "message": {
                    "role": "assistant",
                    "content": "",
                    "prompt_token_ids": ids,
                    "generation_token_ids": [9],
                    "generation_log_probs": [-0.1],
                },
            }
        ],
    }
    with pytest.raises(ApiError) as refused:
        asyncio.run(
            attach_bundles(
                result,
                generation_body={},
                required_prefix=None,
                return_bundle=True,
                tokenize=_no_tokenize,
                upstream_url="http://v",
            )
        )
    assert refused.value.status == 502
    assert "prompt_token_ids from message and from return_token_ids disagree at position 4000" in refused.value.message


def test_agreeing_sources_give_one_bundle_with_its_source() -> None:
    ids = list(range(100, 7100))
    result = {
        "prompt_token_ids": list(ids),
        "choices": [
            {
                "index": 0,
                "token_ids": [9],
                "message": {
                    "role": "assistant",
                    "content": "",
                    "prompt_token_ids": ids,
                    "generation_token_ids": [9],
                    "generation_log_probs": [-0.1],
                },
            }
        ],
    }
    asyncio.run(
        attach_bundles(
            result,
            generation_body={},
            required_prefix=ids[:5000],
            return_bundle=True,
            tokenize=_no_tokenize,
            upstream_url="http://v",
        )
    )
    message = result["choices"][0]["message"]
    assert message["prompt_token_ids"] == ids and message["token_source"] == "message"


def test_a_prompt_without_the_prefix_is_still_refused_naming_the_position() -> None:
    prompt = list(range(7000))
    check_required_prefix(prompt, prompt[:6000], None, server="the vLLM server at http://v")  # starts with it: no error
    with pytest.raises(ApiError) as refused:
        check_required_prefix(prompt, [*prompt[:5000], -1], None, server="the vLLM server at http://v")
    assert refused.value.error_type == "prefix_not_spliced" and "at position 5000" in refused.value.message
    with pytest.raises(ApiError, match="found end of prompt"):
        check_required_prefix(prompt[:10], prompt[:11], None, server="the vLLM server at http://v")


async def _no_tokenize(body: dict[str, Any]) -> list[int]:
    raise AssertionError("no /tokenize expected: vLLM reported the prompt ids")
