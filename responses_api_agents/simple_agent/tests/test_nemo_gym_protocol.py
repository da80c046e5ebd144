"""The simple agent's `environment_protocol: nemo_gym` against a stand-in NeMo Gym resources server (no vLLM).

The stand-in keeps state under a cookie it sets on /seed_session and rotates on every tool answer, answers tools with
bodies the model must read verbatim (an error status included), echoes the request on /verify as NeMo Gym's servers do,
and serves /close_session with an optional body. The model is scripted. The live check against NeMo Gym's own servers
and simple agent is tests/nemo_gym/test_collect_nemo_gym_envs.py (`make test-nemo-gym`).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from contextlib import ExitStack
from typing import Any

import httpx
import pytest
from fastapi import Body, FastAPI, Request
from fastapi.responses import JSONResponse, Response

from nemo_gym_tok.servers.client import ServerClient
from nemo_gym_tok.servers.inprocess import serve_in_thread
from responses_api_agents.simple_agent import nemo_gym_protocol
from responses_api_agents.simple_agent.app import SimpleAgent, SimpleAgentConfig

TOOLS = [
    {"type": "function", "name": name, "parameters": {"type": "object", "properties": {}}}
    for name in ("add", "broken", "verify")
]


class Environment:
    """A NeMo Gym-like resources server: state by cookie, raw tool bodies, /verify echo, close by cookie."""

    def __init__(self, serve_close: bool = True) -> None:
        self.totals: dict[str, int] = {}
        self.closed: list[str] = []
        self.verified: list[dict[str, Any]] = []
        self.app = FastAPI()
        app = self.app

        @app.post("/seed_session")
        async def seed(body: dict[str, Any] = Body()) -> Response:
            sid = uuid.uuid4().hex
            self.totals[sid] = int(body["start"])
            answer = JSONResponse({})
            answer.set_cookie("sid", sid)
            answer.set_cookie("turn", "0")
            return answer

        @app.post("/add")
        async def add(request: Request, body: dict[str, Any] = Body()) -> Response:
            sid, turn = request.cookies.get("sid"), int(request.cookies.get("turn", "-1"))
            if sid not in self.totals:
                return JSONResponse({"detail": "no session"}, status_code=404)
            self.totals[sid] += int(body["n"])
            answer = Response(f'{{"total": {self.totals[sid]}, "turn": {turn}}}', media_type="application/json")
            answer.set_cookie("turn", str(turn + 1))
            return answer

        @app.post("/broken")
        async def broken() -> Response:
            return Response("the tool is down", status_code=503)

        @app.post("/verify")
        async def verify(request: Request, body: dict[str, Any] = Body()) -> dict[str, Any]:
            self.verified.append(body)
            sid = request.cookies.get("sid")
            return {**body, "reward": float(self.totals.get(sid, -1)), "checked": True}

        if serve_close:

            @app.post("/close_session")
            async def close(request: Request, body: dict[str, Any] | None = Body(None)) -> dict[str, bool]:
                self.closed.append(request.cookies.get("sid", ""))
                return {"closed": True}


def scripted_model(script: list[dict[str, Any]], seen: list[list[dict[str, Any]]]) -> FastAPI:
    """Answers the n-th call of an episode (n = tool results in its input) with script[n]."""
    app = FastAPI()

    @app.post("/v1/responses")
    async def responses(body: dict[str, Any] = Body()) -> dict[str, Any]:
        seen.append(body["input"])
        step = sum(item.get("type") == "function_call_output" for item in body["input"])
        item = script[min(step, len(script) - 1)]
        output = [{**item, "prompt_token_ids": [1, 2], "generation_token_ids": [3], "generation_log_probs": [0.0]}]
        return {
            "id": f"resp_{step}",
            "object": "response",
            "created_at": 0,
            "model": "m",
            "status": "completed",
            "output": output,
            "tools": [],
            "tool_choice": "auto",
            "parallel_tool_calls": False,
            "usage": {
                "input_tokens": 2,
                "output_tokens": 1,
                "total_tokens": 3,
                "input_tokens_details": {"cached_tokens": 1},
            },
        }

    return app


def call(name: str, arguments: str, index: int) -> dict[str, Any]:
    return {"type": "function_call", "name": name, "arguments": arguments, "call_id": f"c{index}", "id": f"fc{index}"}


SCRIPT = [
    call("add", '{"n": 2}', 0),
    call("add", '{"n": 3', 1),  # not JSON
    call("verify", "{}", 2),  # a life-cycle route, never reached as a tool
    call("broken", "{}", 3),
    call("add", '{"n": 5}', 4),
    {"type": "message", "role": "assistant", "id": "m", "content": [{"type": "output_text", "text": "done"}]},
]


@pytest.fixture
def gym_parts() -> Iterator[tuple[str, Environment, list[list[dict[str, Any]]]]]:
    env, seen = Environment(), []
    with ExitStack() as stack:
        env_url = stack.enter_context(serve_in_thread(env.app))
        model_url = stack.enter_context(serve_in_thread(scripted_model(SCRIPT, seen)))
        config = SimpleAgentConfig(
            model_server="model", resources_server="env", environment_protocol="nemo_gym", max_steps=8
        )
        agent = SimpleAgent("agent", config, ServerClient({"model": model_url, "env": env_url}))
        yield stack.enter_context(serve_in_thread(agent.build_app())), env, seen


def test_episode_speaks_nemo_gym_protocol(gym_parts: tuple[str, Environment, list[list[dict[str, Any]]]]) -> None:
    agent_url, env, seen = gym_parts
    row = {"responses_create_params": {"input": "count", "tools": TOOLS}, "start": 10, "task": "t1"}
    answer = httpx.post(f"{agent_url}/run", json=row, timeout=30)
    assert answer.status_code == 200, answer.text
    record = answer.json()
    outputs = [item["output"] for item in record["response"]["output"] if item["type"] == "function_call_output"]
    # The body text as the server wrote it; the cookie it rotated came back each time; an error body is a result.
    assert outputs[0] == '{"total": 12, "turn": 0}'
    assert json.loads(outputs[1])["error"].startswith("Invalid tool call arguments: JSONDecodeError(")
    assert json.loads(outputs[2]) == {"error": "there is no tool named 'verify'"}
    assert outputs[3] == "the tool is down"
    assert outputs[4] == '{"total": 17, "turn": 1}'
    assert len(seen) == 6  # the episode ended on the call without a function call: no /step, no extra call
    # The record: this project's schema, the row as sent, the verifier's fields, NeMo Gym's echo dropped.
    assert record["schema_version"] == 2 and record["reward"] == 17.0 and record["checked"] is True
    assert record["responses_create_params"] == row["responses_create_params"] and record["task"] == "t1"
    assert record["response"]["model_calls"] == 6
    # /verify got NeMo Gym's shape: the row, and the last answer with the whole episode and the summed usage.
    verified = env.verified[0]
    assert verified["start"] == 10 and verified["response"]["id"] == "resp_5"
    assert len(verified["response"]["output"]) == 11
    assert verified["response"]["output"][0]["prompt_token_ids"] == [1, 2]
    assert verified["response"]["usage"] == {
        "input_tokens": 12,
        "output_tokens": 6,
        "total_tokens": 18,
        "input_tokens_details": {"cached_tokens": 6},
    }
    assert len(env.closed) == 1 and env.closed[0] in env.totals  # the seeded session, closed by its cookie


def test_cut_answer_ends_the_episode_and_close_is_skipped_where_not_served() -> None:
    env, seen = Environment(serve_close=False), []
    cut = {**call("add", '{"n": 1}', 0)}
    with ExitStack() as stack:
        env_url = stack.enter_context(serve_in_thread(env.app))
        model = scripted_model([cut], seen)

        @model.middleware("http")
        async def mark_incomplete(request: Request, call_next: Any) -> Any:
            answer = await call_next(request)
            body = json.loads(b"".join([chunk async for chunk in answer.body_iterator]))
            body.update(status="incomplete", incomplete_details={"reason": "max_output_tokens"})
            return JSONResponse(body)

        model_url = stack.enter_context(serve_in_thread(model))
        config = SimpleAgentConfig(model_server="model", resources_server="env", environment_protocol="nemo_gym")
        agent = SimpleAgent("agent", config, ServerClient({"model": model_url, "env": env_url}))
        agent_url = stack.enter_context(serve_in_thread(agent.build_app()))
        row = {"responses_create_params": {"input": "count", "tools": TOOLS}, "start": 1}
        answer = httpx.post(f"{agent_url}/run", json=row, timeout=30)
    assert answer.status_code == 200, answer.text
    assert len(seen) == 1  # NeMo Gym's agent runs no tool of a cut answer
    assert answer.json()["reward"] == 1.0


def test_close_session_read_from_openapi() -> None:
    def schema(required: bool | None) -> dict[str, Any]:
        post: dict[str, Any] = {} if required is None else {"requestBody": {"required": required}}
        return {"paths": {"/close_session": {"post": post}}}

    assert nemo_gym_protocol.closes_cookie_sessions(schema(False))
    assert nemo_gym_protocol.closes_cookie_sessions(schema(None))
    assert not nemo_gym_protocol.closes_cookie_sessions(schema(True))  # NeMo Gym's base class: typed body only
    assert not nemo_gym_protocol.closes_cookie_sessions({"paths": {}})
    assert nemo_gym_protocol.closes_cookie_sessions(None)


def test_cookie_jar_keeps_updates_and_drops_expired() -> None:
    jar = nemo_gym_protocol.CookieJar()
    jar.update(httpx.Response(200, headers=[("set-cookie", "a=1; Path=/"), ("set-cookie", "b=2; HttpOnly")]))
    jar.update(httpx.Response(200, headers=[("set-cookie", "a=3; Path=/"), ("set-cookie", "b=; Max-Age=0")]))
    assert jar.headers() == {"cookie": "a=3"}
