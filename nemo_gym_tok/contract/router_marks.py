"""The fields vllm-router 0.1.17 adds to a chat request it forwards, by which a server behind it can tell."""

from __future__ import annotations

from collections.abc import Iterable

ROUTER_ADDED_CHAT_FIELDS: frozenset[str] = frozenset(
    {
        "stream",
        "logprobs",
        "no_stop_trim",
        "ignore_eos",
        "continue_final_message",
        "skip_special_tokens",
        "separate_reasoning",
        "stream_reasoning",
        "return_hidden_states",
        "include_reasoning",
    }
)
"""Top-level fields the router writes, with its defaults, into every /v1/chat/completions body that lacks them
(tests/test_router_process.py holds a real router to this set). It keeps a field the client sent, as sent."""

ROUTER_ONLY_CHAT_MARKERS: frozenset[str] = frozenset({"separate_reasoning", "stream_reasoning", "return_hidden_states"})
"""The added fields no vLLM client sends and vLLM ignores (SGLang's request fields): their presence marks a body the
router re-serialized. The other added fields are vLLM's own and a client may send them."""


def came_through_vllm_router(body_keys: Iterable[str]) -> bool:
    """True when a chat body's top-level keys carry every router-only marker: the router re-wrote it on the way, so
    the fields it drops from messages (the token bundle, `reasoning_content`) may be missing for that reason."""
    return ROUTER_ONLY_CHAT_MARKERS <= set(body_keys)
