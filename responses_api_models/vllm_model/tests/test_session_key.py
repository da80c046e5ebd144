"""Behind vllm-router, without HTTP: conversation keys, what a call carries across the router, router detection and
the fleet's one fingerprint."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from starlette.requests import Request

from responses_api_models.vllm_model.behind_router import RouterView, crossing_body, detect_router, server_label
from responses_api_models.vllm_model.session_key import conversation_key

SYSTEM = {"role": "system", "content": "Play the game."}


def request(session: str | None = None) -> Request:
    headers = [(b"x-session-id", session.encode())] if session else []
    return Request({"type": "http", "method": "POST", "path": "/", "headers": headers})


def key(body: dict[str, Any], session: str | None = None) -> str:
    return conversation_key(request(session), body)


def user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def test_a_conversations_turns_share_its_key() -> None:
    first = {"model": "m", "messages": [SYSTEM, user("guess")]}
    bundled = {
        "role": "assistant",
        "content": "50",
        "prompt_token_ids": [1],
        "generation_token_ids": [2],
        "generation_log_probs": [-0.5],
    }
    later = {
        "model": "m",
        "messages": [
            SYSTEM,
            user("guess"),
            bundled,
            user("Higher."),
            {"role": "assistant", "content": "75"},
            user("Lower."),
        ],
        "max_tokens": 9,
        "required_prefix_token_ids": [1, 2],
    }
    assert key(first) == key(later)
    assert key(first).startswith("opening:")
    # Responses: `input` as text, then as items with `type` added by the client, and with output items after.
    text = {"model": "m", "input": "guess", "instructions": "Play."}
    items = {
        "model": "m",
        "input": [
            {"type": "message", "role": "user", "content": "guess"},
            {"type": "message", "role": "assistant", "content": "50"},
        ],
        "instructions": "Play.",
    }
    assert key(text) == key(items)


def test_different_conversations_get_different_keys() -> None:
    base = {"model": "m", "messages": [SYSTEM, user("guess 1")]}
    keys = {
        key(base),
        key({**base, "messages": [SYSTEM, user("guess 2")]}),
        key({**base, "messages": [{"role": "system", "content": "Other game."}, user("guess 1")]}),
        key({**base, "model": "other"}),
        key({"model": "m", "input": "guess 1", "instructions": "Play."}),
        key({"model": "m", "input": "guess 1", "instructions": "Work."}),
        key({"model": "m", "messages": [SYSTEM]}),  # no user message yet: every message is the opening
    }
    assert len(keys) == 7


def test_the_session_header_wins() -> None:
    one, two = {"messages": [user("a")]}, {"messages": [user("b")]}
    assert key(one, "s1") == key(two, "s1") == "s1"
    assert key(one, "s1") != key(one, "s2")
    assert key(one, "") == key(one)  # an empty header is no key


def test_crossing_a_router_the_prefix_goes_top_level_and_reasoning_is_renamed() -> None:
    bundled = {
        "role": "assistant",
        "content": "50",
        "reasoning_content": "Halfway.",
        "prompt_token_ids": [1],
        "generation_token_ids": [2],
        "generation_log_probs": [-0.5],
    }
    body = {"messages": [user("guess"), bundled, user("Higher.")], "return_token_ids": True}
    crossing = crossing_body(body, [1, 2])
    assert crossing["required_prefix_token_ids"] == [1, 2] and "start_token_segment" not in crossing
    assert crossing["messages"][1]["reasoning"] == "Halfway." and "reasoning_content" not in crossing["messages"][1]
    assert crossing["messages"][0] is body["messages"][0]  # unchanged messages are shared, not copied
    assert body["messages"][1]["reasoning_content"] == "Halfway." and "required_prefix_token_ids" not in body
    # A caller's own top-level prefix is kept as sent.
    assert crossing_body({**body, "required_prefix_token_ids": [9]}, [1, 2])["required_prefix_token_ids"] == [9]


def test_crossing_a_router_a_history_without_ids_says_it_starts_a_segment() -> None:
    text_only = {"messages": [user("guess"), {"role": "assistant", "content": "50"}, user("Higher.")]}
    assert crossing_body({**text_only, "return_token_ids": True}, None)["start_token_segment"] is True
    assert crossing_body({**text_only, "logprobs": True}, None)["start_token_segment"] is True
    assert "start_token_segment" not in crossing_body(text_only, None)  # no ids asked for: the hook never refuses
    first_turn = {"messages": [user("guess")], "return_token_ids": True}
    assert crossing_body(first_turn, None) == first_turn  # nothing to cross


def test_a_router_is_told_from_a_vllm_by_its_worker_list() -> None:
    answers: dict[str, tuple[int, bytes] | None] = {
        "http://router": (200, json.dumps({"urls": ["http://a:8000", "http://b:8000"]}).encode()),
        "http://vllm": (404, b'{"detail":"Not Found"}'),
        "http://down": None,
        "http://odd": (200, b"[1, 2]"),
    }

    async def get_small(base_url: str, path: str) -> tuple[int, bytes] | None:
        assert path == "/list_workers"
        return answers[base_url]

    found = {url: asyncio.run(detect_router(get_small, url)) for url in answers}
    assert found["http://router"] == RouterView("http://router", ("http://a:8000", "http://b:8000"))
    assert found["http://vllm"] is found["http://down"] is found["http://odd"] is None


def test_an_error_names_the_router_and_the_worker_that_served() -> None:
    router = RouterView("http://router:9000", ("http://a:8000", "http://b:8000"))
    assert server_label("http://v:8000", None) == "the vLLM server at http://v:8000"
    answer = {"choices": [{"message": {"replica": "http://b:8000"}}]}
    named = server_label("http://router:9000", router, answer)
    assert "vllm-router at http://router:9000" in named and "its worker http://b:8000" in named
    assert "one of http://a:8000, http://b:8000" in server_label("http://router:9000", router)
