"""`stream: true` through the adapter, driven by the OpenAI SDK: the same text and ids as without streaming (hook and
adapter-side splice), the final chunk with bundle and telemetry, refusals as JSON before the first byte, Responses
events the SDK parses, and upstream failures (stand-in vLLMs)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from fastapi.responses import StreamingResponse
from openai import APIError, BadRequestError, OpenAI

from nemo_gym_tok.servers.inprocess import serve_in_thread
from nemo_gym_tok.testing.tiny_model import IM_END_ID
from nemo_gym_tok.vllm_server import VLLMServer
from responses_api_models.vllm_model.chat_assembly import ChatAssembly
from responses_api_models.vllm_model.chat_events import final_chunk
from responses_api_models.vllm_model.tests.conftest import adapter
from responses_api_models.vllm_model.tests.fake_upstream import FakeUpstream
from tests.conversations import MOVE_TOOL
from tests.sdk_streams import contiguous, converse

USER = {"role": "user", "content": "Name three rivers."}
FINAL_DELTA = {
    "prompt_token_ids",
    "generation_token_ids",
    "generation_log_probs",
    "token_source",
    "prefix_splice",
    "constrained_by",
    "generation_forced_mask",
    "weight_version",  # both servers run with VLLM_SERVER_DEV_MODE=1: the hook says it, or the adapter reads it
}


@pytest.fixture(scope="module")
def hook_adapter(vllm_server: VLLMServer) -> Iterator[str]:
    yield from adapter(
        vllm_server.base_url, vllm_server.served_model_name, return_token_id_information=True, splice="hook"
    )


@pytest.fixture(scope="module")
def splicing_adapter(plain_vllm_server: VLLMServer) -> Iterator[str]:
    yield from adapter(
        plain_vllm_server.base_url,
        plain_vllm_server.served_model_name,
        return_token_id_information=True,
        splice="adapter",
    )


def sdk(url: str) -> OpenAI:
    return OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.mark.parametrize("mode", ["hook", "adapter"])
def test_streamed_conversation_equals_unstreamed(mode: str, request: pytest.FixtureRequest) -> None:
    url = request.getfixturevalue("hook_adapter" if mode == "hook" else "splicing_adapter")
    streamed = converse(sdk(url), 5, stream=True)
    unstreamed = converse(sdk(url), 5, stream=False)
    assert [t.comparable() for t in streamed] == [t.comparable() for t in unstreamed]
    assert contiguous(streamed)
    assert [t.finish_reason for t in streamed] == ["stop", "tool_calls", "stop", "length"]
    for turn, plain in zip(streamed, unstreamed):
        assert turn.bundle["generation_log_probs"] == pytest.approx(plain.bundle["generation_log_probs"], abs=1e-4)
        assert turn.bundle["token_source"] == plain.bundle["token_source"]
        usage, final = turn.chunks[-2:]  # the caller asked include_usage: vLLM's usage chunk, then the final chunk
        assert usage["choices"] == []
        assert usage["usage"]["completion_tokens"] == len(turn.bundle["generation_token_ids"])
        assert set(final["choices"][0]["delta"]) == (FINAL_DELTA if turn.telemetry else FINAL_DELTA - {"prefix_splice"})
        for chunk in turn.chunks[:-1]:  # nothing the caller did not ask for
            assert "prompt_token_ids" not in chunk
            assert all("token_ids" not in choice and "logprobs" not in choice for choice in chunk["choices"])
    later = [turn.telemetry for turn in streamed[1:]]
    assert all(t["applied"] and t["spliced_by"] == mode for t in later)
    assert [turn.first_chunk_telemetry for turn in streamed] == [turn.telemetry for turn in streamed]
    print(
        f"\nadapter ({mode} splice): streamed = unstreamed over {len(streamed)} turns, contiguous; "
        f"{sum(t['template_differed'] for t in later)}/{len(later)} later turns repaired"
    )


def test_final_chunk_without_token_information_is_telemetry_only_and_asked_for(vllm_server: VLLMServer) -> None:
    prefix = httpx.post(
        f"{vllm_server.base_url}/tokenize",
        json={
            "model": vllm_server.served_model_name,
            "messages": [USER],
            "add_generation_prompt": True,
        },
    ).json()["tokens"][:5]
    for url in adapter(vllm_server.base_url, vllm_server.served_model_name, splice="hook"):
        kwargs: dict[str, Any] = dict(
            model="m", messages=[USER], max_tokens=3, stream=True, extra_body={"required_prefix_token_ids": prefix}
        )
        quiet = [c.model_dump(exclude_none=True) for c in sdk(url).chat.completions.create(**kwargs)]
        asked = [
            c.model_dump(exclude_none=True)
            for c in sdk(url).chat.completions.create(stream_options={"include_usage": True}, **kwargs)
        ]
    expected = {"applied": False, "template_differed": False, "replaced_tokens": 0, "spliced_by": "hook"}
    assert quiet[0]["prefix_splice"] == asked[0]["prefix_splice"] == expected  # on the first chunk either way
    assert "usage" not in quiet[-1] and "prefix_splice" not in quiet[-1]
    assert asked[-1] == {key: asked[0][key] for key in ("id", "created", "model", "object")} | {
        "choices": [],
        "prefix_splice": expected,
    }


def refused(url: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """A streamed request's answer, which must be JSON (no event stream started)."""
    with httpx.stream("POST", f"{url}/v1/chat/completions", json={**body, "stream": True}, timeout=300) as answer:
        raw = answer.read()
    assert answer.headers["content-type"].startswith("application/json"), raw[:300]
    return answer.status_code, json.loads(raw)["error"]


@pytest.mark.parametrize("mode", ["hook", "adapter"])
def test_a_prefix_that_does_not_belong_is_a_400_before_any_byte(mode: str, request: pytest.FixtureRequest) -> None:
    url = request.getfixturevalue("hook_adapter" if mode == "hook" else "splicing_adapter")
    first = sdk(url).chat.completions.create(model="m", messages=[USER], max_tokens=4, seed=1)
    assistant = first.choices[0].message.model_dump(exclude_none=True)
    edited = [{"role": "user", "content": "Name two rivers."}, assistant, {"role": "user", "content": "More."}]
    status, error = refused(url, {"messages": edited, "max_tokens": 4})
    assert status == 400 and "messages[0]" in error["message"]
    with pytest.raises(BadRequestError):
        sdk(url).chat.completions.create(model="m", messages=edited, max_tokens=4, stream=True)


def test_a_server_that_does_not_splice_is_a_502_before_any_byte(plain_vllm_server: VLLMServer) -> None:
    drifted = 0
    for url in adapter(
        plain_vllm_server.base_url, plain_vllm_server.served_model_name, return_token_id_information=True, splice="hook"
    ):
        for seed in range(4):
            first = sdk(url).chat.completions.create(model="m", messages=[USER], max_tokens=12, seed=seed)
            history = [USER, first.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "?"}]
            with httpx.stream(
                "POST",
                f"{url}/v1/chat/completions",
                timeout=300,
                json={"messages": history, "max_tokens": 2, "stream": True},
            ) as answer:
                raw = answer.read()
            if answer.status_code == 502:
                assert answer.headers["content-type"].startswith("application/json")
                assert json.loads(raw)["error"]["type"] == "prefix_not_spliced"
                drifted += 1
            else:  # a history that re-tokenizes identically streams normally
                assert answer.status_code == 200 and raw.endswith(b"data: [DONE]\n\n")
    assert drifted >= 2, f"only {drifted}/4 drifting histories were refused"


def response_events(client: OpenAI, **kwargs: Any) -> list[dict[str, Any]]:
    return [event.model_dump(exclude_none=True) for event in client.responses.create(stream=True, **kwargs)]


def test_responses_stream_parses_with_the_sdk_and_ends_with_the_bundle(hook_adapter: str) -> None:
    client = sdk(hook_adapter)
    kwargs: dict[str, Any] = dict(model="m", input=[USER], max_output_tokens=6, extra_body={"seed": 7})
    events = response_events(client, **kwargs)
    plain = client.responses.create(**kwargs).model_dump(exclude_none=True)
    assert [e["type"] for e in events[:4]] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert [e["type"] for e in events[-4:]] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    last = events[-1]
    assert last["type"] == "response.incomplete" and last["response"]["status"] == plain["status"] == "incomplete"
    final, reference = last["response"]["output"][-1], plain["output"][-1]
    for key in ("prompt_token_ids", "generation_token_ids", "token_source"):
        assert final[key] == reference[key], key
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert text == final["content"][0]["text"] == reference["content"][0]["text"]
    assert last["response"]["id"] == events[0]["response"]["id"]
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert done[-1] == final  # the bundle rides the last item's done event and the final response alike


def test_responses_stream_with_a_tool_call_and_the_sdk_stream_helper(hook_adapter: str) -> None:
    client = sdk(hook_adapter)
    tool = {"type": "function", **MOVE_TOOL["function"]}
    kwargs: dict[str, Any] = dict(
        model="m",
        input=[USER],
        tools=[tool],
        tool_choice="required",
        max_output_tokens=60,
        parallel_tool_calls=False,
        extra_body={"seed": 8},
    )
    events = response_events(client, **kwargs)
    plain = client.responses.create(**kwargs).model_dump(exclude_none=True)
    call, reference = events[-1]["response"]["output"][-1], plain["output"][-1]
    assert events[-1]["type"] == "response.completed" and call["type"] == reference["type"] == "function_call"
    assert (call["name"], json.loads(call["arguments"])) == (reference["name"], json.loads(reference["arguments"]))
    assert call["generation_token_ids"] == reference["generation_token_ids"]
    pieces = "".join(e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta")
    assert pieces == call["arguments"]
    # The SDK's own accumulating helper checks item identities and order, and wants response.completed.
    stop = {"seed": 9, "min_tokens": 2, "logit_bias": {str(IM_END_ID): 100}}
    with client.responses.stream(model="m", input=[USER], max_output_tokens=20, extra_body=stop) as stream:
        response = stream.get_final_response()
    assert response.status == "completed"
    assert response.output[-1].model_dump()["generation_token_ids"][-1] == IM_END_ID


def test_context_overflow_streams_as_a_length_finish(hook_adapter: str) -> None:
    huge = {"role": "user", "content": "river " * 6000}
    chunks = [
        c.model_dump(exclude_none=True)
        for c in sdk(hook_adapter).chat.completions.create(model="m", messages=[huge], max_tokens=4, stream=True)
    ]
    last = chunks[-1]["choices"][0]
    assert last["finish_reason"] == "length" and "maximum context length" in last["delta"]["context_overflow"]
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == ""
    events = response_events(sdk(hook_adapter), model="m", input=[huge], max_output_tokens=4)
    assert events[-1]["type"] == "response.incomplete"
    assert events[-1]["response"]["output"][-1]["context_overflow"] == last["delta"]["context_overflow"]


def test_streamed_tool_call_pieces_assemble_into_the_unstreamed_message() -> None:
    assembly = ChatAssembly()
    head = {"id": "c", "created": 1, "model": "m", "object": "chat.completion.chunk"}
    call = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "move", "arguments": '{"dir'}}
    for chunk in [
        {**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}], "prompt_token_ids": [1, 2]},
        {
            **head,
            "choices": [
                {
                    "index": 0,
                    "delta": {"tool_calls": [call]},
                    "token_ids": [5],
                    "logprobs": {"content": [{"token": "token_id:5", "logprob": -1.0}]},
                }
            ],
        },
        {
            **head,
            "choices": [
                {
                    "index": 0,
                    "delta": {"tool_calls": [{"index": 0, "function": {"arguments": '": 1}'}}]},
                    "token_ids": [6],
                    "finish_reason": "tool_calls",
                }
            ],
        },
        {**head, "choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 2, "total_tokens": 4}},
    ]:
        assembly.add(chunk)
    result = assembly.result()
    choice = result["choices"][0]
    assert choice["message"]["tool_calls"] == [
        {"id": "call_1", "type": "function", "function": {"name": "move", "arguments": '{"dir": 1}'}}
    ]
    assert choice["token_ids"] == [5, 6] and choice["finish_reason"] == "tool_calls"
    assert result["prompt_token_ids"] == [1, 2] and result["usage"]["total_tokens"] == 4
    assert final_chunk(result, with_bundle=True) is None  # no bundle resolved, no telemetry: nothing to add


def streaming_upstream(chunks: list[dict[str, Any]]) -> FastAPI:
    """A stand-in vLLM that streams `chunks` (an error chunk among them, say) and then [DONE]."""
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat() -> StreamingResponse:
        async def events() -> Any:
            for chunk in chunks:
                yield f"data: {json.dumps(chunk)}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


def test_upstream_errors_before_and_after_the_first_byte() -> None:
    head = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m"}
    role = {**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
    text = {**head, "choices": [{"index": 0, "delta": {"content": "Nile"}}]}
    boom = {"error": {"message": "engine died", "type": "InternalServerError", "code": 500}}
    with (
        serve_in_thread(streaming_upstream([role, text, boom])) as late,
        serve_in_thread(streaming_upstream([boom])) as early,
    ):
        for url in adapter(late, "m"):
            stream = sdk(url).chat.completions.create(model="m", messages=[USER], stream=True)
            with pytest.raises(APIError, match="engine died"):
                list(stream)
        for url in adapter(early, "m"):
            status, error = refused(url, {"messages": [USER]})
            assert status == 502 and "engine died" in error["message"]


def test_refusals_of_the_adapter_and_of_vllm_come_as_json() -> None:
    fake, teapot = FakeUpstream("fake"), FakeUpstream("teapot", status=422)
    with serve_in_thread(fake.app()) as fake_url, serve_in_thread(teapot.app()) as teapot_url:
        for url in adapter(fake_url, "m", return_token_id_information=True):
            assert refused(url, {"messages": [USER], "n": 2})[0] == 400
            assert refused(url, {"messages": [USER], "required_prefix_token_ids": [-1]})[0] == 400
        for url in adapter(teapot_url, "m"):
            assert refused(url, {"messages": [USER]}) == (
                422,
                {"message": "teapot is broken", "type": "upstream_invalid_request", "param": None, "code": 422},
            )
    assert fake.requests == []  # nothing reached vLLM
