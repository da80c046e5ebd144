"""The /tokenize fallback's request renders what generation renders, or refuses; GPT-OSS never uses it."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from nemo_gym_tok.servers.api_errors import ApiError
from responses_api_models.vllm_model.app import VLLMModelConfig
from responses_api_models.vllm_model.token_capture import tokenize_request

TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0.5}


def test_only_prompt_affecting_fields_are_sent() -> None:
    assert tokenize_request({**BODY, "tools": TOOLS, "start_token_segment": True}) == {
        "model": "m",
        "messages": BODY["messages"],
        "tools": TOOLS,
        "start_token_segment": True,
    }


@pytest.mark.parametrize(
    "effort, kwargs, expected",
    [
        ("none", None, {"enable_thinking": False, "reasoning_effort": "none"}),
        ("high", {"x": 1}, {"x": 1, "enable_thinking": True, "reasoning_effort": "high"}),
        ("low", {"enable_thinking": False}, {"enable_thinking": False, "reasoning_effort": "low"}),  # caller's wins
    ],
)
def test_reasoning_effort_becomes_template_kwargs_as_vllm_does(effort, kwargs, expected) -> None:
    body = {**BODY, "reasoning_effort": effort, **({"chat_template_kwargs": kwargs} if kwargs else {})}
    assert tokenize_request(body)["chat_template_kwargs"] == expected


def test_tools_left_out_under_tool_choice_none_only_where_the_server_does() -> None:
    body = {**BODY, "tools": TOOLS, "tool_choice": "none"}
    assert "tools" in tokenize_request(body)
    assert "tools" not in tokenize_request(body, exclude_tools_when_tool_choice_none=True)
    assert "tools" in tokenize_request({**body, "tool_choice": "auto"}, exclude_tools_when_tool_choice_none=True)


def test_truncation_cannot_be_rendered_by_tokenize() -> None:
    with pytest.raises(ApiError, match="truncate_prompt_tokens cannot be combined with token capture"):
        tokenize_request({**BODY, "truncate_prompt_tokens": 8})


def test_gpt_oss_config_refuses_the_tokenize_fallback() -> None:
    VLLMModelConfig(base_url="http://x", model="m", harmony=True)
    with pytest.raises(ValidationError, match="renders the Hugging Face template, not Harmony"):
        VLLMModelConfig(base_url="http://x", model="m", harmony=True, use_return_token_ids=False)
