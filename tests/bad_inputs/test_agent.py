"""The simple agent: bad bodies and bad rows are 4xx naming the row field, refusals by the environment or the model
included; tool calls reach only the environment's declared tools; a model's non-JSON failure is a JSON 502."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import httpx
import pytest

from nemo_gym_tok.servers.base import ResourcesServer
from nemo_gym_tok.servers.client import ServerClient
from nemo_gym_tok.servers.inprocess import serve_in_thread
from resources_servers.capital_lookup.app import SERVER as CapitalLookup
from resources_servers.number_guess.app import SERVER as NumberGuess
from responses_api_agents.simple_agent.app import SimpleAgent, SimpleAgentConfig
from responses_api_models.vllm_model.app import VLLMModel, VLLMModelConfig
from tests.bad_inputs.cases import BAD_BODIES, BODY_IDS, SMALL_LIMIT, assert_refused
from tests.bad_inputs.fakes import ScriptedChat, plain_text_500_model

PROMPT = [{"role": "user", "content": "Guess a number from 1 to 100."}]
ROW = {"responses_create_params": {"input": PROMPT, "max_output_tokens": 8}, "secret": 50}


class CountingNumberGuess(NumberGuess):
    """number_guess that counts its /seed_session calls: a tool call must never be one."""

    seeds = 0

    async def seed_session(self, session_id: str, row: dict[str, Any]) -> dict[str, Any]:
        type(self).seeds += 1
        return await super().seed_session(session_id, row)


@contextmanager
def gym(env: ResourcesServer, chat: ScriptedChat, model_app: Any = None) -> Iterator[str]:
    """Fake vLLM -> real adapter (or `model_app`), `env`, and the agent in front of them; yields the agent's URL."""
    with ExitStack() as stack:
        if model_app is None:
            vllm = stack.enter_context(serve_in_thread(chat.app()))
            adapter = VLLMModel("policy_model", VLLMModelConfig(base_url=vllm, model="m", splice="hook"))
            model_app = adapter.build_app()
        servers = {
            "policy_model": stack.enter_context(serve_in_thread(model_app)),
            "env": stack.enter_context(serve_in_thread(env.build_app())),
        }
        config = SimpleAgentConfig(
            model_server="policy_model", resources_server="env", max_steps=3, max_body_bytes=SMALL_LIMIT
        )
        yield stack.enter_context(serve_in_thread(SimpleAgent("agent", config, ServerClient(servers)).build_app()))


@pytest.fixture(scope="module")
def chat() -> ScriptedChat:
    return ScriptedChat()


@pytest.fixture(scope="module")
def agent(chat: ScriptedChat) -> Iterator[str]:
    with gym(CountingNumberGuess("env", NumberGuess.config_class()), chat) as url:
        yield url


@pytest.fixture(autouse=True)
def fresh_script(chat: ScriptedChat) -> None:
    chat.tool_name, chat.requests[:] = None, []
    CountingNumberGuess.seeds = 0


@pytest.mark.parametrize("case", BAD_BODIES, ids=BODY_IDS)
@pytest.mark.parametrize("route", ["/run", "/v1/responses"])
def test_both_routes_refuse_the_bad_body(agent: str, route: str, case) -> None:
    answer = httpx.post(agent + route, content=case.raw, headers={"content-type": "application/json"})
    assert_refused(answer, case.status, case.names)


def params_with(**fields: Any) -> dict[str, Any]:
    return {**ROW, "responses_create_params": {**ROW["responses_create_params"], **fields}}


TOOLS = "responses_create_params.tools"
ROW_CASES = [
    # (kind, row, param the 400 names): the agent's own checks, before anything is sent on
    ("tools_string", params_with(tools="abc"), TOOLS),
    ("tools_number", params_with(tools=7), TOOLS),
    ("tools_of_numbers", params_with(tools=[1]), f"{TOOLS}[0]"),
    ("tool_name_list", params_with(tools=[{"type": "function", "name": ["x"]}]), f"{TOOLS}[0].name"),
    ("tool_without_name", params_with(tools=[{"type": "function", "parameters": {}}]), f"{TOOLS}[0].name"),
    ("chat_tool_function_number", params_with(tools=[{"type": "function", "function": 5}]), f"{TOOLS}[0].function"),
    (
        "chat_tool_name_number",
        params_with(tools=[{"type": "function", "function": {"name": 5}}]),
        f"{TOOLS}[0].function.name",
    ),
    ("no_params", {"secret": 50}, "responses_create_params"),
    ("input_number", params_with(input=5), "responses_create_params.input"),
    ("input_of_numbers", params_with(input=[1]), "responses_create_params.input"),
    # refused by the environment: its field is the row's
    ("env_refuses_secret", {**ROW, "secret": "fifty"}, "secret"),
    ("env_refuses_missing_secret", {"responses_create_params": ROW["responses_create_params"]}, "secret"),
    # refused by the model on the first call: named as the row field it came from
    (
        "model_refuses_content_part",
        params_with(input=[{"role": "user", "content": [{"text": 5}]}]),
        "responses_create_params.input[0].content[0].text",
    ),
    (
        "model_refuses_max_output_tokens",
        params_with(max_output_tokens="x"),
        "responses_create_params.max_output_tokens",
    ),
    ("model_refuses_temperature", params_with(temperature="hot"), "responses_create_params.temperature"),
    ("model_refuses_prefix", {**ROW, "required_prefix_token_ids": "1,2"}, "required_prefix_token_ids"),
    ("model_refuses_prefix_id", {**ROW, "required_prefix_token_ids": [1, -2]}, "required_prefix_token_ids[1]"),
    (
        "model_refuses_message_without_role",
        params_with(input=[{"type": "message", "content": "x"}]),
        "responses_create_params.input[0]",
    ),
]


@pytest.mark.parametrize("row, param", [case[1:] for case in ROW_CASES], ids=[case[0] for case in ROW_CASES])
def test_a_bad_row_is_400_naming_the_row_field(agent: str, chat: ScriptedChat, row: dict, param: str | None) -> None:
    answer = httpx.post(f"{agent}/run", json=row)
    assert_refused(answer, 400, param or "responses_create_params", param=param)
    assert chat.requests == []  # refused before (or by) the adapter: vLLM never saw it


def test_a_good_row_still_plays(agent: str) -> None:
    answer = httpx.post(f"{agent}/run", json=ROW, timeout=30)
    assert answer.status_code == 200, answer.text
    assert answer.json()["reward"] == 1.0  # the fake answers "50", the secret


@pytest.mark.parametrize("name", ["seed_session", "verify", "step", "tools", "health"])
def test_a_tool_named_like_an_endpoint_never_reaches_it(agent: str, chat: ScriptedChat, name: str) -> None:
    chat.tool_name = name
    row = params_with(tools=[{"type": "function", "name": name, "parameters": {"type": "object", "properties": {}}}])
    answer = httpx.post(f"{agent}/run", json=row, timeout=30)
    assert answer.status_code == 200, answer.text
    outputs = [item for item in answer.json()["response"]["output"] if item["type"] == "function_call_output"]
    assert outputs and outputs[0]["output"] == f"error: there is no tool named {name!r}"
    assert CountingNumberGuess.seeds == 1  # only the agent's own seed


def test_a_declared_tool_is_still_called() -> None:
    chat = ScriptedChat(tool_name="lookup_capital", answer="Paris")
    row = {
        "responses_create_params": {"input": PROMPT, "tools": [{"type": "function", "name": "lookup_capital"}]},
        "expected_answer": "Paris",
    }
    with gym(CapitalLookup("env", CapitalLookup.config_class()), chat) as agent:
        answer = httpx.post(f"{agent}/run", json=row, timeout=30)
    assert answer.status_code == 200, answer.text
    outputs = [item for item in answer.json()["response"]["output"] if item["type"] == "function_call_output"]
    assert outputs[0]["output"].startswith("error: no country")  # the environment's own answer: it was reached


def test_responses_hop_passes_the_models_400_as_json(agent: str) -> None:
    answer = httpx.post(f"{agent}/v1/responses", json={"input": [{"role": "user", "content": [{"text": 5}]}]})
    assert_refused(answer, 400, "input[0].content[0].text", param="input[0].content[0].text")


def test_a_models_plain_text_500_is_a_json_502() -> None:
    with gym(NumberGuess("env", NumberGuess.config_class()), ScriptedChat(), model_app=plain_text_500_model()) as agent:
        hop = httpx.post(f"{agent}/v1/responses", json={"input": "hi"})
        run = httpx.post(f"{agent}/run", json=ROW)
    assert_refused(hop, 502, "not JSON")
    assert_refused(run, 502, "policy_model answered HTTP 500")
