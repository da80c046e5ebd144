"""The weight version on the adapter's bundles: the hook's own kept, else vLLM's GET /weight_info read before and
after the call (equal: that version; different: None; no route: None, not asked again). Fake upstreams for the
paths a real server cannot be made to take on cue; the stock and the hooked vLLM for the rest."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from openai import OpenAI

from nemo_gym_tok.servers.inprocess import serve_in_thread
from nemo_gym_tok.vllm_server import VLLMServer
from responses_api_models.vllm_model.tests.conftest import adapter
from responses_api_models.vllm_model.weight_versions import WeightVersionReads
from tests.weights_support import set_weight_version, weight_version

PROMPT = [11, 12, 13]
GENERATED = [21, 22]
USER = {"role": "user", "content": "Name three rivers."}


@dataclass
class VersionedUpstream:
    """A vLLM stand-in answering with return_token_ids (what a stock vLLM gives) and a /weight_info whose answers are
    `versions`, one per read (the last repeated); None in it answers 404 (a server without dev mode)."""

    versions: list[str | None]
    hook_bundle: dict[str, Any] | None = None
    """Put on the message as the hooked server does (the bundle, with its weight version)."""
    reads: int = 0
    events: list[str] = field(default_factory=list)

    def app(self) -> FastAPI:
        app = FastAPI()

        @app.get("/weight_info")
        async def weight_info() -> JSONResponse:
            version = self.versions[min(self.reads, len(self.versions) - 1)]
            self.reads += 1
            self.events.append("weight_info")
            if version is None:
                return JSONResponse({"detail": "Not Found"}, status_code=404)
            return JSONResponse({"weight_version": version})

        @app.post("/v1/chat/completions")
        async def chat(request: Request) -> Response:
            body = await request.json()
            self.events.append("chat")
            message: dict[str, Any] = {"role": "assistant", "content": "Nile"}
            if self.hook_bundle is not None:
                message.update(self.hook_bundle)
            logprobs = {"content": [{"token": f"token_id:{i}", "logprob": -0.5, "top_logprobs": []} for i in GENERATED]}
            head = {"id": "x", "created": 0, "model": body["model"]}
            usage = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
            choice = {"index": 0, "finish_reason": "stop", "token_ids": GENERATED, "logprobs": logprobs}
            if not body.get("stream"):
                answer = {**head, "object": "chat.completion", "prompt_token_ids": PROMPT, "usage": usage}
                return JSONResponse({**answer, "choices": [{**choice, "message": message}]})
            chunk = {**head, "object": "chat.completion.chunk"}
            events = [
                {**chunk, "prompt_token_ids": PROMPT, "choices": [{"index": 0, "delta": {"role": "assistant"}}]},
                {**chunk, "choices": [{**choice, "delta": {"content": "Nile"}}]},
                {**chunk, "choices": [], "usage": usage},
            ]
            text = "".join(f"data: {json.dumps(event)}\n\n" for event in events) + "data: [DONE]\n\n"
            return Response(text, media_type="text/event-stream")

        return app


def served(upstream: VersionedUpstream, **fields: Any) -> Iterator[str]:
    with serve_in_thread(upstream.app()) as vllm_url:
        yield from adapter(vllm_url, "m", return_token_id_information=True, splice="hook", **fields)


def call(url: str) -> dict[str, Any]:
    answer = httpx.post(f"{url}/v1/chat/completions", json={"model": "m", "messages": [USER]}, timeout=60)
    assert answer.status_code == 200, answer.text
    return answer.json()["choices"][0]["message"]


def test_the_same_version_before_and_after_is_the_bundles() -> None:
    upstream = VersionedUpstream(["step-3"])
    for url in served(upstream):
        message = call(url)
    assert message["token_source"] == "return_token_ids"
    assert message["weight_version"] == "step-3" and "weight_version_spans" not in message
    assert upstream.events == ["weight_info", "chat", "weight_info"]  # read before sending, and once the answer is in


def test_a_version_that_changed_during_the_call_is_unknown() -> None:
    upstream = VersionedUpstream(["step-3", "step-4"])
    for url in served(upstream):
        message = call(url)
        assert message["weight_version"] is None  # never a guess: not step-3, not step-4
        assert call(url)["weight_version"] == "step-4"  # the next call, wholly under step-4


@pytest.mark.parametrize("body", [b'{"weight_version": null}', b'{"weight_version": 7}', b"{}", b"[]"])
def test_a_label_that_is_not_a_string_reads_as_unknown(body: bytes) -> None:
    """A null label stays None (no bundle says "None"); a number or a missing one is no label either."""

    async def get(url: str, path: str) -> tuple[int, bytes]:
        return 200, body

    assert asyncio.run(WeightVersionReads(get).read("http://vllm")) is None


def test_a_server_without_the_route_is_asked_once() -> None:
    upstream = VersionedUpstream([None])
    for url in served(upstream):
        versions = [call(url).get("weight_version") for _ in range(3)]
    assert versions == [None, None, None]
    assert upstream.reads == 1  # the 404 is remembered for that URL


def test_the_hooks_version_is_kept_and_then_not_read_around() -> None:
    hook = {"prompt_token_ids": PROMPT, "generation_token_ids": GENERATED, "generation_log_probs": [-0.5, -0.5]}
    spans = [{"version": "a", "start": 0, "end": 1}, {"version": "b", "start": 1, "end": 2}]
    upstream = VersionedUpstream(["b"], hook_bundle={**hook, "weight_version": "a", "weight_version_spans": spans})
    for url in served(upstream):
        first = call(url)
        reads = upstream.reads
        second = call(url)
    for message in (first, second):
        assert message["token_source"] == "message"
        assert message["weight_version"] == "a" and message["weight_version_spans"] == spans
    assert 1 <= reads <= 2  # the first call's read before; the one after is dropped once the hook's version is in
    assert upstream.reads == reads  # none around the second: the first answer showed the hook reports versions


def test_a_hooked_answer_without_a_version_is_settled_by_the_reads() -> None:
    """A hooked vLLM before 0.32 puts the bundle on the message and no version."""
    hook = {"prompt_token_ids": PROMPT, "generation_token_ids": GENERATED, "generation_log_probs": [-0.5, -0.5]}
    upstream = VersionedUpstream(["step-9"], hook_bundle=hook)
    for url in served(upstream):
        message = call(url)
    assert message["token_source"] == "message" and message["weight_version"] == "step-9"


def test_a_malformed_hook_version_is_refused() -> None:
    hook = {"prompt_token_ids": PROMPT, "generation_token_ids": GENERATED, "generation_log_probs": [-0.5, -0.5]}
    bad = {**hook, "weight_version": "a", "weight_version_spans": [{"version": "a", "start": 0, "end": 1}]}
    for url in served(VersionedUpstream(["a"], hook_bundle=bad)):
        answer = httpx.post(f"{url}/v1/chat/completions", json={"model": "m", "messages": [USER]}, timeout=60)
    assert answer.status_code == 502 and "weight version" in answer.json()["error"]["message"]


def test_without_token_information_nothing_is_read() -> None:
    upstream = VersionedUpstream(["x"])
    with serve_in_thread(upstream.app()) as vllm_url:
        for url in adapter(vllm_url, "m"):
            message = call(url)
    assert upstream.reads == 0 and "weight_version" not in message


def test_a_streamed_call_gets_the_version_on_its_final_chunk() -> None:
    upstream = VersionedUpstream(["step-5"])
    body = {"model": "m", "messages": [USER], "stream": True}
    for url in served(upstream):
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=60) as answer:
            chunks = [json.loads(line[6:]) for line in answer.iter_lines() if line.startswith("data: {")]
        response = sdk(url).responses.create(model="m", input=[USER], stream=False)
    deltas = [choice["delta"] for chunk in chunks for choice in chunk.get("choices") or []]
    assert any(delta.get("weight_version") == "step-5" and "generation_token_ids" in delta for delta in deltas)
    assert response.output[-1].model_dump()["weight_version"] == "step-5"  # on the Responses item with the bundle


# --- real vLLM ------------------------------------------------------------------------------------------------------


def sdk(url: str) -> OpenAI:
    return OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def adapter_splicing_on_stock(plain_vllm_server: VLLMServer) -> Iterator[str]:
    yield from adapter(
        plain_vllm_server.base_url,
        plain_vllm_server.served_model_name,
        return_token_id_information=True,
        splice="adapter",
    )


def test_the_adapter_reads_the_stock_servers_version(
    adapter_splicing_on_stock: str, plain_vllm_server: VLLMServer
) -> None:
    original = weight_version(plain_vllm_server.base_url)
    client = sdk(adapter_splicing_on_stock)
    try:
        first = client.responses.create(model="m", input=[USER], max_output_tokens=4, extra_body={"seed": 1})
        item = first.output[-1].model_dump()
        assert item["token_source"] == "return_token_ids" and item["weight_version"] == original
        set_weight_version(plain_vllm_server.base_url, "wv-adapter-test")
        history = [USER, *(entry.model_dump(exclude_none=True) for entry in first.output)]
        history.append({"role": "user", "content": "And three more."})
        second = client.responses.create(model="m", input=history, max_output_tokens=4, extra_body={"seed": 2})
        last = second.output[-1].model_dump()
        assert last["weight_version"] == "wv-adapter-test"
        assert last["prefix_splice"]["spliced_by"] == "adapter"
        streamed = client.chat.completions.create(
            model="m", messages=[USER], max_tokens=4, seed=3, stream=True, stream_options={"include_usage": True}
        )
        final = [chunk.model_dump() for chunk in streamed][-1]
        assert final["choices"][0]["delta"]["weight_version"] == "wv-adapter-test"
    finally:
        set_weight_version(plain_vllm_server.base_url, original)


def test_the_hooked_servers_version_comes_with_its_bundle(vllm_server: VLLMServer) -> None:
    original = weight_version(vllm_server.base_url)
    for url in adapter(vllm_server.base_url, vllm_server.served_model_name, return_token_id_information=True):
        message = sdk(url).chat.completions.create(model="m", messages=[USER], max_tokens=4, seed=4).choices[0].message
        assert message.token_source == "message"
        assert message.weight_version == original
