"""What an environment's step endpoint reads from the episode the agent posts: its items, and the latest answer."""

from __future__ import annotations

from typing import Any

from nemo_gym_tok.servers.api_errors import ApiError


def step_output(body: dict[str, Any]) -> list[Any]:
    """The episode's items so far (`output` of a step request); a 400 naming the field when it is not a list."""
    output = body.get("output")
    if not isinstance(output, list):
        raise ApiError(400, "step needs output: the list of the episode's items so far", param="output")
    return output


def last_assistant_text(items: list[Any]) -> str:
    """Text of the assistant message answering the last user turn; empty when that turn has none (reasoning only)."""
    for item in reversed(items):
        if not isinstance(item, dict) or item.get("type", "message") != "message":
            continue
        if item.get("role") == "user":
            return ""  # stop here: an older answer was judged in its own round already
        if item.get("role") == "assistant":
            content = item.get("content")
            if isinstance(content, list):  # parts: {"type": "output_text", "text": ...}
                return "".join(p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
            return content if isinstance(content, str) else ""
    return ""
