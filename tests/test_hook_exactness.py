"""Exact or refused, on the real hooked vLLM: every way a prefix can fail to fit its messages gets a 400 that says why,
and the legitimate edge cases (terminator spelled as text, new token segments, continued turns) are spliced."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from nemo_gym_tok.testing.tiny_model.tokenizer import IM_END_ID
from nemo_gym_tok.vllm_server import VLLMServer
from tests.conversations import MOVE_TOOL

SYSTEM = {"role": "system", "content": "You are a terse guide."}
USER = {"role": "user", "content": "Which way is north?"}
FOLLOW_UP = {"role": "user", "content": "And then?"}


def chat(server: VLLMServer, messages: list[dict], **extra: Any) -> httpx.Response:
    body = {
        "model": server.served_model_name,
        "messages": messages,
        "max_tokens": 8,
        "seed": 3,
        "return_token_ids": True,
        **extra,
    }
    return httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=120)


def tokenize(server: VLLMServer, text: str) -> list[int]:
    body = {"model": server.served_model_name, "prompt": text, "add_special_tokens": False}
    return httpx.post(f"{server.base_url}/tokenize", json=body, timeout=60).json()["tokens"]


@pytest.fixture(scope="module")
def first_turn(vllm_server: VLLMServer) -> dict[str, Any]:
    """A real turn 1 (ended on <|im_end|>), as a bundled assistant message."""
    answer = chat(vllm_server, [SYSTEM, USER], min_tokens=6, max_tokens=12, logit_bias={str(IM_END_ID): 100}).json()
    generation = answer["choices"][0]["token_ids"]
    assert generation[-1] == IM_END_ID
    return {
        "role": "assistant",
        "content": answer["choices"][0]["message"]["content"],
        "prompt_token_ids": answer["prompt_token_ids"],
        "generation_token_ids": generation,
        "generation_log_probs": [0.0] * len(generation),
    }


def refused(answer: httpx.Response, *phrases: str) -> str:
    assert answer.status_code == 400, answer.text
    message = answer.json()["error"]["message"]
    for phrase in phrases:
        assert phrase in message, message
    return message


def test_edited_system_prompt_is_refused_naming_messages_0(vllm_server: VLLMServer, first_turn) -> None:
    edited = {"role": "system", "content": "You are a verbose guide."}
    refused(
        chat(vllm_server, [edited, USER, first_turn, FOLLOW_UP]),
        "does not belong to these messages",
        "renders for messages[0]",
        "verbose",
    )


def test_tools_added_mid_episode_are_refused(vllm_server: VLLMServer, first_turn) -> None:
    refused(
        chat(vllm_server, [SYSTEM, USER, first_turn, FOLLOW_UP], tools=[MOVE_TOOL]),
        "does not belong to these messages",
        "messages[0]",
    )


def test_prefix_from_another_conversation_is_refused(vllm_server: VLLMServer, first_turn) -> None:
    other = {"role": "user", "content": "Which way is south?"}
    refused(
        chat(
            vllm_server,
            [SYSTEM, other, {k: first_turn[k] for k in ("role", "content")}, FOLLOW_UP],
            required_prefix_token_ids=first_turn["prompt_token_ids"] + first_turn["generation_token_ids"],
        ),
        "required_prefix_token_ids does not belong to these messages",
        "messages[1]",
    )


def test_empty_prefix_with_an_assistant_turn_is_refused(vllm_server: VLLMServer, first_turn) -> None:
    plain = {k: first_turn[k] for k in ("role", "content")}
    refused(
        chat(vllm_server, [SYSTEM, USER, plain, FOLLOW_UP], required_prefix_token_ids=[]),
        "required_prefix_token_ids is empty, but messages[2] is an assistant turn",
    )
    empty_bundle = {**plain, "prompt_token_ids": [], "generation_token_ids": [], "generation_log_probs": []}
    refused(chat(vllm_server, [SYSTEM, USER, empty_bundle, FOLLOW_UP]), "is empty")


def test_prompt_only_prefix_is_refused(vllm_server: VLLMServer, first_turn) -> None:
    plain = {k: first_turn[k] for k in ("role", "content")}
    refused(
        chat(vllm_server, [SYSTEM, USER, plain, FOLLOW_UP], required_prefix_token_ids=first_turn["prompt_token_ids"]),
        "the last assistant span is empty",
    )


def test_truncation_cutting_into_the_prefix_is_refused(vllm_server: VLLMServer, first_turn) -> None:
    refused(
        chat(vllm_server, [SYSTEM, USER, first_turn, FOLLOW_UP], truncate_prompt_tokens=12),
        "truncate_prompt_tokens=12 would cut the first",
    )


def test_terminator_spelled_as_text_in_model_output_is_spliced(vllm_server: VLLMServer) -> None:
    # The model wrote code that spells the turn terminator; the template would re-tokenize the text to the special
    # id (one more terminator in the history), which an id-counting splice refused as stale.
    prompt = chat(vllm_server, [USER], max_tokens=1).json()["prompt_token_ids"]
    text = 'print("<|im_end|>")'
    generation = [token for character in text for token in tokenize(vllm_server, character)] + [IM_END_ID]
    assert generation.count(IM_END_ID) == 1
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "move", "arguments": json.dumps({"direction": text, "steps": 1})},
    }
    assistant = {
        "role": "assistant",
        "content": text,
        "tool_calls": [call],
        "prompt_token_ids": prompt,
        "generation_token_ids": generation,
        "generation_log_probs": [0.0] * len(generation),
    }
    answer = chat(vllm_server, [USER, assistant, {"role": "tool", "tool_call_id": "call_1", "content": "moved"}])
    assert answer.status_code == 200, answer.text
    assert answer.json()["prompt_token_ids"][: len(prompt) + len(generation)] == prompt + generation
    assert answer.json()["prefix_splice"]["applied"] is True


def test_new_token_segment_uses_the_template_and_later_turns_continue_it(vllm_server: VLLMServer, first_turn) -> None:
    compacted = {"role": "system", "content": "You are a terse guide. (Earlier turns summarised.)"}
    refused(chat(vllm_server, [compacted, USER, first_turn, FOLLOW_UP]), "messages[0]")  # not by default
    restarted = chat(vllm_server, [compacted, USER, first_turn, FOLLOW_UP], start_token_segment=True).json()
    assert restarted["prefix_splice"] == {
        "applied": False,
        "template_differed": False,
        "replaced_tokens": 0,
        "new_segment": True,
        "new_segment_reason": "asked",
    }
    prompt, generation = restarted["prompt_token_ids"], restarted["choices"][0]["token_ids"]
    assert prompt[: len(first_turn["prompt_token_ids"])] != first_turn["prompt_token_ids"]
    second = {
        "role": "assistant",
        "content": restarted["choices"][0]["message"]["content"],
        "prompt_token_ids": prompt,
        "generation_token_ids": generation,
        "generation_log_probs": [0.0] * len(generation),
    }
    third = chat(vllm_server, [compacted, USER, first_turn, FOLLOW_UP, second, {"role": "user", "content": "Next?"}])
    assert third.status_code == 200, third.text
    assert third.json()["prompt_token_ids"][: len(prompt) + len(generation)] == prompt + generation


def test_start_token_segment_must_be_a_bool(vllm_server: VLLMServer, first_turn) -> None:
    refused(
        chat(vllm_server, [SYSTEM, USER, first_turn, FOLLOW_UP], start_token_segment="yes"),
        "start_token_segment must be true or false",
    )


def test_continue_final_message_continues_a_cut_turn(vllm_server: VLLMServer) -> None:
    answer = chat(vllm_server, [USER], max_tokens=5).json()
    assert answer["choices"][0]["finish_reason"] == "length"
    prefix = answer["prompt_token_ids"] + answer["choices"][0]["token_ids"]
    partial = {"role": "assistant", "content": answer["choices"][0]["message"]["content"]}
    continued = chat(
        vllm_server,
        [USER, partial],
        required_prefix_token_ids=prefix,
        add_generation_prompt=False,
        continue_final_message=True,
    )
    assert continued.status_code == 200, continued.text
    assert continued.json()["prompt_token_ids"] == prefix
    ended = prefix + [IM_END_ID]
    refused(
        chat(
            vllm_server,
            [USER, partial],
            required_prefix_token_ids=ended,
            add_generation_prompt=False,
            continue_final_message=True,
        ),
        "that turn is over",
    )
