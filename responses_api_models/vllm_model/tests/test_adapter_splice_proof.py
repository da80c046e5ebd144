"""The adapter-side splice proves its local template once per server and scope, then splices without /tokenize; a
restarted server (a new connection) is checked again by a probe. Against the real stock vLLM, through proxies."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import Response

from nemo_gym_tok.common.net import free_port
from nemo_gym_tok.servers.inprocess import serve_in_thread
from nemo_gym_tok.vllm_server import VLLMServer
from responses_api_models.vllm_model.template_proofs import PROBE_MESSAGES
from responses_api_models.vllm_model.tests.conftest import RecordingProxy, adapter, recording_proxy_app
from responses_api_models.vllm_model.tests.test_adapter_splice import play
from tests.conversations import MOVE_TOOL

TURNS = 6


@pytest.fixture(scope="module")
def proxy(plain_vllm_server: VLLMServer) -> Iterator[RecordingProxy]:
    recorded = RecordingProxy(url="")
    with serve_in_thread(recording_proxy_app(plain_vllm_server.base_url, recorded)) as url:
        recorded.url = url
        yield recorded


@pytest.fixture(scope="module")
def adapter_url(proxy: RecordingProxy, plain_vllm_server: VLLMServer) -> Iterator[str]:
    yield from adapter(
        f"{proxy.url}/v1", plain_vllm_server.served_model_name, return_token_id_information=True, splice="adapter"
    )


def splicing_adapter(base_url: str, server: VLLMServer, **fields: Any) -> AbstractContextManager[str]:
    """The adapter with splice: adapter and token information on, in front of `base_url`, for one `with` block."""
    return contextmanager(adapter)(
        base_url, server.served_model_name, return_token_id_information=True, splice="adapter", **fields
    )


def test_one_tokenize_proves_the_scope_for_every_later_turn(adapter_url: str, proxy: RecordingProxy) -> None:
    proxy.exchanges.clear()
    # One after another: concurrent calls open more connections, and each new connection is proven again.
    conversations = [
        conversation for seed in range(70, 74) for conversation in play(adapter_url, range(seed, seed + 1), turns=TURNS)
    ]
    first = conversations[:1]
    assert all(c.contiguous() for c in conversations)
    spliced = [t for c in conversations for t in c.telemetry[1:]]
    assert len(spliced) == 4 * (TURNS - 1) and all(t["spliced_by"] == "adapter" for t in spliced)
    # One scope (the same tools and template arguments on every turn), one server: proven by the first spliced
    # turn's /tokenize (its prompt, and the scope's probe beside it), and never asked again.
    asked = proxy.bodies("/tokenize")
    assert len(asked) == 2
    assert sorted(body["messages"] == list(PROBE_MESSAGES) for body in asked) == [False, True]
    assert len(proxy.bodies("/v1/chat/completions")) == 4 * TURNS
    proving = [t for t in spliced if t["proof"]["this_request"]]
    assert proving == [first[0].telemetry[1]]
    assert all(t["proof"]["by"] == "server_tokenize" and t["proof"]["age_seconds"] >= 0 for t in spliced)
    assert sum(t["replaced_tokens"] > 0 for t in spliced) > 0  # the splice did real work on the proven path too


def test_a_restarted_server_is_proven_again(plain_vllm_server: VLLMServer) -> None:
    port = free_port("127.0.0.1")
    before, after = RecordingProxy(url=""), RecordingProxy(url="")
    with splicing_adapter(f"http://127.0.0.1:{port}/v1", plain_vllm_server) as adapter_at:
        with serve_in_thread(recording_proxy_app(plain_vllm_server.base_url, before), port=port):
            (first,) = play(adapter_at, range(74, 75), turns=3)
        # The first proxy stops (its connections close) and another listens on the same address: what the adapter
        # sees of a vLLM server restarted in place, which may serve another template.
        with serve_in_thread(recording_proxy_app(plain_vllm_server.base_url, after), port=port):
            (second,) = play(adapter_at, range(75, 76), turns=3)
    assert first.contiguous() and second.contiguous()
    assert len(before.bodies("/tokenize")) == 2  # the first proof: the prompt and the probe
    # After the restart only the probe is asked again (a few dozen ids), and the same ids renew the proof.
    assert [body["messages"] for body in after.bodies("/tokenize")] == [list(PROBE_MESSAGES)]
    assert [(t["proof"]["this_request"], t["proof"]["renewed"]) for t in first.telemetry[1:]] == [
        (True, False),
        (False, False),
    ]
    assert [(t["proof"]["this_request"], t["proof"]["renewed"]) for t in second.telemetry[1:]] == [
        (False, True),
        (False, False),
    ]


def different_template_app(target: str) -> FastAPI:
    """A server whose /tokenize renders one id more than the adapter's copy: a server restarted with another chat
    template, as far as the proof can see."""
    app = FastAPI()

    @app.api_route("/{path:path}", methods=["GET", "POST"])
    async def forward(path: str, request: Request) -> Response:
        async with httpx.AsyncClient(base_url=target, timeout=300) as client:
            upstream = await client.request(
                request.method, f"/{path}", content=await request.body(), headers={"content-type": "application/json"}
            )
        answer = upstream.json()
        if path == "tokenize" and upstream.status_code == 200:
            answer["tokens"] = [*answer["tokens"], answer["tokens"][-1]]
        return Response(json.dumps(answer), status_code=upstream.status_code, media_type="application/json")

    return app


def test_a_call_over_a_new_connection_is_proven_after_its_answer(plain_vllm_server: VLLMServer) -> None:
    port = free_port("127.0.0.1")
    with splicing_adapter(f"http://127.0.0.1:{port}/v1", plain_vllm_server) as adapter_at:
        with serve_in_thread(recording_proxy_app(plain_vllm_server.base_url, RecordingProxy(url="")), port=port):
            (conversation,) = play(adapter_at, range(76, 77), turns=2)
        next_turn = {
            "model": "policy",
            "messages": [*conversation.messages, {"role": "user", "content": "And now?"}],
            "tools": [MOVE_TOOL],
            "max_tokens": 4,
        }
        # Restarted in place: the next spliced call relies on the old proof and goes out over a new connection, so
        # its answer waits for the scope to be proven on the server that gave it.
        again = RecordingProxy(url="")
        with serve_in_thread(recording_proxy_app(plain_vllm_server.base_url, again), port=port):
            answer = httpx.post(f"{adapter_at}/v1/chat/completions", json=next_turn, timeout=300)
        assert answer.status_code == 200, answer.text
        # It went out on the old proof (its telemetry says so); the probe after the answer let it through.
        assert answer.json()["choices"][0]["message"]["prefix_splice"]["proof"]["this_request"] is False
        assert [(path, body["messages"] == list(PROBE_MESSAGES)) for path, body, _ in again.exchanges] == [
            ("/v1/chat/completions", False),
            ("/tokenize", True),
        ]
        # Restarted with another template: the same call is answered by vLLM, then refused by the adapter.
        with serve_in_thread(different_template_app(plain_vllm_server.base_url), port=port):
            refused = httpx.post(f"{adapter_at}/v1/chat/completions", json=next_turn, timeout=300)
        assert refused.status_code == 502, refused.text
        assert refused.json()["error"]["type"] == "adapter_template_mismatch"


def test_without_return_token_ids_the_prompt_ids_are_still_the_spliced_ones(plain_vllm_server: VLLMServer) -> None:
    """use_return_token_ids: false takes prompt ids from /tokenize, which re-renders the history; on a spliced call
    the adapter answers the ids it sent instead (what generation used), so the conversation stays contiguous."""
    recorded = RecordingProxy(url="")
    with serve_in_thread(recording_proxy_app(plain_vllm_server.base_url, recorded)) as proxy_url:
        with splicing_adapter(f"{proxy_url}/v1", plain_vllm_server, use_return_token_ids=False) as adapter_at:
            conversations = play(adapter_at, range(77, 79), turns=4)
    assert all(c.contiguous() for c in conversations)
    for conversation in conversations:
        own = [
            body
            for body in recorded.bodies("/v1/chat/completions")
            if body["messages"][0]["content"] == conversation.messages[0]["content"]
        ]
        assert "kv_transfer_params" not in own[0]  # the first turn has nothing to splice
        assert conversation.prompts[1:] == [body["kv_transfer_params"]["prompt_token_ids"] for body in own[1:]]
