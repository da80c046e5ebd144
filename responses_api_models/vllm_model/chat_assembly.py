"""A chat completion and its stream's chunks, each made from the other: chunks assembled, a whole answer split."""

from __future__ import annotations

from typing import Any


class ChatAssembly:
    """The completion vLLM would have answered without streaming, put together from its chunks: text, reasoning and
    tool calls concatenated, token ids and log probs gathered, and any other delta field (the hook's bundle) kept."""

    def __init__(self) -> None:
        self.head: dict[str, Any] = {}
        self.extra: dict[str, Any] = {}
        self.choices: dict[int, dict[str, Any]] = {}
        self.tool_calls: dict[int, dict[int, dict[str, Any]]] = {}

    def add(self, chunk: dict[str, Any]) -> None:
        for key in ("id", "created", "model", "system_fingerprint"):
            if chunk.get(key) is not None:
                self.head.setdefault(key, chunk[key])
        for key in ("prompt_token_ids", "prefix_splice", "usage"):
            if chunk.get(key) is not None:
                self.extra[key] = chunk[key]
        for streamed in chunk.get("choices") or []:
            self._add_choice(streamed)

    def _add_choice(self, streamed: dict[str, Any]) -> None:
        index = streamed.get("index", 0)
        choice = self.choices.setdefault(
            index, {"index": index, "message": {"role": "assistant", "content": ""}, "finish_reason": None}
        )
        message = choice["message"]
        for key, value in (streamed.get("delta") or {}).items():
            if value is None or key == "role":
                continue
            if key in ("content", "reasoning", "reasoning_content"):
                message[key] = (message.get(key) or "") + value
            elif key == "tool_calls":
                for call in value:
                    self._add_tool_call(index, call)
            else:  # the hook's bundle and telemetry, the adapter's context_overflow, fields of newer vLLMs
                message[key] = value
        if streamed.get("token_ids") is not None:
            choice.setdefault("token_ids", []).extend(streamed["token_ids"])
        logprobs = streamed.get("logprobs")
        if isinstance(logprobs, dict) and logprobs.get("content") is not None:
            choice.setdefault("logprobs", {"content": []})["content"].extend(logprobs["content"])
        for key in ("finish_reason", "stop_reason"):
            if streamed.get(key) is not None:
                choice[key] = streamed[key]

    def _add_tool_call(self, choice_index: int, delta: dict[str, Any]) -> None:
        call = self.tool_calls.setdefault(choice_index, {}).setdefault(
            delta.get("index", 0), {"id": None, "type": "function", "function": {"name": "", "arguments": ""}}
        )
        if delta.get("id"):
            call["id"] = delta["id"]
        function = delta.get("function") or {}
        # Names arrive whole and arguments in pieces; both concatenate, as the OpenAI SDK accumulates deltas.
        for key in ("name", "arguments"):
            if function.get(key):
                call["function"][key] += function[key]

    def result(self) -> dict[str, Any]:
        choices = []
        for index, choice in sorted(self.choices.items()):
            calls = self.tool_calls.get(index)
            if calls:
                choice["message"]["tool_calls"] = [call for _, call in sorted(calls.items())]
            choices.append(choice)
        return {**self.head, "object": "chat.completion", **self.extra, "choices": choices}


def chunks_of(result: dict[str, Any]) -> list[dict[str, Any]]:
    """A whole chat completion as the chunks of its stream: the role, the message, the usage."""
    head = {key: result.get(key) for key in ("id", "created", "model")}
    head["object"] = "chat.completion.chunk"
    chunks = []
    for choice in result.get("choices") or []:
        index = choice.get("index", 0)
        rest = {key: value for key, value in choice.get("message", {}).items() if key != "role"}
        chunks.append({**head, "choices": [chunk_choice(index, {"role": "assistant", "content": ""})]})
        chunks.append({**head, "choices": [chunk_choice(index, rest, choice.get("finish_reason"))]})
    chunks.append({**head, "choices": [], "usage": result.get("usage")})
    return chunks


def chunk_choice(index: int, delta: dict[str, Any], finish_reason: str | None = None) -> dict[str, Any]:
    return {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
