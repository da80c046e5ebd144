"""Converts between Responses items and Chat Completions messages, keeping each token bundle on its model call."""

from __future__ import annotations

import uuid
from typing import Any

from nemo_gym_tok.types.responses import ResponseItem, ResponsesRequest
from nemo_gym_tok.types.tokens import bundle_of

# Responses fields that have a chat-side meaning of their own (translated below) or none at all.
_RESPONSES_ONLY_FIELDS = {
    "input",
    "instructions",
    "max_output_tokens",
    "tools",
    "tool_choice",
    "text",
    "reasoning",
    "store",
    "previous_response_id",
    "include",
    "truncation",
    "background",
    "prompt",
    "conversation",
}


def responses_to_chat_request(request: ResponsesRequest) -> dict[str, Any]:
    """A chat completions body equivalent to `request`; every field the Responses API does not own passes through."""
    body = request.model_dump(exclude_unset=True, exclude_none=True)
    chat: dict[str, Any] = {k: v for k, v in body.items() if k not in _RESPONSES_ONLY_FIELDS}
    chat["messages"] = items_to_chat_messages(request.input_items(), request.instructions)
    if request.max_output_tokens is not None:
        chat["max_tokens"] = request.max_output_tokens
    if request.tools:
        chat["tools"] = [_chat_tool(tool) for tool in request.tools]
    if request.tool_choice is not None:
        chat["tool_choice"] = _chat_tool_choice(request.tool_choice)
    return chat


class ConversionError(ValueError):
    """Input items that have no chat equivalent; `param` names the field, counted from the request's `input`."""

    def __init__(self, message: str, param: str = "input") -> None:
        super().__init__(message)
        self.param = param


def items_to_chat_messages(items: list[ResponseItem], instructions: str | None = None) -> list[dict[str, Any]]:
    """Chat history from Responses items: one assistant message per model call, with that call's bundle."""
    for index, item in enumerate(items):
        for field in ("content", "summary", "output"):
            _check_text_parts(getattr(item, field, None), f"input[{index}].{field}")
    messages: list[dict[str, Any]] = []
    if instructions:
        messages.append({"role": "system", "content": instructions})
    pending: list[ResponseItem] = []  # items of the model call being gathered

    def flush() -> None:
        if pending:
            messages.append(_assistant_message(pending))
            pending.clear()

    for position, item in enumerate(items):
        if item.is_model_output:
            if pending and _opens_next_call(pending[-1], item):
                flush()
            pending.append(item)
            if item.has_bundle:  # the bundle closes its model call
                flush()
            continue
        flush()
        if item.type == "function_call_output":
            output = _chat_content(item.output, f"input[{position}].output")
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": output})
        elif item.type == "message":
            messages.append(_passthrough_message(item))
        else:
            raise ConversionError(f"input item of type {item.type!r} has no chat equivalent")
    flush()
    return messages


def chat_message_to_items(message: dict[str, Any]) -> list[ResponseItem]:
    """Output items of one model call (reasoning, message, function calls); the bundle goes on the last one."""
    items: list[ResponseItem] = []
    reasoning = message.get("reasoning_content") or message.get("reasoning")
    if reasoning:
        items.append(
            ResponseItem(type="reasoning", id=_new_id("rs"), summary=[{"type": "summary_text", "text": reasoning}])
        )
    tool_calls = message.get("tool_calls") or []
    content = message.get("content")
    if content or not tool_calls:
        items.append(
            ResponseItem(
                type="message",
                id=_new_id("msg"),
                role="assistant",
                status="completed",
                content=[{"type": "output_text", "text": content or "", "annotations": []}],
            )
        )
    for call in tool_calls:
        function = call.get("function", {})
        items.append(
            ResponseItem(
                type="function_call",
                id=_new_id("fc"),
                call_id=call.get("id") or _new_id("call"),
                name=function.get("name", ""),
                arguments=function.get("arguments", ""),
                status="completed",
            )
        )
    bundle = bundle_of(message)
    if message.get("context_overflow"):  # the adapter's marker that the history no longer fits: ends the episode
        bundle["context_overflow"] = message["context_overflow"]
    if bundle:
        last = items[-1]
        items[-1] = ResponseItem.model_validate({**last.model_dump(exclude_none=True), **bundle})
    return items


_ORDER_IN_A_CALL = {"reasoning": 0, "message": 1, "function_call": 2}
"""A model call's items come in this order (chat_message_to_items), with at most one assistant message."""


def _opens_next_call(previous: ResponseItem, item: ResponseItem) -> bool:
    """`item` cannot follow `previous` within one model call, so it starts the next one. Calls whose bundles were left
    off (a harness sends only the latest call's) must not merge into one assistant message: the template rendered
    them as two turns."""
    before, now = _ORDER_IN_A_CALL[previous.type], _ORDER_IN_A_CALL[item.type]
    return now < before or now == before == _ORDER_IN_A_CALL["message"]


def _assistant_message(items: list[ResponseItem]) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": ""}
    texts = [_text_of(i.content) for i in items if i.type == "message"]
    if any(texts):
        message["content"] = "".join(texts)
    reasoning = "".join(
        _text_of(i.summary) + _text_of(getattr(i, "content", None)) for i in items if i.type == "reasoning"
    )
    if reasoning:
        message["reasoning_content"] = reasoning
    calls = [i for i in items if i.type == "function_call"]
    if calls:
        message["tool_calls"] = [
            {"id": c.call_id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in calls
        ]
    message.update(bundle_of(items[-1].model_dump()))
    return message


def _passthrough_message(item: ResponseItem) -> dict[str, Any]:
    data = item.model_dump(exclude_none=True, exclude={"type", "id", "status"})
    if isinstance(item.content, list):
        data["content"] = _chat_content(item.content, "input")
    return data


def _chat_content(parts: Any, where: str) -> Any:
    """A Responses content value as chat content: its text joined while it is text only, else chat parts in order,
    each `input_image` (or chat `image_url`) part an `image_url` part, so that no image is dropped on the way."""
    if not isinstance(parts, list) or not any(_is_image(part) for part in parts):
        return parts if isinstance(parts, str) or parts is None else _text_of(parts)
    chat_parts: list[dict[str, Any]] = []
    for index, part in enumerate(parts):
        if not isinstance(part, dict):
            chat_parts.append({"type": "text", "text": str(part)})
        elif part.get("type") == "image_url":
            chat_parts.append(part)
        elif part.get("type") == "input_image":
            url = part.get("image_url")
            if not isinstance(url, str) or not url:
                raise ConversionError(
                    f"{where}[{index}]: an input_image needs its image_url (a data: URL, or a URL the server may "
                    "fetch); file_id images are not supported",
                    param=f"{where}[{index}].image_url",
                )
            image: dict[str, Any] = {"url": url}
            if part.get("detail") is not None:
                image["detail"] = part["detail"]
            chat_parts.append({"type": "image_url", "image_url": image})
        else:
            chat_parts.append({"type": "text", "text": part.get("text", "")})
    return chat_parts


def _is_image(part: Any) -> bool:
    return isinstance(part, dict) and part.get("type") in ("input_image", "image_url")


def _check_text_parts(parts: Any, where: str) -> None:
    """Refuse a list of content parts whose `text` is not a string: joining it would fail deep in the conversion."""
    if not isinstance(parts, list):
        return
    for index, part in enumerate(parts):
        if isinstance(part, dict) and "text" in part and not isinstance(part["text"], str):
            got = type(part["text"]).__name__
            raise ConversionError(f"{where}[{index}].text must be a string, got {got}", param=f"{where}[{index}].text")


def _text_of(parts: Any) -> str:
    """Text of a content value: a string, or a list of parts with `text` (input_text, output_text, summary_text)."""
    if parts is None:
        return ""
    if isinstance(parts, str):
        return parts
    return "".join(part.get("text", "") if isinstance(part, dict) else str(part) for part in parts)


def _chat_tool(tool: dict[str, Any]) -> dict[str, Any]:
    if tool.get("type") == "function" and "function" not in tool:
        function = {k: v for k, v in tool.items() if k not in ("type", "strict")}
        return {"type": "function", "function": function}
    return tool


def _chat_tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict) and choice.get("type") == "function" and "name" in choice:
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"
