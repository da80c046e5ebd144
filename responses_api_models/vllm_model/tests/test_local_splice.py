"""The adapter-side splice's parts that need no vLLM server: what it strips, how it shapes tools, what it refuses."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import pytest

from nemo_gym_tok.servers.api_errors import ApiError
from nemo_gym_tok.splice import InvalidTokenIdsError
from nemo_gym_tok.splice_host import read_splice_request
from responses_api_models.vllm_model.local_splice import (
    HARMONY_REFUSAL,
    IMAGES_REFUSAL,
    AdapterSplicer,
    TurnMeasurement,
    strip_token_fields,
    vllm_tool_dicts,
)
from tests.conversations import MOVE_TOOL

BUNDLE = {"prompt_token_ids": [1, 2], "generation_token_ids": [3], "generation_log_probs": [-0.5]}


def test_strip_token_fields_leaves_everything_else() -> None:
    body = {
        "model": "m",
        "required_prefix_token_ids": [1],
        "start_token_segment": False,
        "seed": 3,
        "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo", **BUNDLE}],
    }
    assert strip_token_fields(body) == {
        "model": "m",
        "seed": 3,
        "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}],
    }
    assert body["messages"][1]["prompt_token_ids"] == [1, 2]  # the caller's body is not modified
    assert strip_token_fields(body)["messages"][0] is body["messages"][0]  # a message without a bundle is not copied


@pytest.mark.parametrize(
    "tool",
    [
        MOVE_TOOL,
        {"type": "function", "function": {"name": "f"}},
        {
            "type": "function",
            "function": {"name": "f", "description": "d", "strict": True, "parameters": {"type": "object"}},
        },
        {"type": "function", "function": {"name": "f", "strict": None, "defer_loading": None}},
    ],
)
def test_tools_are_shaped_as_vllm_hands_them_to_the_template(tool: dict[str, Any]) -> None:
    # The installed vLLM's own request model is the reference: a vLLM upgrade that dumps tools otherwise fails here.
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionToolsParam

    assert vllm_tool_dicts([tool]) == [ChatCompletionToolsParam.model_validate(tool).model_dump()]


def fake_server(root: str) -> tuple[Any, Any]:
    async def post(path: str, body: dict[str, Any]) -> httpx.Response:
        raise AssertionError(f"no POST expected, got {path}")

    async def get(path: str) -> httpx.Response:
        assert path == "/v1/models"
        return httpx.Response(200, json={"data": [{"id": "m", "root": root}]})

    return post, get


def prepare(splicer: AdapterSplicer, body: dict[str, Any], root: str) -> Any:
    post, get = fake_server(root)
    return asyncio.run(splicer.prepare(body, post=post, get=get, tokenize_body=strip_token_fields(body)))


HISTORY = [
    {"role": "user", "content": "hi"},
    {"role": "assistant", "content": "yo", **BUNDLE},
    {"role": "user", "content": "?"},
]


def test_harmony_models_are_refused_in_the_adapter(tiny_model_dir: Path) -> None:
    with pytest.raises(ApiError) as refused:
        prepare(AdapterSplicer(tokenizer=None, harmony=True), {"messages": HISTORY}, str(tiny_model_dir))
    assert refused.value.status == 400 and refused.value.message == HARMONY_REFUSAL


def test_a_history_with_images_is_refused_before_any_vllm_call(tiny_model_dir: Path) -> None:
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    with_image = [{"role": "user", "content": [{"type": "text", "text": "hi"}, image]}, *HISTORY[1:]]
    with pytest.raises(ApiError) as refused:
        prepare(AdapterSplicer(tokenizer=str(tiny_model_dir)), {"messages": with_image}, "unused")
    assert refused.value.status == 400 and refused.value.message == IMAGES_REFUSAL


def test_malformed_bundles_are_400s_before_any_vllm_call(tiny_model_dir: Path) -> None:
    broken = [HISTORY[0], {**HISTORY[1], "generation_token_ids": [10**9]}, HISTORY[2]]
    with pytest.raises(ApiError) as refused:
        prepare(AdapterSplicer(tokenizer=str(tiny_model_dir)), {"messages": broken}, "unused")
    assert refused.value.status == 400 and "messages[1].generation_token_ids" in refused.value.message


def test_a_new_segment_is_sent_without_splicing(tiny_model_dir: Path) -> None:
    call = prepare(
        AdapterSplicer(tokenizer=str(tiny_model_dir)), {"messages": HISTORY, "start_token_segment": True}, ""
    )
    assert call.telemetry["new_segment"] is True
    assert "kv_transfer_params" not in call.body and "start_token_segment" not in call.body


def test_an_unloadable_tokenizer_is_a_clear_502(tmp_path: Path) -> None:
    with pytest.raises(ApiError) as failed:
        prepare(AdapterSplicer(tokenizer=None), {"messages": HISTORY}, str(tmp_path / "missing"))
    assert failed.value.status == 502 and failed.value.error_type == "adapter_tokenizer_unavailable"
    assert "vllm_model.tokenizer" in failed.value.message


def test_a_prefix_read_at_validation_is_checked_against_the_vocabulary_before_the_proof(tiny_model_dir: Path) -> None:
    """The adapter reads a call's prefix before it knows the vocabulary (ChatCall) and checks it in prepare, only past
    the prompt its digest proves on a next turn: a scope not proven yet checks every id before asking the server."""
    broken = [HISTORY[0], {**HISTORY[1], "generation_token_ids": [10**8]}, HISTORY[2]]
    asked = read_splice_request(broken, None, None, None, types_checked=True)
    post, get = fake_server("unused")
    splicer = AdapterSplicer(tokenizer=str(tiny_model_dir))
    body = {"messages": broken}
    with pytest.raises(ApiError) as refused:
        asyncio.run(splicer.prepare(body, post=post, get=get, tokenize_body=strip_token_fields(body), asked=asked))
    assert refused.value.status == 400
    assert "messages[1].generation_token_ids[0] = 100000000 is out of vocabulary" in refused.value.message


def test_the_turn_measurement_waits_for_its_start_and_runs_once() -> None:
    runs: list[str] = []

    def measure() -> dict[str, Any]:
        runs.append("measured")
        return {"template_differed": True, "replaced_tokens": 2}

    async def call() -> dict[str, Any]:
        telemetry = {"applied": True}
        measurement = TurnMeasurement(measure, telemetry)
        await asyncio.sleep(0)
        assert runs == []  # nothing runs before the request is sent
        measurement.start()
        measurement.start()
        runs.append("sent")
        await asyncio.sleep(0)
        await measurement.ready()
        return telemetry

    assert asyncio.run(call()) == {"template_differed": True, "replaced_tokens": 2, "applied": True}
    assert runs == ["sent", "measured"]


def test_a_turn_measurement_never_started_runs_when_its_telemetry_is_read() -> None:
    def measure() -> dict[str, Any]:
        raise InvalidTokenIdsError("the turn is not the model's")

    async def call() -> None:
        await TurnMeasurement(measure, {}).ready()

    with pytest.raises(ApiError) as refused:
        asyncio.run(call())
    assert refused.value.status == 400 and refused.value.message == "the turn is not the model's"
