"""The core scenario: the OpenAI SDK drives the adapter in front of the hooked vLLM for multi-turn conversations."""

from __future__ import annotations

from typing import Any

import pytest
from openai import OpenAI

from tests.conversations import turn_settings


def sdk(url: str, session: str) -> OpenAI:
    return OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, default_headers={"x-session-id": session})


def settings(turn: int) -> tuple[int, dict[str, Any]]:
    options = turn_settings(turn)
    return options.pop("max_tokens"), options


@pytest.mark.parametrize(
    "way, expected_source",
    [("bundles", "message"), ("extra_body_prefix", "message"), ("tokenize_fallback", "tokenize")],
)
def test_chat_turns_are_contiguous(
    way: str, expected_source: str, training_adapter: str, tokenize_fallback_adapter: str
) -> None:
    url = tokenize_fallback_adapter if way == "tokenize_fallback" else training_adapter
    client = sdk(url, f"e2e-{way}")
    messages: list[dict[str, Any]] = []
    previous: list[int] | None = None
    for turn in range(4):
        messages.append({"role": "user", "content": f"Turn {turn}: what now?"})
        max_tokens, extra = settings(turn)
        if way == "extra_body_prefix" and previous is not None:
            extra["required_prefix_token_ids"] = previous
        completion = client.chat.completions.create(
            model="policy", messages=messages, max_tokens=max_tokens, seed=turn, extra_body=extra
        )
        message = completion.choices[0].message.model_dump(exclude_none=True)
        assert message["token_source"] == expected_source
        assert len(message["generation_token_ids"]) == len(message["generation_log_probs"]) > 0
        if previous is not None:
            assert message["prompt_token_ids"][: len(previous)] == previous, f"turn {turn} not contiguous"
            assert message["prefix_splice"]["applied"] is True
        if way == "extra_body_prefix":
            messages.append({"role": "assistant", "content": message.get("content") or ""})
        else:
            messages.append(message)  # the bundle rides on the assistant message, as returned
        previous = message["prompt_token_ids"] + message["generation_token_ids"]


def test_responses_turns_are_contiguous(training_adapter: str) -> None:
    client = sdk(training_adapter, "e2e-responses")
    items: list[Any] = []
    previous: list[int] | None = None
    for turn in range(4):
        items.append({"role": "user", "content": f"Turn {turn}: and then?"})
        max_tokens, extra = settings(turn)
        response = client.responses.create(
            model="policy", input=items, max_output_tokens=max_tokens, extra_body={**extra, "seed": turn}
        )
        output = [item.model_dump(exclude_none=True) for item in response.output]
        bundle = output[-1]
        assert bundle["token_source"] == "message"
        if previous is not None:
            assert bundle["prompt_token_ids"][: len(previous)] == previous, f"turn {turn} not contiguous"
        items.extend(output)
        previous = bundle["prompt_token_ids"] + bundle["generation_token_ids"]
