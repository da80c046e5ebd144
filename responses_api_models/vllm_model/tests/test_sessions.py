"""Every call the adapter makes carries its conversation's x-session-id (what vllm-router keeps a conversation on one
replica by); a list of URLs is refused with how to route them; behind a router its own text 500 is tried once more,
vLLM's JSON 500 never (fakes: the real router's tests are tests/test_router_retries.py and tests/test_router_gym.py).
"""

from __future__ import annotations

from contextlib import ExitStack
from typing import Any

import httpx
import pytest
from pydantic import ValidationError

from nemo_gym_tok.router.fleet import PROBE_MESSAGES
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


ROUTER_ERROR = "Request failed: error sending request for url (http://127.0.0.1:1/v1/chat/completions)"


def behind_fake_router(stack: ExitStack, upstream: FakeUpstream) -> str:
    """The adapter in front of `upstream` answering as vllm-router with itself as its one worker (which the adapter's
    fleet check asks directly)."""
    url = stack.enter_context(serve_in_thread(upstream.app()))
    upstream.router_workers = [url]
    config = VLLMModelConfig(base_url=f"{url}/v1", model="m", retry_backoff_seconds=0.01)
    return stack.enter_context(serve_in_thread(VLLMModel("policy_model", config).build_app()))


def calls(upstream: FakeUpstream) -> list[dict[str, Any]]:
    """The chat calls `upstream` took, the fleet check's probe left out."""
    return [body for body in upstream.requests if body.get("messages") != PROBE_MESSAGES]


@pytest.mark.parametrize("error_text", [ROUTER_ERROR, None])
def test_the_routers_own_500_is_tried_once_more_vllms_never(error_text: str | None) -> None:
    upstream = FakeUpstream("up", status=500, fail_times=1, error_text=error_text)
    with ExitStack() as stack:
        adapter = behind_fake_router(stack, upstream)
        answer = httpx.post(f"{adapter}/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
    if error_text is not None:  # its worker died under the call, maybe mid-turn: sent once more, answered
        assert answer.status_code == 200 and len(calls(upstream)) == 2
        assert upstream.sessions[0] == upstream.sessions[1]  # the retry keeps the conversation's key
    else:  # vLLM's own 500, its JSON error, for this request: not sent again, passed on with vLLM's reason
        assert answer.status_code == 502 and len(calls(upstream)) == 1
        assert "up is broken" in answer.json()["error"]["message"]


def test_a_second_lost_call_is_passed_on_not_sent_a_third_time() -> None:
    upstream = FakeUpstream("router", status=500, error_text=ROUTER_ERROR)
    with ExitStack() as stack:
        adapter = behind_fake_router(stack, upstream)
        answer = httpx.post(f"{adapter}/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
    assert answer.status_code == 502 and len(calls(upstream)) == 2
    assert "after 2 attempts that may each have generated the turn" in answer.json()["error"]["message"]
