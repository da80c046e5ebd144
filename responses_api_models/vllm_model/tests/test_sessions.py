"""Conversations across several vLLM URLs through the adapter: stickiness, spread, failover, all down (fakes)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import ExitStack
from typing import Any

import httpx
import pytest

from nemo_gym_tok.common.net import free_port
from nemo_gym_tok.servers.inprocess import serve_in_thread
from responses_api_models.vllm_model.app import VLLMModel, VLLMModelConfig
from responses_api_models.vllm_model.tests.fake_upstream import FakeUpstream


def serve_adapter(stack: ExitStack, base_urls: list[str], **fields: Any) -> str:
    config = VLLMModelConfig(
        base_url=base_urls, model="m", retry_backoff_seconds=0.01, health_check_interval_seconds=0.05, **fields
    )
    return stack.enter_context(serve_in_thread(VLLMModel("policy_model", config).build_app()))


@pytest.fixture
def two_upstreams() -> Iterator[tuple[str, FakeUpstream, FakeUpstream]]:
    a, b = FakeUpstream("a"), FakeUpstream("b")
    with ExitStack() as stack:
        url_a, url_b = stack.enter_context(serve_in_thread(a.app())), stack.enter_context(serve_in_thread(b.app()))
        yield serve_adapter(stack, [f"{url_a}/v1", url_b], max_attempts=2), a, b


def ask(client: httpx.Client, conversation: str, turn: int, headers: dict[str, str] | None = None) -> str:
    body = {"messages": [{"role": "user", "content": f"{conversation} turn {turn}"}]}
    answer = client.post("/v1/chat/completions", json=body, headers=headers or {})
    assert answer.status_code == 200, answer.text
    return answer.json()["choices"][0]["message"]["content"]


def served_by(upstream: FakeUpstream) -> set[str]:
    return {r["messages"][0]["content"].split(" turn ")[0] for r in upstream.requests}


def routing(adapter: str) -> dict[str, dict[str, Any]]:
    report = httpx.get(f"{adapter}/routing").json()
    return {entry["url"]: entry for entry in report["urls"]}


def test_header_sessions_stick_to_one_url_and_spread(two_upstreams) -> None:
    adapter, a, b = two_upstreams
    with httpx.Client(base_url=adapter) as client:  # one client, many conversations
        for turn in range(3):
            for conversation in ("c0", "c1", "c2", "c3"):
                ask(client, conversation, turn, {"x-session-id": conversation})
    assert served_by(a) and served_by(b)  # spread
    assert not served_by(a) & served_by(b)  # each conversation stayed on one URL
    assert len(a.requests) + len(b.requests) == 12


def test_one_client_without_header_spreads_its_conversations_and_sets_no_cookie(two_upstreams) -> None:
    adapter, a, b = two_upstreams
    histories: dict[str, list[dict[str, str]]] = {"k0": [], "k1": []}
    with httpx.Client(base_url=adapter) as client:  # one SDK-like client that would keep any cookie
        for turn in range(3):
            for conversation, messages in histories.items():
                messages.append({"role": "user", "content": f"{conversation} turn {turn}"})
                answer = client.post("/v1/chat/completions", json={"messages": messages})
                assert answer.status_code == 200, answer.text
                assert "set-cookie" not in answer.headers
                messages.append({"role": "assistant", "content": answer.json()["choices"][0]["message"]["content"]})
        assert not client.cookies
    # Each conversation's later turns share its opening message, so each stayed on one URL; the two went to two.
    assert {m["content"] for m in histories["k0"][1::2]} != {m["content"] for m in histories["k1"][1::2]}
    assert len(served_by(a)) == len(served_by(b)) == 1 and served_by(a) != served_by(b)
    assert len(a.requests) == len(b.requests) == 3


def test_known_conversation_fails_over_and_stays_on_the_new_url(two_upstreams) -> None:
    adapter, a, b = two_upstreams
    headers = {"x-session-id": "conversation"}
    with httpx.Client(base_url=adapter) as client:
        assert ask(client, "c", 0, headers) == "from a"  # round-robin: the first conversation goes to a
        a.status, a.healthy = 500, False
        # a answered 500 and its /health fails too: marked unhealthy at once (a 500 is not retried), failed over
        assert ask(client, "c", 1, headers) == "from b"
        assert len(a.requests) == 1 + 1
        url_a = list(routing(adapter))[0]
        assert not routing(adapter)[url_a]["healthy"]
        a.status, a.healthy = 200, True
        deadline = time.monotonic() + 5
        while not routing(adapter)[url_a]["healthy"]:  # the background probe brings it back
            assert time.monotonic() < deadline, "a was not probed back to healthy"
            time.sleep(0.02)
        assert ask(client, "c", 2, headers) == "from b"  # remembered on b
        assert ask(client, "new", 0, {"x-session-id": "new"}) == "from a"  # new conversations reach a again
    report = routing(adapter)
    assert report[url_a]["failed_calls"] == 1 and report[url_a]["times_marked_unhealthy"] == 1
    assert [entry["conversations_moved_in"] for entry in report.values()] == [0, 1]
    assert a.health_checks >= 1


def test_dead_url_is_skipped_after_its_first_failure() -> None:
    live = FakeUpstream("live")
    dead = f"http://127.0.0.1:{free_port()}/v1"
    with ExitStack() as stack:
        live_url = stack.enter_context(serve_in_thread(live.app()))
        adapter = serve_adapter(stack, [dead, live_url])
        with httpx.Client(base_url=adapter) as client:
            answers = [ask(client, f"c{i}", 0, {"x-session-id": f"c{i}"}) for i in range(6)]
        report = routing(adapter)
    assert answers == ["from live"] * 6  # c0 went to the dead URL first and failed over
    assert report[dead]["calls"] == 1 and not report[dead]["healthy"]
    assert report[dead]["conversations_started"] == 1 and report[live_url]["conversations_started"] == 5
    assert "unreachable" in report[dead]["last_error"]


def test_all_urls_down_is_503_naming_them() -> None:
    dead = [f"http://127.0.0.1:{free_port()}/v1", f"http://127.0.0.1:{free_port()}"]
    with ExitStack() as stack:
        adapter = serve_adapter(stack, dead, max_attempts=1)
        first = httpx.post(f"{adapter}/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
        second = httpx.post(f"{adapter}/v1/responses", json={"input": "y"})
        report = routing(adapter)
    assert first.status_code == second.status_code == 503
    for answer in (first, second):
        message = answer.json()["error"]["message"]
        assert message.startswith("no healthy vLLM URL: ") and all(url in message for url in dead)
    assert "failed this request" in first.json()["error"]["message"]
    assert "unhealthy for" in second.json()["error"]["message"]  # refused without another call
    assert [entry["calls"] for entry in report.values()] == [1, 1]
