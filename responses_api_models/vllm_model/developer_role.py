"""`developer` messages as vLLM renders them for a chat template without that role: as `system` messages."""

from __future__ import annotations

from typing import Any


def as_server_renders(messages: list[dict[str, Any]], chat_template: Any) -> list[dict[str, Any]]:
    """`messages` with each `developer` message made a `system` one (its `tools` dropped) when `chat_template` never
    names the `developer` role, which vLLM's Hugging Face renderer does (0.32: `_convert_developer_to_system`) before
    it applies such a template. NeMo Gym's shipped rows open with a `developer` message, and Qwen3's template knows no
    such role. vLLM also merges several system messages into the first one; that changes the message indices the
    bundles are tied to, so it is not done here: the adapter's check against the server's /tokenize ids then refuses
    the request instead of splicing a prompt the server would render differently."""
    if not any(message.get("role") == "developer" for message in messages):
        return messages
    text = str(chat_template or "")
    if '"developer"' in text or "'developer'" in text:
        return messages
    return [
        {key: value for key, value in message.items() if key != "tools"} | {"role": "system"}
        if message.get("role") == "developer"
        else message
        for message in messages
    ]
