"""Tests of our Qwen3-style chat template: exact rendered strings for each message shape, via transformers."""

from __future__ import annotations

from typing import Any

import pytest

from nemo_gym_tok.testing.tiny_model import IM_END_ID, build_tokenizer

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}

TOOLS_SECTION = (
    "# Tools\n\nThese functions are available. Each is described by one JSON object per line between "
    "<tools> and </tools>:\n<tools>\n"
    '{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city.", '
    '"parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}\n'
    "</tools>\n\nTo call functions, reply with one <tool_call></tool_call> block per call, each holding a JSON "
    "object with the function's name and its arguments:\n<tool_call>\n"
    '{"name": "<function name>", "arguments": <arguments object>}\n</tool_call>'
)


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def render(tokenizer, messages: list[dict[str, Any]], **kwargs: Any) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)


def test_system_user_generation_prompt(tokenizer) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    assert render(tokenizer, messages, add_generation_prompt=True) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n"
    )
    assert render(tokenizer, messages) == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n"


def test_no_system_turn_without_system_message_or_tools(tokenizer) -> None:
    assert render(tokenizer, [{"role": "user", "content": "Hi"}]) == "<|im_start|>user\nHi<|im_end|>\n"


def test_enable_thinking_false_adds_empty_think_block(tokenizer) -> None:
    messages = [{"role": "user", "content": "Hi"}]
    expected_prefix = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    off = render(tokenizer, messages, add_generation_prompt=True, enable_thinking=False)
    assert off == expected_prefix + "<think>\n\n</think>\n\n"
    on = render(tokenizer, messages, add_generation_prompt=True, enable_thinking=True)
    assert on == expected_prefix
    assert render(tokenizer, messages, add_generation_prompt=True) == expected_prefix


def test_reasoning_kept_only_after_last_user(tokenizer) -> None:
    messages = [
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "a1", "reasoning_content": "r1"},
        {"role": "user", "content": "q2"},
        {"role": "assistant", "content": "a2", "reasoning_content": "r2"},
    ]
    assert render(tokenizer, messages) == (
        "<|im_start|>user\nq1<|im_end|>\n"
        "<|im_start|>assistant\na1<|im_end|>\n"
        "<|im_start|>user\nq2<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nr2\n</think>\n\na2<|im_end|>\n"
    )


def test_reasoning_field_alias_and_newline_trimming(tokenizer) -> None:
    # Reasoning parsers return the newlines around the tags; they must not pile up on re-render.
    messages = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "\n\nanswer", "reasoning": "\nthought\n"},
    ]
    assert render(tokenizer, messages) == (
        "<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n<think>\nthought\n</think>\n\nanswer<|im_end|>\n"
    )


def test_assistant_without_reasoning_has_no_think_block(tokenizer) -> None:
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    assert render(tokenizer, messages) == "<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\na<|im_end|>\n"


def test_tool_calls_with_string_and_dict_arguments(tokenizer) -> None:
    messages = [
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": "Checking.",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city":"Zürich"}'},
                },
                {
                    "id": "call_2",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Köln"}},
                },
            ],
        },
    ]
    assert render(tokenizer, messages) == (
        "<|im_start|>user\nWeather?<|im_end|>\n"
        "<|im_start|>assistant\nChecking.\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city":"Zürich"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Köln"}}\n</tool_call><|im_end|>\n'
    )


def test_tool_call_without_content_after_reasoning(tokenizer) -> None:
    messages = [
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": None,
            "reasoning_content": "Need the tool.",
            "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}],
        },
    ]
    assert render(tokenizer, messages) == (
        "<|im_start|>user\nWeather?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nNeed the tool.\n</think>\n\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call><|im_end|>\n'
    )


def test_consecutive_tool_responses_share_one_user_turn(tokenizer) -> None:
    messages = [
        {"role": "user", "content": "Weather in two cities?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "A"}}},
                {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "B"}}},
            ],
        },
        {"role": "tool", "tool_call_id": "1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "2", "content": "rain"},
        {"role": "assistant", "content": "A sunny, B rain."},
        {"role": "tool", "content": "late"},
    ]
    assert render(tokenizer, messages, add_generation_prompt=True) == (
        "<|im_start|>user\nWeather in two cities?<|im_end|>\n"
        "<|im_start|>assistant\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "A"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "B"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n"
        "<tool_response>\nrain\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\nA sunny, B rain.<|im_end|>\n"
        "<|im_start|>user\n<tool_response>\nlate\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_reasoning_kept_through_tool_loop_after_last_user(tokenizer) -> None:
    # Tool results are not user messages: the whole tool loop of the current turn keeps its reasoning.
    messages = [
        {"role": "user", "content": "q"},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "r1",
            "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}],
        },
        {"role": "tool", "content": "ok"},
        {"role": "assistant", "content": "done", "reasoning_content": "r2"},
    ]
    assert render(tokenizer, messages) == (
        "<|im_start|>user\nq<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nr1\n</think>\n\n"
        '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\nok\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n<think>\nr2\n</think>\n\ndone<|im_end|>\n"
    )


def test_tools_go_into_existing_system_turn(tokenizer) -> None:
    messages = [{"role": "system", "content": "You help."}, {"role": "user", "content": "Hi"}]
    assert render(tokenizer, messages, tools=[WEATHER_TOOL], add_generation_prompt=True) == (
        "<|im_start|>system\nYou help.\n\n" + TOOLS_SECTION + "<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_tools_create_system_turn_when_missing(tokenizer) -> None:
    messages = [{"role": "user", "content": "Hi"}]
    assert render(tokenizer, messages, tools=[WEATHER_TOOL]) == (
        "<|im_start|>system\n" + TOOLS_SECTION + "<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
    )


def test_empty_tools_list_renders_no_system_turn(tokenizer) -> None:
    assert render(tokenizer, [{"role": "user", "content": "Hi"}], tools=[]) == "<|im_start|>user\nHi<|im_end|>\n"


def test_list_content_parts_are_joined(tokenizer) -> None:
    messages = [
        {"role": "system", "content": [{"type": "text", "text": "Sys "}, {"type": "text", "text": "prompt"}]},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Look: "},
                {"type": "image_url", "image_url": {"url": "http://x"}},
                {"type": "text", "text": "what?"},
            ],
        },
        {"role": "assistant", "content": [{"type": "text", "text": "Nothing."}]},
        {"role": "tool", "content": [{"type": "text", "text": "r"}]},
    ]
    assert render(tokenizer, messages) == (
        "<|im_start|>system\nSys prompt<|im_end|>\n"
        "<|im_start|>user\nLook: what?<|im_end|>\n"
        "<|im_start|>assistant\nNothing.<|im_end|>\n"
        "<|im_start|>user\n<tool_response>\nr\n</tool_response><|im_end|>\n"
    )


def test_none_content(tokenizer) -> None:
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": None}]
    assert render(tokenizer, messages) == "<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n<|im_end|>\n"


def test_template_tokens_are_single_ids(tokenizer) -> None:
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    # <|im_start|> user \n Hi <|im_end|> \n <|im_start|> assistant \n, with Qwen's ids.
    assert list(ids) == [151644, 872, 198, 13048, IM_END_ID, 198, 151644, 77091, 198]
