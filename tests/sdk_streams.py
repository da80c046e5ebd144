"""Seeded conversations through the OpenAI SDK, streamed or not, reduced to what the streaming tests compare."""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from openai import OpenAI

from nemo_gym_tok.types.tokens import BUNDLE_FIELDS
from tests.conversations import MOVE_TOOL, turn_settings


@dataclass
class SdkTurn:
    """One model call as a client sees it, streamed or not."""

    text: str
    tool_calls: list[dict[str, Any]]
    finish_reason: str | None
    bundle: dict[str, Any]
    """prompt_token_ids, generation_token_ids, generation_log_probs (and token_source through the adapter)."""
    telemetry: dict[str, Any] | None
    """Top-level `prefix_splice` (non-streaming: the completion; streaming: the final chunk)."""
    first_chunk_telemetry: dict[str, Any] | None = None
    chunks: list[dict[str, Any]] = field(default_factory=list)

    def comparable(self) -> dict[str, Any]:
        """What must not depend on streaming: text, tool calls (ids aside: vLLM makes them up), ids, telemetry."""
        calls = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in self.tool_calls]
        ids = {key: value for key, value in self.bundle.items() if key != "generation_log_probs"}
        return {
            "text": self.text,
            "calls": calls,
            "finish": self.finish_reason,
            "ids": ids,
            "telemetry": _without_proof_timing(self.telemetry),
        }

    def history_message(self) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": self.text}
        if self.tool_calls:
            message["tool_calls"] = self.tool_calls
        message.update({key: self.bundle[key] for key in BUNDLE_FIELDS})
        return message


def _without_proof_timing(telemetry: dict[str, Any] | None) -> dict[str, Any] | None:
    """The adapter-side splice's `proof` says when the template was proven (which call, how long ago): it depends on
    the order calls arrive in, not on streaming, so only how it was proven is compared."""
    if not telemetry or not isinstance(telemetry.get("proof"), dict):
        return telemetry
    return {**telemetry, "proof": {"by": telemetry["proof"].get("by")}}


def from_stream(chunks: Iterable[Any]) -> SdkTurn:
    """A streamed chat completion (the SDK's chunks) put together as a client does."""
    dumped = [chunk.model_dump(exclude_none=True) for chunk in chunks]
    text, finish, calls = "", None, {}
    final: dict[str, Any] = {}
    for chunk in dumped:
        for choice in chunk.get("choices", []):
            delta = choice.get("delta", {})
            if any(key in delta for key in BUNDLE_FIELDS):
                final = chunk  # the final chunk: bundle on the delta
                continue
            text += delta.get("content") or ""
            finish = choice.get("finish_reason") or finish
            for call in delta.get("tool_calls") or []:
                entry = calls.setdefault(
                    call["index"], {"id": "", "type": "function", "function": {"name": "", "arguments": ""}}
                )
                entry["id"] += call.get("id") or ""
                for key in ("name", "arguments"):
                    entry["function"][key] += (call.get("function") or {}).get(key) or ""
        if not chunk.get("choices") and "prefix_splice" in chunk and "usage" not in chunk:
            final = chunk  # telemetry alone
    bundle_keys = (*BUNDLE_FIELDS, "token_source")
    delta = final["choices"][0]["delta"] if final.get("choices") else {}
    return SdkTurn(
        text=text,
        tool_calls=[calls[index] for index in sorted(calls)],
        finish_reason=finish,
        bundle={key: delta[key] for key in bundle_keys if key in delta},
        telemetry=final.get("prefix_splice"),
        first_chunk_telemetry=dumped[0].get("prefix_splice") if dumped else None,
        chunks=dumped,
    )


def from_completion(completion: Any) -> SdkTurn:
    choice = completion.choices[0]
    message = choice.message.model_dump(exclude_none=True)
    return SdkTurn(
        text=message.get("content") or "",
        tool_calls=message.get("tool_calls") or [],
        finish_reason=choice.finish_reason,
        bundle={key: message[key] for key in (*BUNDLE_FIELDS, "token_source") if key in message},
        telemetry=(completion.model_extra or {}).get("prefix_splice"),
    )


def converse(
    client: OpenAI, seed: int, *, stream: bool, turns: int = 4, model: str = "policy", **options: Any
) -> list[SdkTurn]:
    """A seeded conversation with the bundles sent back: turn 1 a forced tool call (answered by a tool message), the
    others text ending on <|im_end|> (turns 0 and 2) or cut by max_tokens (turn 3). `options` go into every create()."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": f"You steer robot {seed}."},
        {"role": "user", "content": "Where next?"},
    ]
    played = []
    for turn in range(turns):
        kwargs: dict[str, Any] = {
            "model": model,
            "messages": messages,
            "seed": seed * 10 + turn,
            "temperature": 1.0,
            "tools": [MOVE_TOOL],
            **options,
        }
        extra: dict[str, Any] = {}
        if turn == 1:
            kwargs.update(tool_choice="required", parallel_tool_calls=False, max_tokens=60)
        else:
            settings = turn_settings(turn)
            kwargs["max_tokens"] = settings.pop("max_tokens")
            extra.update(settings)
        if stream:
            got = from_stream(
                client.chat.completions.create(
                    stream=True, stream_options={"include_usage": True}, extra_body=extra, **kwargs
                )
            )
        else:
            got = from_completion(client.chat.completions.create(extra_body=extra, **kwargs))
        played.append(got)
        messages.append(got.history_message())
        for call in got.tool_calls:
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": "moved"})
        if not got.tool_calls:
            messages.append({"role": "user", "content": f"And after turn {turn}?"})
    return played


def contiguous(turns: list[SdkTurn]) -> bool:
    """Every turn's prompt starts with the previous turn's prompt + generation ids."""
    return all(
        later.bundle["prompt_token_ids"][: len(prefix)] == prefix
        for turn, later in zip(turns, turns[1:])
        for prefix in [turn.bundle["prompt_token_ids"] + turn.bundle["generation_token_ids"]]
    )
