"""Every call the adapter makes carries its conversation's x-session-id (what vllm-router keeps a conversation on one
replica by); a list of URLs is refused with how to route them; behind a router a 5xx is tried once more (fakes: the
real router's tests are tests/test_router_gym.py)."""

from __future__ import annotations

from contextlib import ExitStack
from typing import Any

import httpx
import pytest
from pydantic import ValidationError

from nemo_gym_tok.servers.inprocess import serve_in_thread
from responses_api_models.vllm_model.app import VLLMModel, VLLMModelConfig
from responses_api_models.vllm_model.tests.fake_upstream import FakeUpstream


def serve_adapter(stack: ExitStack, upstream: FakeUpstream, **fields: Any) -> str:
    url = stack.enter_context(serve_in_thread(upstream.app()))
    config = VLLMModelConfig(base_url=f"{url}/v1", model="m", retry_backoff_seconds=0.01, **fields)
    return stack.enter_context(serve_in_thread(VLLMModel("policy_model", config).build_app()))


def test_every_call_carries_its_conversations_session_header() -> None:
    upstream = FakeUpstream("vllm")
    histories: dict[str, list[dict[str, str]]] = {"k0": [], "k1": []}
    with ExitStack() as stack:
        adapter = serve_adapter(stack, upstream)
        with httpx.Client(base_url=adapter) as client:
            for turn in range(2):
                for conversation, messages in histories.items():
                    messages.append({"role": "user", "content": f"{conversation} turn {turn}"})
                    answer = client.post("/v1/chat/completions", json={"messages": messages})
                    assert answer.status_code == 200, answer.text
                    assert "set-cookie" not in answer.headers
                    messages.append({"role": "assistant", "content": answer.json()["choices"][0]["message"]["content"]})
            given = client.post(
                "/v1/chat/completions", json={"messages": histories["k0"]}, headers={"x-session-id": "rollout-7"}
            )
            assert given.status_code == 200
            responses = client.post("/v1/responses", json={"input": "hi"}, headers={"x-session-id": "r-8"})
            assert responses.status_code == 200
    derived = upstream.sessions[:4]
    # Without a header, a conversation's key comes from its opening: the same on every turn, one per conversation.
    assert derived[0] == derived[2] and derived[1] == derived[3] and derived[0] != derived[1]
    assert all(key and key.startswith("opening:") for key in derived)
    assert upstream.sessions[4:] == ["rollout-7", "r-8"]  # the caller's own session wins


def test_a_list_of_urls_is_refused_with_how_to_route_them() -> None:
    with pytest.raises(ValidationError) as refused:
        VLLMModelConfig(base_url=["http://a:8000/v1", "http://b:8000/v1"], model="m")
    message = str(refused.value)
    assert "base_url lists 2 vLLM servers" in message and "router: {worker_urls: [...]}" in message
    assert "docs/scaling.md" in message
    assert VLLMModelConfig(base_url=["http://a:8000/v1"], model="m").base_url == "http://a:8000/v1"
    with pytest.raises(ValidationError, match="started by `ngt run`"):
        VLLMModelConfig(router={"worker_urls": ["http://a:8000"]}, model="m")


@pytest.mark.parametrize("behind_router", [True, False])
def test_a_5xx_is_tried_once_more_behind_a_router_only(behind_router: bool) -> None:
    upstream = FakeUpstream("up", status=500, fail_times=1, router_workers=["http://w:1"] if behind_router else None)
    with ExitStack() as stack:
        adapter = serve_adapter(stack, upstream)
        answer = httpx.post(f"{adapter}/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
    if behind_router:  # the router's 500 for a call its worker dropped: tried again, answered
        assert answer.status_code == 200 and len(upstream.requests) == 2
        assert upstream.sessions[0] == upstream.sessions[1]  # the retry keeps the conversation's key
    else:  # vLLM's own 500 for this request: not retried, passed on with vLLM's reason
        assert answer.status_code == 502 and len(upstream.requests) == 1
        assert "up is broken" in answer.json()["error"]["message"]


def test_behind_a_router_a_second_5xx_is_passed_on() -> None:
    upstream = FakeUpstream("router", status=500, router_workers=["http://w:1"])
    with ExitStack() as stack:
        adapter = serve_adapter(stack, upstream)
        answer = httpx.post(f"{adapter}/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
    assert answer.status_code == 502 and len(upstream.requests) == 2
    assert "router is broken" in answer.json()["error"]["message"]
