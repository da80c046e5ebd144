"""The vLLM adapter refuses bad bodies and bad Responses/chat fields with a 4xx naming them; nothing reaches vLLM."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from nemo_gym_tok.servers.inprocess import serve_in_thread
from responses_api_models.vllm_model.app import VLLMModel, VLLMModelConfig
from tests.bad_inputs.cases import BAD_BODIES, BODY_IDS, SMALL_LIMIT, assert_refused
from tests.bad_inputs.fakes import ScriptedChat

USER = {"role": "user", "content": "hi"}


@pytest.fixture(scope="module")
def vllm() -> Iterator[ScriptedChat]:
    fake = ScriptedChat()
    with serve_in_thread(fake.app()) as url:
        fake.url = url  # type: ignore[attr-defined]
        yield fake


@pytest.fixture(scope="module")
def adapter(vllm: ScriptedChat) -> Iterator[str]:
    config = VLLMModelConfig(
        base_url=vllm.url,
        model="m",
        max_body_bytes=SMALL_LIMIT,  # type: ignore[attr-defined]
        return_token_id_information=True,
        splice="hook",
        retry_backoff_seconds=0.01,
    )
    with serve_in_thread(VLLMModel("policy_model", config).build_app()) as url:
        yield url


@pytest.fixture(autouse=True)
def nothing_reaches_vllm(vllm: ScriptedChat) -> Iterator[None]:
    vllm.requests.clear()
    yield
    assert vllm.requests == []


@pytest.mark.parametrize("case", BAD_BODIES, ids=BODY_IDS)
@pytest.mark.parametrize("route", ["/v1/responses", "/v1/chat/completions"])
def test_both_routes_refuse_the_bad_body(adapter: str, route: str, case) -> None:
    answer = httpx.post(adapter + route, content=case.raw, headers={"content-type": "application/json"})
    assert_refused(answer, case.status, case.names)


RESPONSES_CASES = [
    # (kind, body, param the error must name)
    ("content_part_text_int", {"input": [{"role": "user", "content": [{"text": 5}]}]}, "input[0].content[0].text"),
    (
        "content_part_text_list",
        {"input": [USER, {"role": "user", "content": [{"type": "input_text", "text": [1]}]}]},
        "input[1].content[0].text",
    ),
    (
        "summary_text_object",
        {"input": [{"type": "reasoning", "summary": [{"type": "summary_text", "text": {}}]}]},
        "input[0].summary[0].text",
    ),
    (
        "tool_output_part_text_null",
        {"input": [{"type": "function_call_output", "call_id": "c", "output": [{"text": None}]}]},
        "input[0].output[0].text",
    ),
    ("input_number", {"input": 5}, "input"),
    ("input_item_string", {"input": ["hi"]}, "input[0]"),
    ("message_without_role", {"input": [{"type": "message", "content": "hi"}]}, "input[0]"),
    (
        "function_call_without_call_id",
        {"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]},
        "input[0]",
    ),
    ("item_without_chat_equivalent", {"input": [{"type": "web_search_call"}]}, "input"),
    ("tools_string", {"input": "hi", "tools": "abc"}, "tools"),
    ("tools_of_numbers", {"input": "hi", "tools": [1]}, "tools[0]"),
    ("max_output_tokens_string", {"input": "hi", "max_output_tokens": "x"}, "max_output_tokens"),
    ("temperature_string", {"input": "hi", "temperature": "hot"}, "temperature"),
    ("stream_string", {"input": "hi", "stream": "sometimes"}, "stream"),
    ("prefix_string", {"input": "hi", "required_prefix_token_ids": "1,2"}, "required_prefix_token_ids"),
    ("prefix_negative", {"input": "hi", "required_prefix_token_ids": [-1]}, "required_prefix_token_ids[0]"),
    ("prefix_bool", {"input": "hi", "required_prefix_token_ids": [True]}, "required_prefix_token_ids[0]"),
    # Past 64 bits a fast JSON reader turns an id into a float on its way back: refused before vLLM sees it.
    (
        "prefix_past_64_bits",
        {"input": "", "required_prefix_token_ids": [510925679027671924736]},
        "required_prefix_token_ids[0]",
    ),
    ("prefix_past_32_bits", {"input": "hi", "required_prefix_token_ids": [2**31]}, "required_prefix_token_ids[0]"),
]


@pytest.mark.parametrize(
    "body, param", [case[1:] for case in RESPONSES_CASES], ids=[case[0] for case in RESPONSES_CASES]
)
def test_bad_responses_fields_are_400_naming_them(adapter: str, body: dict, param: str) -> None:
    assert_refused(httpx.post(f"{adapter}/v1/responses", json=body), 400, param, param=param)


BUNDLE = {"prompt_token_ids": [1], "generation_token_ids": [2], "generation_log_probs": [-0.1]}
CHAT_CASES = [
    ("messages_object", {"messages": USER}, "messages"),
    (
        "bundle_partial",
        {"messages": [USER, {"role": "assistant", "content": "x", "prompt_token_ids": [1]}]},
        "messages[1]",
    ),
    (
        "bundle_ids_strings",
        {"messages": [USER, {"role": "assistant", "content": "x", **BUNDLE, "prompt_token_ids": ["1"]}]},
        "messages[1].prompt_token_ids[0]",
    ),
    ("n_two_with_ids", {"messages": [USER], "n": 2}, "n"),
]


@pytest.mark.parametrize("body, param", [case[1:] for case in CHAT_CASES], ids=[case[0] for case in CHAT_CASES])
def test_bad_chat_fields_are_400_naming_them(adapter: str, body: dict, param: str) -> None:
    assert_refused(httpx.post(f"{adapter}/v1/chat/completions", json=body), 400, param, param=param)


def test_unknown_route_is_404_in_the_error_shape(adapter: str) -> None:
    assert_refused(httpx.post(f"{adapter}/v1/completions", json={}), 404, "Not Found")
    assert_refused(httpx.get(f"{adapter}/v1/responses"), 405, "Method Not Allowed")
