"""Seeded multi-turn conversations with the tiny GPT-OSS on the hooked vLLM, each turn's prompt ids checked.

A turn is contiguous when its prompt starts with the previous call's prompt + generation ids, except that where the
hook reports `end_token_replaced` the previous call's final end token (`<|return|>`) gave way to Harmony's `<|end|>`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

import httpx

from nemo_gym_tok.testing.tiny_model.gpt_oss import CALL_ID, GENERATION_EOS_IDS, RETURN_ID
from nemo_gym_tok.types.tokens import BUNDLE_FIELDS
from tests import conversations
from tests.conversations import Conversation

Mode = Literal["bundles", "stock"]
MODEL = "tiny-gpt-oss"

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather of a city.",
        "strict": True,  # arguments follow the schema (without it Harmony's grammar takes any JSON value)
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": ["Rome", "Oslo"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
# Harmony's tool-call grammar lets JSON take any whitespace, which a random model fills until max_tokens; a bias
# towards the tokens of {"city":"Rome"} (o200k ids) and <|call|> lets the call close and end on <|call|>.
TOOL_ARGUMENT_IDS = (392, 1243, 7534, 10848, 17500, 18583, 158985)


def turn_settings(turn: int, tools: bool) -> dict[str, Any]:
    """Even turns end on <|return|> (min_tokens, then a strong bias), odd turns are cut by max_tokens; with tools,
    turn 1 is a forced tool call, and every turn offers the tools (Harmony renders them into the developer message,
    so a call without them has another history)."""
    offered = {"tools": [WEATHER_TOOL], "tool_choice": "none"} if tools else {}
    if tools and turn == 1:
        bias = {str(token): 30 for token in TOOL_ARGUMENT_IDS} | {str(CALL_ID): 60}
        return {**offered, "max_tokens": 48, "tool_choice": "required", "logit_bias": bias}
    if turn % 2 == 0:
        return {**offered, "max_tokens": 48, "min_tokens": 8, "logit_bias": {str(RETURN_ID): 100}}
    return {**offered, "max_tokens": 12}


@dataclass
class Turn(conversations.Turn):
    @property
    def ended_on(self) -> str:
        last = self.generation_token_ids[-1] if self.generation_token_ids else None
        return {RETURN_ID: "return", CALL_ID: "call"}.get(last, "end id" if last in GENERATION_EOS_IDS else "cut")


def continues(prompt: list[int], previous: list[int], prefix_splice: dict[str, Any] | None) -> bool:
    """The end-token rule: `prompt` starts with `previous`, or with all of it but its final id where the hook says
    it replaced the model's end token."""
    expected = previous[:-1] if (prefix_splice or {}).get("end_token_replaced") else previous
    return prompt[: len(expected)] == expected


def stock_continues(prompt: list[int], previous: list[int]) -> bool:
    """Without the hook's telemetry: `prompt` starts with `previous`, or with all of it but a final end id."""
    return prompt[: len(previous)] == previous or (
        previous[-1] in GENERATION_EOS_IDS and prompt[: len(previous) - 1] == previous[:-1]
    )


async def converse(
    http: httpx.AsyncClient,
    seed: int,
    *,
    turns: int = 4,
    mode: Mode = "bundles",
    tools: bool = False,
    system: bool = True,
) -> Conversation:
    """Play `turns` model turns, sending the history with each turn's bundle (or without, for stock)."""
    conversation = Conversation(seed)
    messages = conversation.messages
    if system:
        messages.append({"role": "system", "content": f"You are terse. Conversation {seed}."})
    previous: list[int] | None = None
    for turn in range(turns):
        if not messages or messages[-1]["role"] != "tool":
            messages.append({"role": "user", "content": f"Conversation {seed}, turn {turn}: what next?"})
        body: dict[str, Any] = {
            "model": MODEL,
            "messages": messages,
            "seed": seed * 100 + turn,
            "temperature": 1.0,
            "logprobs": True,
            "top_logprobs": 0,
            "return_token_ids": True,
            **turn_settings(turn, tools),
        }
        answer = await http.post("/v1/chat/completions", json=body)
        assert answer.status_code == 200, answer.text
        result = answer.json()
        choice = result["choices"][0]
        message = choice["message"]
        prompt, generation = message["prompt_token_ids"], message["generation_token_ids"]
        assert prompt == result["prompt_token_ids"] and generation == choice["token_ids"]
        telemetry = result.get("prefix_splice")
        if previous is None:
            contiguous = True
        elif mode == "stock":
            contiguous = stock_continues(prompt, previous)
        else:
            contiguous = continues(prompt, previous, telemetry)
        conversation.turns.append(Turn(prompt, generation, choice["finish_reason"], message, telemetry, contiguous))
        messages.append(history_message(message, mode))
        for call in message.get("tool_calls") or []:
            city = json.loads(call["function"]["arguments"]).get("city", "?")
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": f"sunny in {city}"})
        previous = prompt + generation
    return conversation


def history_message(message: dict[str, Any], mode: Mode) -> dict[str, Any]:
    """The assistant message as a client sends it back: text, reasoning, tool calls (and the bundle)."""
    kept: dict[str, Any] = {"role": "assistant", "content": message.get("content") or ""}
    if message.get("reasoning"):
        kept["reasoning"] = message["reasoning"]
    if message.get("tool_calls"):
        kept["tool_calls"] = [
            {"id": call["id"], "type": "function", "function": call["function"]} for call in message["tool_calls"]
        ]
    if mode == "bundles":
        kept.update({key: message[key] for key in BUNDLE_FIELDS})
    return kept
