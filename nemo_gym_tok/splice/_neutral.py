"""Assistant messages with their model-written text replaced by placeholders, so a template's rendering has none of it.

The splice never needs to know how the template renders the model's own text (that is the part it replaces), and
that text may spell anything, a turn terminator included. Rendering placeholders instead keeps every special token in
the template's output structural, and marks where each assistant turn's body lies.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

import orjson

from nemo_gym_tok.common.exact_json import loads_exact
from nemo_gym_tok.splice._memo import TOKEN_FIELDS

PLACEHOLDER = re.compile(r"ngt(?:body|think|arg)(\d+)q")
"""Placeholder text: letters and digits only, so templates that trim, split or escape content leave it whole."""


def placeholder(kind: str, message_index: int) -> str:
    return f"ngt{kind}{message_index}q"


MESSAGE_PLACEHOLDER = re.compile(r"ngtmsg(\d+)q")
"""Placeholder text of a non-assistant message, in the rendering that checks no turn holds another message."""

ANY_PLACEHOLDER = re.compile(r"ngt(msg|body|think|arg)(\d+)q")
"""Either kind above, with what it stands for (group 1) and its message's index (group 2)."""


def neutralize(
    messages: Sequence[Any],
    up_to: int,
    force_content: frozenset[int] = frozenset(),
    *,
    others: bool = False,
    drop_call_text: bool = False,
) -> list[dict[str, Any]]:
    """Plain-dict copies of `messages`; assistant messages at index <= `up_to` get placeholder text.

    Content becomes a placeholder where the message has content or no tool calls (so every neutral assistant turn
    renders one), reasoning becomes one where the message has reasoning, and each tool call keeps its id and name
    (templates render the name again with the tool's result) but gets placeholder argument values (in the type the
    caller used: a JSON string stays a JSON string). With `others`, every other message's text becomes a placeholder
    too (MESSAGE_PLACEHOLDER), to see where the template puts it. With `drop_call_text`, tool-calling messages get no
    text at all (for templates that render it after the tools' results: it lives in the model's ids).
    """
    neutral = []
    for index, message in enumerate(messages):
        # Token fields are not template input; left out, the neutral messages are the same whichever call carries
        # the bundle (the render memo relies on that) and carry no id lists into the template.
        plain = {
            key: value
            for key, value in (message if type(message) is dict else _plain(message)).items()
            if key not in TOKEN_FIELDS
        }
        if index <= up_to and plain.get("role") == "assistant":
            plain = _neutral_assistant(plain, index, index in force_content, drop_call_text)
        elif others and plain.get("role") != "assistant" and isinstance(plain.get("content"), str) and plain["content"]:
            plain["content"] = f"ngtmsg{index}q"
        neutral.append(plain)
    return neutral


def with_own_tool_calls(message: dict[str, Any]) -> dict[str, Any]:
    """`message` (a plain dict) with tool calls that are its own copies, down to each call's `function`: a renderer
    may edit them in place (vLLM's turns `arguments` into a dict), and the caller's messages must stay as sent."""
    calls = message.get("tool_calls")
    if not isinstance(calls, list) or not calls:
        return message
    return {**message, "tool_calls": [_own_call(call) for call in calls]}


def _own_call(call: Any) -> Any:
    if not isinstance(call, dict):
        return call
    function = call.get("function")
    return {**call, "function": dict(function)} if isinstance(function, dict) else dict(call)


def placeholder_spans(text: str) -> dict[int, tuple[int, int]]:
    """For each message index with a placeholder in `text`: (start of its first, end of its last)."""
    spans: dict[int, tuple[int, int]] = {}
    for match in PLACEHOLDER.finditer(text):
        index = int(match.group(1))
        start, end = spans.get(index, (match.start(), match.end()))
        spans[index] = (min(start, match.start()), max(end, match.end()))
    return spans


def _neutral_assistant(
    message: dict[str, Any], index: int, force_content: bool, drop_call_text: bool
) -> dict[str, Any]:
    neutral = {key: value for key, value in message.items() if key not in ("reasoning", "reasoning_content")}
    calls = message.get("tool_calls")
    if calls and drop_call_text and not force_content:
        neutral["content"] = ""
    elif message.get("content") or not calls or force_content:
        neutral["content"] = placeholder("body", index)
    if message.get("reasoning_content") or message.get("reasoning"):
        neutral["reasoning_content"] = placeholder("think", index)
    if calls:
        neutral["tool_calls"] = [_neutral_call(call, index) for call in calls]
    return neutral


def _neutral_call(call: Any, index: int) -> dict[str, Any]:
    call = _plain(call)
    function = _plain(call.get("function") or {})
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        decoded = _json_value(arguments)
        neutral_arguments: Any = (
            orjson.dumps(_neutral_arguments(decoded, index)).decode()
            if isinstance(decoded, dict)
            else placeholder("arg", index)
        )
    elif isinstance(arguments, Mapping):
        neutral_arguments = _neutral_arguments(arguments, index)
    else:
        neutral_arguments = {"ngt": placeholder("arg", index)}
    return {**call, "function": {**function, "arguments": neutral_arguments}}


def _neutral_arguments(arguments: Mapping[str, Any], index: int) -> dict[str, Any]:
    # Keys are kept (templates such as XML tool formats render one element per key); values are model text.
    return {str(key): placeholder("arg", index) for key in arguments} or {"ngt": placeholder("arg", index)}


def _json_value(text: str) -> Any:
    """`text` parsed as JSON as the server parses it (loads_exact), or None where it is not JSON."""
    try:
        return loads_exact(text)
    except ValueError:
        return None


def _plain(value: Any) -> dict[str, Any]:
    if type(value) is dict or isinstance(value, Mapping):
        return dict(value)
    if hasattr(value, "model_dump"):
        return value.model_dump(exclude_none=True)
    return dict(value)
