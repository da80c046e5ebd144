"""Drives seeded multi-turn conversations against a chat endpoint and checks each turn's token contiguity."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx

from nemo_gym_tok.testing.tiny_model import IM_END_ID
from nemo_gym_tok.types.tokens import BUNDLE_FIELDS

Mode = Literal["bundles", "prefix", "stock"]

MOVE_TOOL = {
    "type": "function",
    "function": {
        "name": "move",
        "description": "Move on the grid.",
        "parameters": {
            "type": "object",
            "properties": {
                "direction": {"type": "string", "enum": ["north", "south", "east", "west"]},
                "steps": {"type": "integer", "enum": [1, 2, 3]},
            },
            "required": ["direction", "steps"],
            "additionalProperties": False,
        },
    },
}


def turn_settings(turn: int) -> dict[str, Any]:
    """Even turns end on <|im_end|> (min_tokens, then a strong bias), odd turns are cut by max_tokens."""
    if turn % 2 == 0:
        return {"max_tokens": 64, "min_tokens": 32, "logit_bias": {str(IM_END_ID): 100}}
    return {"max_tokens": 40}


@dataclass
class Turn:
    prompt_token_ids: list[int]
    generation_token_ids: list[int]
    finish_reason: str
    message: dict[str, Any]
    prefix_splice: dict[str, Any] | None
    contiguous: bool


@dataclass
class Conversation:
    seed: int
    turns: list[Turn] = field(default_factory=list)
    messages: list[dict[str, Any]] = field(default_factory=list)

    @property
    def contiguous(self) -> bool:
        return all(turn.contiguous for turn in self.turns)


async def converse(
    http: httpx.AsyncClient, model: str, seed: int, *, turns: int = 4, mode: Mode = "bundles", tools: bool = False
) -> Conversation:
    """Play `turns` model turns; each later turn's reported prompt ids are checked against the previous turn's."""
    conversation = Conversation(seed)
    messages = conversation.messages
    previous: list[int] | None = None
    for turn in range(turns):
        if not (tools and turn > 0):
            messages.append({"role": "user", "content": f"Conversation {seed}, turn {turn}: where next?"})
        body: dict[str, Any] = {
            "model": model,
            "messages": messages,
            "seed": seed * 100 + turn,
            "temperature": 1.0,
            "logprobs": True,
            "top_logprobs": 0,
            "return_token_ids": True,
            **turn_settings(turn),
        }
        if tools:
            body.update(tools=[MOVE_TOOL], tool_choice="required", parallel_tool_calls=False, max_tokens=60)
            body.pop("logit_bias", None)
            body.pop("min_tokens", None)
        if mode == "prefix" and previous is not None:
            body["required_prefix_token_ids"] = previous
        answer = await http.post("/v1/chat/completions", json=body)
        assert answer.status_code == 200, answer.text
        result = answer.json()
        choice = result["choices"][0]
        prompt, generation = result["prompt_token_ids"], choice["token_ids"]
        contiguous = previous is None or prompt[: len(previous)] == previous
        message = choice["message"]
        conversation.turns.append(
            Turn(prompt, generation, choice["finish_reason"], message, result.get("prefix_splice"), contiguous)
        )
        messages.append(history_message(message, mode))
        for call in message.get("tool_calls") or []:
            arguments = json.loads(call["function"]["arguments"])
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": f"moved {arguments['steps']}"})
        previous = prompt + generation
    return conversation


def history_message(message: dict[str, Any], mode: Mode) -> dict[str, Any]:
    kept: dict[str, Any] = {"role": "assistant", "content": message.get("content") or ""}
    reasoning = message.get("reasoning") or message.get("reasoning_content")
    if reasoning:
        kept["reasoning_content"] = reasoning
    if message.get("tool_calls"):
        kept["tool_calls"] = message["tool_calls"]
    if mode == "bundles":
        for key in BUNDLE_FIELDS:
            kept[key] = message[key]
    return kept
