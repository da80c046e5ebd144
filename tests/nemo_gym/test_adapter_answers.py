"""The adapter's answers, as NeMo Gym 0.7.0's own models validate them (`NeMoGymResponse`, `NeMoGymChatCompletion`).

Real requests through this project's vLLM model adapter (served in-process) against the suite's shared hooked vLLM:
plain text, cut by max_tokens, tool calls (required, named, chat-form tools), a second turn that carries the first
turn's items back, each streamed and not, with token bundles on and off. Every answer is then checked inside
.venv-nemo-gym by `validate_answers.py` (JSON on stdin). Run by `make test-nemo-gym` only.
"""

from __future__ import annotations

import copy
import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from nemo_gym_tok.servers.inprocess import serve_in_thread
from nemo_gym_tok.vllm_server import VLLMServer
from responses_api_models.vllm_model.app import VLLMModel, VLLMModelConfig
from tests.nemo_gym import gym

pytestmark = pytest.mark.vllm

VALIDATOR = Path(__file__).with_name("validate_answers.py")
# An enum keeps the random tiny model's arguments short (it otherwise writes a free string until max_tokens).
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather in a city.",
    "strict": False,
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "enum": ["sf", "nyc", "paris"]}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
TIME = {
    "type": "function",
    "name": "get_time",
    "description": "Time in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "enum": ["sf", "nyc"]}},
        "required": ["city"],
    },
}
CHAT_FORM_TIME = {"type": "function", "function": {k: v for k, v in TIME.items() if k != "type"}}
QUESTION = [{"role": "user", "content": "What is the weather in sf?"}]

RESPONSES_REQUESTS: dict[str, dict[str, Any]] = {
    "plain": {"input": "Say hello.", "max_output_tokens": 24, "temperature": 0.0},
    "cut": {"input": "Tell me a long story.", "max_output_tokens": 4, "instructions": "You are terse."},
    "tool_required": {
        "input": QUESTION,
        "tools": [WEATHER, TIME],
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "max_output_tokens": 40,
    },
    "tool_named": {
        "input": QUESTION,
        "tools": [WEATHER, CHAT_FORM_TIME],
        "tool_choice": {"type": "function", "name": "get_time"},
        "max_output_tokens": 40,
    },
    "tool_auto": {"input": QUESTION, "tools": [WEATHER], "max_output_tokens": 24},
}


@pytest.fixture(scope="module", params=["bundles", "no_bundles"])
def adapter(request: pytest.FixtureRequest, vllm_server: VLLMServer) -> Iterator[tuple[str, bool]]:
    """The adapter in front of the shared hooked vLLM: its URL, and whether it returns token bundles."""
    bundles = request.param == "bundles"
    config = VLLMModelConfig(
        base_url=f"{vllm_server.base_url}/v1", model=vllm_server.served_model_name, return_token_id_information=bundles
    )
    with serve_in_thread(VLLMModel("policy_model", config).build_app()) as url:
        yield url, bundles


def post_responses(url: str, body: dict[str, Any]) -> dict[str, Any]:
    answer = httpx.post(f"{url}/v1/responses", json=body, timeout=120)
    assert answer.status_code == 200, answer.text
    return answer.json()


def stream_responses(url: str, body: dict[str, Any]) -> dict[str, Any]:
    """The Response of the stream's last event (`response.completed` or `response.incomplete`)."""
    events = []
    with httpx.stream("POST", f"{url}/v1/responses", json={**body, "stream": True}, timeout=120) as answer:
        assert answer.status_code == 200, answer.read()
        for line in answer.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line.removeprefix("data: ")))
    last = events[-1]
    assert last["type"] in ("response.completed", "response.incomplete"), last
    return last["response"]


def second_turn(body: dict[str, Any], first: dict[str, Any]) -> dict[str, Any]:
    """The next call of the episode: the first call's items back (bundles kept), plus a tool result for each call."""
    follow = copy.deepcopy(body)
    items = list(body["input"]) if isinstance(body["input"], list) else [{"role": "user", "content": body["input"]}]
    outputs = [
        {"type": "function_call_output", "call_id": item["call_id"], "output": "sunny"}
        for item in first["output"]
        if item["type"] == "function_call"
    ]
    follow["input"] = [*items, *first["output"], *outputs, *([] if outputs else [{"role": "user", "content": "More."}])]
    return follow


def expected_echo(body: dict[str, Any]) -> dict[str, Any]:
    tools = [{"type": "function", **t["function"]} if "function" in t else t for t in body.get("tools", [])]
    return {
        "tools": tools,
        "tool_choice": body.get("tool_choice", "auto"),
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
    }


def check_own_shape(response: dict[str, Any], body: dict[str, Any], bundles: bool) -> None:
    """What this project promises beside NeMo Gym's models: the echo as sent, usage details, the bundle kept."""
    assert {key: response[key] for key in ("tools", "tool_choice", "parallel_tool_calls")} == expected_echo(body)
    usage = response["usage"]
    assert usage["input_tokens"] > 0 and usage["output_tokens"] > 0
    assert usage["input_tokens_details"] == {"cached_tokens": 0}  # vLLM runs without --enable-prompt-tokens-details
    assert usage["output_tokens_details"] == {"reasoning_tokens": 0}  # no reasoning parser on the tiny model
    last = response["output"][-1]
    assert ("generation_token_ids" in last) == bundles
    if bundles:
        assert len(last["generation_token_ids"]) == usage["output_tokens"]


def validate_with_nemo_gym(entries: list[dict[str, Any]]) -> dict[str, Any]:
    out = subprocess.run(
        [str(gym.NEMO_GYM_PYTHON), str(VALIDATOR)],
        input=json.dumps(entries),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout)


def test_nemo_gym_validates_every_answer(adapter: tuple[str, bool]) -> None:
    adapter_url, bundles = adapter
    entries: list[dict[str, Any]] = []
    tool_calls = spliced = 0
    for name, body in RESPONSES_REQUESTS.items():
        for send in (post_responses, stream_responses):
            first = send(adapter_url, body)
            follow = second_turn(body, first)
            second = send(adapter_url, follow)
            for answer, sent in ((first, body), (second, follow)):
                check_own_shape(answer, sent, bundles)
                tool_calls += sum(item["type"] == "function_call" for item in answer["output"])
                spliced += bool((answer["output"][-1].get("prefix_splice") or {}).get("applied"))
                entries.append({"kind": "response", "body": answer})
    statuses = {entry["body"]["status"] for entry in entries}

    chat_bodies = [
        {"messages": QUESTION, "max_tokens": 24},
        {"messages": QUESTION, "tools": [CHAT_FORM_TIME], "tool_choice": "required", "max_tokens": 40},
        {"messages": QUESTION, "max_tokens": 3},
    ]
    for body in chat_bodies:
        answer = httpx.post(f"{adapter_url}/v1/chat/completions", json=body, timeout=120)
        assert answer.status_code == 200, answer.text
        message = answer.json()["choices"][0]["message"]
        entries.append({"kind": "chat", "body": answer.json()})
        follow = {
            **body,
            "messages": [
                *body["messages"],
                message,
                *[
                    {"role": "tool", "tool_call_id": call["id"], "content": "sunny"}
                    for call in message.get("tool_calls") or []
                ],
            ],
        }
        if not message.get("tool_calls"):
            follow["messages"].append({"role": "user", "content": "More."})
        again = httpx.post(f"{adapter_url}/v1/chat/completions", json=follow, timeout=120)
        assert again.status_code == 200, again.text
        entries.append({"kind": "chat", "body": again.json()})

    report = validate_with_nemo_gym(entries)
    responses = sum(entry["kind"] == "response" for entry in entries)
    print(
        f"\n[nemo-gym adapter answers {'bundles' if bundles else 'no bundles'}] NeMo Gym 0.7.0 validated "
        f"{report['validated']}/{report['total']} ({responses} Responses answers, half streamed; "
        f"{report['total'] - responses} chat completions); function calls {tool_calls}, statuses {sorted(statuses)}, "
        f"spliced by the hook {spliced}"
    )
    assert report["failures"] == [], report["failures"]
    assert report["validated"] == report["total"] == len(entries) > 0
    assert tool_calls > 0 and statuses == {"completed", "incomplete"}
    if bundles:
        assert spliced > 0  # second turns carried the first turn's bundle: the hook spliced them
