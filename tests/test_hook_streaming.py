"""Streamed chat completions through the hook: the splice applied, telemetry on the first chunk, the bundle in a final
chunk when usage is asked, refusals as JSON before the first byte; unit-tested on stand-ins, then on the real vLLM."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from openai import BadRequestError, OpenAI

from nemo_gym_tok.vllm import chat_responses, hook
from nemo_gym_tok.vllm import telemetry as vllm_telemetry
from nemo_gym_tok.vllm_server import VLLMServer
from tests.sdk_streams import converse

TELEMETRY = {"applied": True, "template_differed": True, "replaced_tokens": 2}


def output(prompt: list[int] | None, ids: list[int], logprobs: list[float] | None, finish: str | None = None) -> Any:
    """A vLLM RequestOutput of a streamed request (a delta: only the ids since the previous one)."""
    steps = None if logprobs is None else [{token: SimpleNamespace(logprob=lp)} for token, lp in zip(ids, logprobs)]
    completion = SimpleNamespace(index=0, token_ids=ids, logprobs=steps, finish_reason=finish)
    return SimpleNamespace(prompt_token_ids=prompt, outputs=[completion])


async def fake_vllm_stream(serving: Any, request: Any, outputs: AsyncIterator[Any], *args: Any) -> AsyncIterator[str]:
    """What vLLM's chat_completion_stream_generator yields: a role chunk, a chunk per output, usage, [DONE]."""
    head = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 7, "model": "m"}
    role = {"index": 0, "delta": {"role": "assistant", "content": ""}}
    yield "data: " + json.dumps({**head, "choices": [role]}) + "\n\n"
    async for out in outputs:
        if out.outputs[0].finish_reason == "error":  # vLLM reports a failed request as an error chunk
            yield 'data: {"error": {"message": "boom", "code": 500}}\n\n'
            yield "data: [DONE]\n\n"
            return
        yield "data: " + json.dumps({**head, "choices": [{"index": 0, "delta": {"content": "x"}}]}) + "\n\n"
    if request.stream_options and request.stream_options.include_usage:
        yield "data: " + json.dumps({**head, "choices": [], "usage": {"prompt_tokens": 3}}) + "\n\n"
    yield "data: [DONE]\n\n"


class Request(SimpleNamespace):
    """A chat request stand-in the hook can remember telemetry for (it keys on the object, weakly)."""


def run(outputs: list[Any], *, include_usage: bool, logprobs: bool = True, telemetry: dict | None = None) -> list[str]:
    request = Request(logprobs=logprobs, stream_options=SimpleNamespace(include_usage=include_usage))
    if telemetry is not None:
        vllm_telemetry.remember(request, dict(telemetry))

    async def engine() -> AsyncIterator[Any]:
        for out in outputs:
            yield out

    async def collect() -> list[str]:
        wrapper = chat_responses.stream_generator_with_bundle(fake_vllm_stream)
        return [chunk async for chunk in wrapper(SimpleNamespace(), request, engine(), "id", "m")]

    return asyncio.run(collect())


def data(chunk: str) -> Any:
    return json.loads(chunk.removeprefix("data: "))


DELTAS = [output([1, 2, 3], [10], [-0.5]), output(None, [11, 12], [-1.0, -1.5]), output(None, [13], [-2.0], "length")]


def test_final_chunk_carries_the_streamed_bundle_and_telemetry() -> None:
    chunks = run(DELTAS, include_usage=True, telemetry=TELEMETRY)
    assert chunks[-1] == "data: [DONE]\n\n"
    assert "usage" in data(chunks[-3])  # vLLM's usage chunk, then the hook's final chunk
    final = data(chunks[-2])
    assert final["id"] == "chatcmpl-1" and final["object"] == "chat.completion.chunk" and final["model"] == "m"
    assert final["prefix_splice"] == TELEMETRY
    assert final["choices"] == [
        {
            "index": 0,
            "logprobs": None,
            "finish_reason": None,
            "delta": {
                "prompt_token_ids": [1, 2, 3],
                "generation_token_ids": [10, 11, 12, 13],
                "generation_log_probs": [-0.5, -1.0, -1.5, -2.0],
                "constrained_by": [],
                "generation_forced_mask": [0, 0, 0, 0],
            },
        }
    ]
    assert data(chunks[0])["prefix_splice"] == TELEMETRY  # known before the first token: on the first chunk too


def test_without_usage_asked_only_the_first_chunk_changes() -> None:
    chunks = run(DELTAS, include_usage=False, telemetry=TELEMETRY)
    assert data(chunks[0])["prefix_splice"] == TELEMETRY
    assert [data(chunk).get("prefix_splice") for chunk in chunks[1:-1]] == [None] * 3
    assert "generation_token_ids" not in "".join(chunks)


def test_a_request_with_nothing_to_report_gets_vllms_own_generator() -> None:
    request = SimpleNamespace(logprobs=False, stream_options=None)

    async def engine() -> AsyncIterator[Any]:
        yield output([1], [2], None)

    stream = chat_responses.stream_generator_with_bundle(fake_vllm_stream)(
        SimpleNamespace(), request, engine(), "id", "m"
    )
    assert stream.ag_code is fake_vllm_stream.__code__  # not wrapped: vLLM's generator itself
    asyncio.run(stream.aclose())


def test_bundle_without_a_prefix_and_no_final_chunk_after_an_error() -> None:
    plain = run(DELTAS, include_usage=True)
    assert "prefix_splice" not in data(plain[-2]) and data(plain[-2])["choices"][0]["delta"]["generation_token_ids"]
    failed = run([DELTAS[0], output(None, [], [], "error")], include_usage=True, telemetry=TELEMETRY)
    assert [chunk for chunk in failed if "generation_token_ids" in chunk] == []
    assert failed[-2:] == ['data: {"error": {"message": "boom", "code": 500}}\n\n', "data: [DONE]\n\n"]


def test_the_stream_generator_is_wrapped_where_check_internals_looks() -> None:
    assert (
        "vllm.entrypoints.openai.chat_completion.serving",
        "OpenAIServingChat",
        "chat_completion_stream_generator",
    ) in hook.PATCHED_METHODS


def sdk(server: VLLMServer) -> OpenAI:
    return OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=300)


def test_streamed_conversation_gives_the_same_text_and_ids_as_unstreamed(vllm_server: VLLMServer) -> None:
    client = sdk(vllm_server)
    for seed in (3, 4):
        model = vllm_server.served_model_name
        streamed = converse(client, seed, stream=True, model=model, logprobs=True)
        unstreamed = converse(client, seed, stream=False, model=model, logprobs=True)
        assert [t.comparable() for t in streamed] == [t.comparable() for t in unstreamed], seed
        for s, u in zip(streamed, unstreamed):
            assert s.bundle["generation_log_probs"] == pytest.approx(u.bundle["generation_log_probs"], abs=1e-4)
            assert s.first_chunk_telemetry == s.telemetry
        assert streamed[0].telemetry is None and all(t.telemetry["applied"] for t in streamed[1:])
        assert streamed[1].tool_calls and streamed[1].finish_reason == "tool_calls"
        repaired = [bool(t.telemetry and t.telemetry["template_differed"]) for t in streamed]
        print(
            f"\nhook, seed {seed}: streamed = unstreamed over {len(streamed)} turns; finishes "
            f"{[t.finish_reason for t in streamed]}, repaired {repaired}"
        )


def test_a_refused_prefix_is_a_json_400_before_any_stream_byte(vllm_server: VLLMServer) -> None:
    messages = [{"role": "user", "content": "Hi."}]
    first = sdk(vllm_server).chat.completions.create(
        model=vllm_server.served_model_name, messages=messages, max_tokens=4, seed=1, logprobs=True
    )
    assistant = first.choices[0].message.model_dump(exclude_none=True)
    edited = [{"role": "user", "content": "Hello."}, assistant, {"role": "user", "content": "More."}]
    body = {
        "model": vllm_server.served_model_name,
        "messages": edited,
        "max_tokens": 4,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.stream("POST", f"{vllm_server.base_url}/v1/chat/completions", json=body, timeout=120) as answer:
        raw = answer.read()
    assert answer.status_code == 400 and answer.headers["content-type"].startswith("application/json"), raw
    error = json.loads(raw)["error"]
    assert error["param"] == "required_prefix_token_ids" and "messages[0]" in error["message"]
    with pytest.raises(BadRequestError):  # the SDK raises on create(), before iterating
        sdk(vllm_server).chat.completions.create(
            model=vllm_server.served_model_name, messages=edited, max_tokens=4, stream=True
        )
