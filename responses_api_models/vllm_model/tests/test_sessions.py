"""Session stickiness and spread across several vLLM URLs (two recording upstreams)."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from nemo_gym_tok.servers.inprocess import serve_in_thread
from responses_api_models.vllm_model.app import VLLMModel, VLLMModelConfig
from responses_api_models.vllm_model.sessions import SessionRouter
from responses_api_models.vllm_model.tests.fake_upstream import FakeUpstream


@pytest.fixture
def two_upstreams() -> Iterator[tuple[str, FakeUpstream, FakeUpstream]]:
    a, b = FakeUpstream("a"), FakeUpstream("b")
    with serve_in_thread(a.app()) as url_a, serve_in_thread(b.app()) as url_b:
        config = VLLMModelConfig(base_url=[f"{url_a}/v1", url_b], model="m")
        with serve_in_thread(VLLMModel("policy_model", config).build_app()) as adapter:
            yield adapter, a, b


def ask(client: httpx.Client, conversation: str, turn: int, headers: dict[str, str] | None = None) -> str:
    body = {"messages": [{"role": "user", "content": f"{conversation} turn {turn}"}]}
    answer = client.post("/v1/chat/completions", json=body, headers=headers or {})
    assert answer.status_code == 200, answer.text
    return answer.json()["choices"][0]["message"]["content"]


def served_by(upstream: FakeUpstream) -> set[str]:
    return {r["messages"][0]["content"].split(" turn ")[0] for r in upstream.requests}


def test_header_sessions_stick_to_one_url_and_spread(two_upstreams) -> None:
    adapter, a, b = two_upstreams
    with httpx.Client(base_url=adapter) as client:  # one client, many conversations
        for turn in range(3):
            for conversation in ("c0", "c1", "c2", "c3"):
                ask(client, conversation, turn, {"x-session-id": conversation})
    assert served_by(a) and served_by(b)  # spread
    assert not served_by(a) & served_by(b)  # each conversation stayed on one URL
    assert len(a.requests) + len(b.requests) == 12


def test_cookie_session_sticks_without_a_header(two_upstreams) -> None:
    adapter, a, b = two_upstreams
    answers = set()
    for conversation in ("k0", "k1"):
        with httpx.Client(base_url=adapter) as client:  # httpx keeps the adapter's session cookie
            answers |= {ask(client, conversation, turn) for turn in range(3)}
            assert client.cookies.get("ngt_session")
    assert answers == {"from a", "from b"}  # two cookie sessions went to two URLs, each to one only
    assert served_by(a) != served_by(b) and len(served_by(a)) == len(served_by(b)) == 1


def test_router_remembers_sessions_round_robin() -> None:
    router = SessionRouter(["u1", "u2", "u3"])
    first = [router.url_for(f"s{i}") for i in range(6)]
    assert first == ["u1", "u2", "u3", "u1", "u2", "u3"]
    assert [router.url_for(f"s{i}") for i in range(6)] == first
    with pytest.raises(ValueError):
        SessionRouter([])
