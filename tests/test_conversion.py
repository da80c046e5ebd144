"""Responses <-> Chat conversion: every bundle stays on the model call it belongs to, both ways."""

from __future__ import annotations

import json

import pytest

from nemo_gym_tok.contract.conversion import chat_message_to_items, items_to_chat_messages, responses_to_chat_request
from nemo_gym_tok.types import ResponseItem, ResponsesRequest


def bundle(start: int, n: int) -> dict:
    return {
        "prompt_token_ids": list(range(start)),
        "generation_token_ids": list(range(start, start + n)),
        "generation_log_probs": [-0.1 * i for i in range(n)],
        "prefix_splice": {"applied": start > 10, "template_differed": start > 20, "replaced_tokens": start // 10},
    }


# A chat episode: reasoning + two parallel tool calls, tool results, a second call with reasoning and text, then
# a user turn and a final plain answer. Each assistant message holds the bundle of the call that produced it.
EPISODE = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "weather in Paris and Rome?"},
    {
        "role": "assistant",
        "content": "",
        "reasoning_content": "need two lookups",
        "tool_calls": [
            {
                "id": "call_a",
                "type": "function",
                "function": {"name": "weather", "arguments": json.dumps({"city": "Paris"})},
            },
            {
                "id": "call_b",
                "type": "function",
                "function": {"name": "weather", "arguments": json.dumps({"city": "Rome"})},
            },
        ],
        **bundle(12, 30),
    },
    {"role": "tool", "tool_call_id": "call_a", "content": "sunny"},
    {"role": "tool", "tool_call_id": "call_b", "content": "rain"},
    {"role": "assistant", "content": "Paris sunny, Rome rain.", "reasoning_content": "combine", **bundle(60, 8)},
    {"role": "user", "content": "thanks"},
    {"role": "assistant", "content": "welcome", **bundle(80, 3)},
]


def episode_as_items() -> list[ResponseItem]:
    items: list[ResponseItem] = []
    for message in EPISODE:
        if message["role"] == "assistant":
            items.extend(chat_message_to_items(message))
        elif message["role"] == "tool":
            items.append(
                ResponseItem(type="function_call_output", call_id=message["tool_call_id"], output=message["content"])
            )
        else:
            items.append(ResponseItem(type="message", role=message["role"], content=message["content"]))
    return items


def test_episode_round_trip_keeps_every_bundle_in_place() -> None:
    items = episode_as_items()
    assert [i.type for i in items] == [
        "message",
        "message",
        "reasoning",
        "function_call",
        "function_call",
        "function_call_output",
        "function_call_output",
        "reasoning",
        "message",
        "message",
        "message",
    ]
    # The bundle sits on the last item of each model call, and only there.
    bundled = [index for index, item in enumerate(items) if item.has_bundle]
    assert bundled == [4, 8, 10]
    assert items[4].prompt_token_ids == list(range(12))
    assert items[4].prefix_splice is not None and items[4].prefix_splice.replaced_tokens == 1
    assert items_to_chat_messages(items) == EPISODE


def test_round_trip_through_json_as_a_client_would_send_it() -> None:
    wire = [item.model_dump(exclude_none=True) for item in episode_as_items()]
    request = ResponsesRequest.model_validate({"model": "m", "input": json.loads(json.dumps(wire))})
    assert items_to_chat_messages(request.input_items()) == EPISODE


def test_unbundled_assistant_items_group_until_a_non_model_item() -> None:
    items = [
        ResponseItem(role="user", content="q"),
        ResponseItem(type="reasoning", summary=[{"type": "summary_text", "text": "hm"}]),
        ResponseItem(role="assistant", content=[{"type": "output_text", "text": "a"}]),
        ResponseItem(role="user", content="q2"),
    ]
    assert items_to_chat_messages(items, "sys") == [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "a", "reasoning_content": "hm"},
        {"role": "user", "content": "q2"},
    ]


def test_bundle_closes_its_call_so_back_to_back_calls_stay_apart() -> None:
    first = chat_message_to_items({"role": "assistant", "content": "one", **bundle(5, 2)})
    second = chat_message_to_items({"role": "assistant", "content": "two", **bundle(7, 2)})
    messages = items_to_chat_messages([*first, *second])
    assert [m["content"] for m in messages] == ["one", "two"]
    assert messages[1]["prompt_token_ids"] == list(range(7))


def test_back_to_back_calls_stay_apart_when_only_the_latest_carries_its_bundle() -> None:
    """What the agent sends since lean payloads: earlier calls' items without bundles, the latest call's with it."""

    def unbundled(message: dict) -> list[ResponseItem]:
        return [
            ResponseItem.model_validate(
                item.model_dump(
                    exclude={"prompt_token_ids", "generation_token_ids", "generation_log_probs", "prefix_splice"}
                )
            )
            for item in chat_message_to_items(message)
        ]

    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    items = [
        *unbundled({"role": "assistant", "content": "one", "reasoning_content": "r1"}),
        *unbundled({"role": "assistant", "content": "two", "tool_calls": [call, {**call, "id": "c2"}]}),
        *unbundled({"role": "assistant", "content": "three"}),
        *unbundled({"role": "assistant", "content": "four", "reasoning_content": "r4"}),
        *chat_message_to_items({"role": "assistant", "content": "five", **bundle(9, 2)}),
    ]
    messages = items_to_chat_messages(items)
    assert [m["content"] for m in messages] == ["one", "two", "three", "four", "five"]
    assert [m.get("reasoning_content") for m in messages] == ["r1", None, None, "r4", None]
    assert [len(m.get("tool_calls", [])) for m in messages] == [0, 2, 0, 0, 0]  # parallel calls stay together
    assert [m.get("prompt_token_ids") for m in messages] == [None] * 4 + [list(range(9))]


def test_a_tool_only_call_right_after_a_text_only_call_reads_as_one_call_without_bundles() -> None:
    """The one order items alone cannot split (docs/token-contract.md): a call's text may precede its tool calls."""
    text = chat_message_to_items({"role": "assistant", "content": "one"})
    tools = chat_message_to_items(
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
        }
    )
    assert [m["content"] for m in items_to_chat_messages([*text, *tools])] == ["one"]


def test_responses_request_to_chat_request_translates_and_passes_extras_through() -> None:
    request = ResponsesRequest.model_validate(
        {
            "model": "m",
            "input": "hello",
            "instructions": "sys",
            "max_output_tokens": 9,
            "temperature": 0.5,
            "tools": [
                {"type": "function", "name": "f", "description": "d", "parameters": {"type": "object"}, "strict": True}
            ],
            "tool_choice": {"type": "function", "name": "f"},
            "required_prefix_token_ids": [1, 2],
            "chat_template_kwargs": {"enable_thinking": False},
            "seed": 3,
        }
    )
    assert responses_to_chat_request(request) == {
        "model": "m",
        "temperature": 0.5,
        "required_prefix_token_ids": [1, 2],
        "chat_template_kwargs": {"enable_thinking": False},
        "seed": 3,
        "messages": [{"role": "system", "content": "sys"}, {"role": "user", "content": "hello"}],
        "max_tokens": 9,
        "tools": [
            {"type": "function", "function": {"name": "f", "description": "d", "parameters": {"type": "object"}}}
        ],
        "tool_choice": {"type": "function", "function": {"name": "f"}},
    }


def test_unknown_input_item_type_is_an_error() -> None:
    with pytest.raises(ValueError, match="'web_search_call' has no chat equivalent"):
        items_to_chat_messages([ResponseItem(type="web_search_call")])


def test_images_in_responses_input_become_chat_image_parts_never_dropped() -> None:
    from nemo_gym_tok.contract.conversion import ConversionError, items_to_chat_messages
    from nemo_gym_tok.types.responses import ResponseItem

    image = {"type": "input_image", "image_url": "data:image/png;base64,AAAA", "detail": "low"}
    items = [
        ResponseItem(type="message", role="user", content=[{"type": "input_text", "text": "see"}, image]),
        ResponseItem(type="function_call_output", call_id="c1", output=[{"type": "input_text", "text": "cam"}, image]),
        ResponseItem(
            type="message",
            role="user",
            content=[{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}],
        ),
    ]
    user, tool, text_only = items_to_chat_messages(items)
    chat_image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA", "detail": "low"}}
    assert user["content"] == [{"type": "text", "text": "see"}, chat_image]
    assert tool == {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "cam"}, chat_image]}
    assert text_only["content"] == "ab"  # text only: joined, as before
    by_file = ResponseItem(type="message", role="user", content=[{"type": "input_image", "file_id": "f1"}])
    with pytest.raises(ConversionError, match="file_id images are not supported"):
        items_to_chat_messages([by_file])
