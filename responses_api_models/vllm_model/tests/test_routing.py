"""The router on its own: conversation keys, health, failover, probing and the all-down 503 (no HTTP)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from starlette.requests import Request

from nemo_gym_tok.servers.api_errors import ApiError
from responses_api_models.vllm_model.sessions import SessionRouter, conversation_key
from responses_api_models.vllm_model.upstream import UpstreamUnavailable

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


def ok(name: str = "") -> Any:
    async def attempt(url: str) -> str:
        return f"{name}{url}"

    return attempt


def failing_on(*bad: str, status: int = 503) -> Any:
    calls: list[str] = []

    async def attempt(url: str) -> str:
        calls.append(url)
        if url in bad:
            raise UpstreamUnavailable(status, f"{url} is down", url)
        return url

    attempt.calls = calls  # type: ignore[attr-defined]
    return attempt


def test_new_conversations_skip_unhealthy_urls() -> None:
    router = SessionRouter(["u1", "u2", "u3"])
    router.mark_unhealthy("u2", "gone")

    async def scenario() -> list[str]:
        return [await router.call(f"c{i}", ok()) for i in range(6)]

    assert asyncio.run(scenario()) == ["u1", "u3"] * 3
    assert router.replicas["u2"].calls == 0


def test_an_unhealthy_url_comes_back_after_a_healthy_probe() -> None:
    up = {"u1": True, "u2": False}

    async def probe(url: str) -> bool:
        return up[url]

    router = SessionRouter(["u1", "u2"], probe=probe)
    router.mark_unhealthy("u2", "gone")
    asyncio.run(router.probe_unhealthy())
    assert not router.replicas["u2"].healthy
    up["u2"] = True
    asyncio.run(router.probe_unhealthy())
    assert router.replicas["u2"].healthy and router.replicas["u2"].unhealthy_since is None

    async def scenario() -> list[str]:
        return [await router.call(f"c{i}", ok()) for i in range(2)]

    assert sorted(asyncio.run(scenario())) == ["u1", "u2"]


def test_background_probe_runs_while_a_url_is_unhealthy_and_stops_on_close() -> None:
    up: dict[str, bool | None] = {"u1": None, "u2": True}
    probes: list[str] = []

    async def probe(url: str) -> bool:
        probes.append(url)
        if up[url] is None:
            raise RuntimeError("a probe that cannot tell")  # counts as unhealthy; the loop goes on
        return bool(up[url])

    async def scenario() -> None:
        router = SessionRouter(["u1", "u2"], probe=probe, health_check_interval=0.01)
        assert await router.call("c", failing_on("u1")) == "u2"  # c started on u1, failed over
        assert not router.replicas["u1"].healthy and router._prober is not None
        await asyncio.sleep(0.05)
        assert not router.replicas["u1"].healthy and probes and set(probes) == {"u1"}
        up["u1"] = True
        for _ in range(100):
            await asyncio.sleep(0.01)
            if router.replicas["u1"].healthy:
                break
        assert router.replicas["u1"].healthy
        await asyncio.sleep(0.03)
        assert router._prober.done()  # every URL healthy: no more probes
        router.mark_unhealthy("u2", "again")
        assert not router._prober.done()
        await router.aclose()
        assert router._prober is None

    asyncio.run(scenario())


def test_a_known_conversation_fails_over_and_is_remembered() -> None:
    router = SessionRouter(["u1", "u2"])

    async def scenario() -> None:
        assert await router.call("c", ok()) == "u1"
        attempt = failing_on("u1")
        assert await router.call("c", attempt) == "u2"
        assert attempt.calls == ["u1", "u2"]
        assert router.url_of("c") == "u2"
        router.mark_healthy("u1")
        assert await router.call("c", ok()) == "u2"  # stays where it moved (its prefix cache is there now)

    asyncio.run(scenario())
    assert router.replicas["u2"].conversations_moved_in == 1 and router.replicas["u1"].failed_calls == 1
    assert [(a.url, a.outcome) for a in router.attempts] == [
        ("u1", "ok"),
        ("u1", "url_failed"),
        ("u2", "ok"),
        ("u2", "ok"),
    ]


def test_the_requests_own_errors_do_not_fail_over() -> None:
    router = SessionRouter(["u1", "u2"])
    calls: list[str] = []

    async def attempt(url: str) -> str:
        calls.append(url)
        raise ApiError(400, "temperature: must be >= 0")

    with pytest.raises(ApiError, match="temperature"):
        asyncio.run(router.call("c", attempt))
    assert calls == ["u1"] and router.replicas["u1"].healthy
    assert router.attempts[-1].outcome == "error"


def test_all_down_is_503_naming_every_url() -> None:
    router = SessionRouter(["u1", "u2"])
    with pytest.raises(ApiError) as failed:
        asyncio.run(router.call("c", failing_on("u1", "u2", status=502)))
    assert failed.value.status == 503
    assert "u1 (failed this request: u1 is down)" in failed.value.message
    assert "u2 (failed this request: u2 is down)" in failed.value.message

    attempt = failing_on()
    with pytest.raises(ApiError) as refused:
        asyncio.run(router.call("d", attempt))
    assert refused.value.status == 503 and attempt.calls == []  # nothing healthy: not even tried
    assert "u1 (unhealthy for" in refused.value.message and "u2 (unhealthy for" in refused.value.message


def test_a_single_url_is_always_tried_and_keeps_its_own_error() -> None:
    router = SessionRouter(["only"])
    attempt = failing_on("only", status=502)
    for _ in range(2):
        with pytest.raises(UpstreamUnavailable) as failed:
            asyncio.run(router.call("c", attempt))
        assert failed.value.status == 502
    assert attempt.calls == ["only", "only"] and not router.replicas["only"].healthy
    assert asyncio.run(router.call("c", ok("got "))) == "got only"


def test_bad_url_lists_are_refused() -> None:
    for urls in ([], ["u", "u"]):
        with pytest.raises(ValueError):
            SessionRouter(urls)
