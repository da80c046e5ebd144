"""Constrained turns: what constrained each call (`constrained_by`), its forced tokens, and their way to training."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from nemo_gym_tok.contract.constrained import constrained_by, forced_mask, valid_fields
from nemo_gym_tok.contract.conversion import chat_message_to_items
from nemo_gym_tok.records.rollout_record import full_output, packed_record
from nemo_gym_tok.records.training import rollout_to_training_sequence
from nemo_gym_tok.servers.inprocess import serve_in_thread
from nemo_gym_tok.types import ChatMessage
from nemo_gym_tok.vllm_server import VLLMServer
from responses_api_models.vllm_model.app import VLLMModel, VLLMModelConfig
from responses_api_models.vllm_model.token_capture import attach_bundles, drop_unrequested
from tests.conversations import MOVE_TOOL

STRICT_TOOL = {**MOVE_TOOL, "function": {**MOVE_TOOL["function"], "strict": True}}
SCHEMA = {"name": "answer", "schema": {"type": "object", "properties": {"a": {"type": "integer"}}}}


# --- derivation from the request ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("request_fields", "labels"),
    [
        ({}, []),
        ({"tools": [MOVE_TOOL]}, []),  # tool_choice defaults to auto: free
        ({"tools": [MOVE_TOOL], "tool_choice": "auto"}, []),
        ({"tools": [MOVE_TOOL], "tool_choice": "none"}, []),
        ({"tools": [MOVE_TOOL], "tool_choice": "required"}, ["tool_choice:required"]),
        (
            {"tools": [MOVE_TOOL], "tool_choice": {"type": "function", "function": {"name": "move"}}},
            ["tool_choice:named"],
        ),
        # A forced tool call replaces any other grammar (vLLM drops them): one label.
        (
            {"tools": [STRICT_TOOL], "tool_choice": "required", "response_format": {"type": "json_object"}},
            ["tool_choice:required"],
        ),
        ({"response_format": {"type": "text"}}, []),
        ({"response_format": {"type": "json_object"}}, ["response_format:json_object"]),
        ({"response_format": {"type": "json_schema", "json_schema": SCHEMA}}, ["response_format:json_schema"]),
        ({"structured_outputs": {"choice": ["yes", "no"]}}, ["structured_outputs"]),
        ({"structured_outputs": {"regex": "[0-9]+"}}, ["structured_outputs"]),
        ({"structured_outputs": {"disable_any_whitespace": True}}, []),  # an option, no grammar
        ({"tools": [STRICT_TOOL]}, ["strict_tools"]),
        ({"tools": [STRICT_TOOL], "tool_choice": "none"}, []),
        ({"tools": [{"type": "function", "name": "move", "strict": True}]}, ["strict_tools"]),  # Responses-style tool
        (
            {"tools": [STRICT_TOOL], "response_format": {"type": "json_object"}},
            ["response_format:json_object", "strict_tools"],
        ),
        # vLLM's tool parser put the strict tool's structural tag into structured_outputs: not a second label.
        ({"tools": [STRICT_TOOL], "structured_outputs": {"structural_tag": "{}"}}, ["strict_tools"]),
        ({"tools": [], "tool_choice": "required"}, []),  # no tools, nothing to force (vLLM refuses it anyway)
    ],
)
def test_constrained_by_each_request_kind(request_fields: dict[str, Any], labels: list[str]) -> None:
    assert constrained_by({"model": "m", "messages": [], **request_fields}) == labels


def test_constrained_by_reads_vllms_parsed_request_objects() -> None:
    # The hook sees vLLM's pydantic request after its tool parser ran: a named choice object, structured_outputs a
    # dataclass with the forced call's schema, response_format cleared.
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.sampling_params import StructuredOutputsParams

    named = ChatCompletionRequest.model_validate(
        {
            "model": "m",
            "messages": [{"role": "user", "content": "x"}],
            "tools": [MOVE_TOOL],
            "tool_choice": {"type": "function", "function": {"name": "move"}},
        }
    )
    named.structured_outputs = StructuredOutputsParams(json={"type": "object"})
    assert constrained_by(named) == ["tool_choice:named"]
    strict = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": [STRICT_TOOL]}
    )
    assert constrained_by(strict) == ["strict_tools"]
    schema = ChatCompletionRequest.model_validate(
        {
            "model": "m",
            "messages": [{"role": "user", "content": "x"}],
            "response_format": {"type": "json_schema", "json_schema": SCHEMA},
        }
    )
    assert constrained_by(schema) == ["response_format:json_schema"]
    regex = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "x"}], "structured_outputs": {"regex": "a+"}}
    )
    assert constrained_by(regex) == ["structured_outputs"]
    free = ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "x"}]})
    assert constrained_by(free) == []


def test_forced_mask_marks_exact_zeros_of_constrained_turns_only() -> None:
    log_probs = [0.0, -0.0, -1e-9, -3.2, 0.0]
    assert forced_mask(["tool_choice:required"], log_probs) == [1, 1, 0, 0, 1]
    assert forced_mask([], log_probs) == [0, 0, 0, 0, 0]  # a free turn's certain token is the model's own
    assert forced_mask(None, log_probs) == [0, 0, 0, 0, 0]
    assert forced_mask(["structured_outputs"], []) == []


def test_valid_fields_checks_shape() -> None:
    assert valid_fields([], [0, 0], 2) and valid_fields(["strict_tools"], [1], 1)
    assert not valid_fields(None, [0], 1) and not valid_fields([], [0], 2)
    assert not valid_fields([], [2], 1) and not valid_fields([], [True], 1) and not valid_fields([1], [0], 1)


# --- the adapter: the hook's fields when present, else derived -----------------------------------------------


def _vllm_answer(message_extra: dict[str, Any]) -> dict[str, Any]:
    return {
        "prompt_token_ids": [1, 2, 3],
        "choices": [
            {
                "index": 0,
                "token_ids": [7, 8, 9],
                "message": {
                    "role": "assistant",
                    "content": "",
                    "prompt_token_ids": [1, 2, 3],
                    "generation_token_ids": [7, 8, 9],
                    "generation_log_probs": [0.0, -0.5, 0.0],
                    **message_extra,
                },
            }
        ],
    }


async def _no_tokenize(body: dict[str, Any]) -> list[int]:
    raise AssertionError("the hook's bundle has prompt ids: no /tokenize")


def _attach(result: dict[str, Any], body: dict[str, Any], *, return_bundle: bool = True) -> dict[str, Any]:
    asyncio.run(
        attach_bundles(
            result,
            generation_body=body,
            required_prefix=None,
            return_bundle=return_bundle,
            tokenize=_no_tokenize,
            upstream_url="http://v",
        )
    )
    return result["choices"][0]["message"]


def test_adapter_derives_the_fields_from_the_body_it_sent_without_the_hooks() -> None:
    message = _attach(_vllm_answer({}), {"tools": [MOVE_TOOL], "tool_choice": "required"})
    assert message["constrained_by"] == ["tool_choice:required"]
    assert message["generation_forced_mask"] == [1, 0, 1]
    message = _attach(_vllm_answer({}), {"tools": [MOVE_TOOL]})
    assert message["constrained_by"] == [] and message["generation_forced_mask"] == [0, 0, 0]


def test_adapter_keeps_the_hooks_fields_and_replaces_malformed_ones() -> None:
    # The hook saw vLLM's own grammar (e.g. a server --tool-strict-level) that the body does not show: kept.
    hooked = {"constrained_by": ["structured_outputs"], "generation_forced_mask": [1, 0, 1]}
    assert _attach(_vllm_answer(hooked), {})["constrained_by"] == ["structured_outputs"]
    wrong_length = {"constrained_by": ["structured_outputs"], "generation_forced_mask": [1]}
    message = _attach(_vllm_answer(wrong_length), {})
    assert message["constrained_by"] == [] and message["generation_forced_mask"] == [0, 0, 0]


def test_adapter_drops_the_fields_when_no_bundle_was_asked_for() -> None:
    result = _vllm_answer({"constrained_by": [], "generation_forced_mask": [0, 0, 0]})
    _attach(result, {}, return_bundle=False)
    drop_unrequested(result, {}, bundle_returned=False)
    assert "constrained_by" not in result["choices"][0]["message"]
    assert "generation_forced_mask" not in result["choices"][0]["message"]


def test_message_type_checks_the_mask_against_the_generation() -> None:
    bundle = {
        "role": "assistant",
        "content": "",
        "prompt_token_ids": [1],
        "generation_token_ids": [2, 3],
        "generation_log_probs": [0.0, -1.0],
    }
    assert ChatMessage.model_validate({**bundle, "generation_forced_mask": [1, 0]}).generation_forced_mask == [1, 0]
    with pytest.raises(ValueError, match="generation_forced_mask"):
        ChatMessage.model_validate({**bundle, "generation_forced_mask": [1]})
    with pytest.raises(ValueError):
        ChatMessage.model_validate({**bundle, "generation_forced_mask": [2, 0]})


def test_responses_items_carry_the_fields_on_the_bundled_item() -> None:
    message = {
        "role": "assistant",
        "content": None,
        "prompt_token_ids": [1],
        "generation_token_ids": [2, 3],
        "generation_log_probs": [0.0, -1.0],
        "constrained_by": ["tool_choice:required"],
        "generation_forced_mask": [1, 0],
        "tool_calls": [{"id": "c", "type": "function", "function": {"name": "move", "arguments": "{}"}}],
    }
    last = chat_message_to_items(message)[-1].model_dump(exclude_none=True)
    assert last["constrained_by"] == ["tool_choice:required"] and last["generation_forced_mask"] == [1, 0]


# --- training sequences and the rollout record ------------------------------------------------------------------


def _item(prompt: list[int], generation: list[int], log_probs: list[float], **extra: Any) -> dict[str, Any]:
    return {
        "type": "message",
        "role": "assistant",
        "prompt_token_ids": prompt,
        "generation_token_ids": generation,
        "generation_log_probs": log_probs,
        **extra,
    }


def _episode() -> dict[str, Any]:
    return {
        "response": {
            "output": [
                _item(
                    [1, 2],
                    [10, 11, 12],
                    [0.0, -0.7, 0.0],
                    constrained_by=["tool_choice:required"],
                    generation_forced_mask=[1, 0, 1],
                ),
                {"type": "function_call_output", "call_id": "c", "output": "moved"},
                _item(
                    [1, 2, 10, 11, 12, 3, 4], [13, 14], [-0.2, 0.0], constrained_by=[], generation_forced_mask=[0, 0]
                ),
            ]
        },
        "reward": 1.0,
    }


@pytest.mark.parametrize("version", [1, 2])
def test_training_sequence_carries_constraints_and_an_aligned_forced_mask(version: int) -> None:
    record = _episode() if version == 1 else packed_record(_episode())
    sequence = rollout_to_training_sequence(record)
    assert sequence.token_ids == [1, 2, 10, 11, 12, 3, 4, 13, 14]
    assert sequence.constrained_by == [["tool_choice:required"], []]
    assert sequence.forced_mask == [0, 0, 1, 0, 1, 0, 0, 0, 0]
    assert len(sequence.forced_mask) == len(sequence.token_ids)
    # Forced positions are generated positions.
    assert all(sequence.loss_mask[i] for i, flag in enumerate(sequence.forced_mask) if flag)


def test_version_2_packing_keeps_the_fields_on_the_bundled_item() -> None:
    packed = packed_record(_episode())
    stored = packed["response"]["output"][0]
    assert "prompt_token_ids" not in stored  # packed...
    assert stored["constrained_by"] == ["tool_choice:required"] and stored["generation_forced_mask"] == [1, 0, 1]
    assert full_output(packed)[2]["generation_forced_mask"] == [0, 0]  # ...and read back


def test_an_older_record_says_unknown_not_free() -> None:
    episode = _episode()
    for item in episode["response"]["output"]:
        item.pop("constrained_by", None)
        item.pop("generation_forced_mask", None)
    sequence = rollout_to_training_sequence(episode)
    assert sequence.constrained_by == [None, None] and sequence.forced_mask is None
    episode = _episode()
    del episode["response"]["output"][2]["generation_forced_mask"]  # one turn without: the mask is unknown
    assert rollout_to_training_sequence(episode).forced_mask is None


# --- the real vLLM: a constrained and a free turn, through the hook and through the adapter ----------------------


def _check_constrained(message: dict[str, Any], labels: list[str]) -> None:
    generation, log_probs = message["generation_token_ids"], message["generation_log_probs"]
    assert message["constrained_by"] == labels
    mask = message["generation_forced_mask"]
    assert len(mask) == len(generation) > 0
    assert mask == [1 if log_prob == 0.0 else 0 for log_prob in log_probs]
    # The tool-call schema forces the JSON's keys and punctuation: some tokens had no alternative.
    assert sum(mask) > 0, log_probs


def _check_free(message: dict[str, Any]) -> None:
    assert message["constrained_by"] == []
    assert message["generation_forced_mask"] == [0] * len(message["generation_token_ids"])


def _history(message: dict[str, Any]) -> dict[str, Any]:
    kept = {
        key: message[key]
        for key in ("role", "content", "tool_calls", "prompt_token_ids", "generation_token_ids", "generation_log_probs")
        if message.get(key) is not None
    }
    kept["content"] = kept.get("content") or ""
    return kept


def _tool_results(message: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        {"role": "tool", "tool_call_id": call["id"], "content": "moved"} for call in message.get("tool_calls") or []
    ]


def test_hook_reports_a_constrained_then_a_free_turn(vllm_server: VLLMServer) -> None:
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Where next?"}]
    common = {
        "model": vllm_server.served_model_name,
        "tools": [MOVE_TOOL],
        "logprobs": True,
        "top_logprobs": 0,
        "seed": 7,
        "temperature": 1.0,
        "max_tokens": 60,
    }
    with httpx.Client(base_url=vllm_server.base_url, timeout=300) as http:
        answer = http.post(
            "/v1/chat/completions",
            json={**common, "messages": messages, "tool_choice": "required", "parallel_tool_calls": False},
        )
        assert answer.status_code == 200, answer.text
        constrained = answer.json()["choices"][0]["message"]
        assert constrained.get("tool_calls"), constrained  # a real, parsed tool call
        _check_constrained(constrained, ["tool_choice:required"])

        messages += [_history(constrained), *_tool_results(constrained), {"role": "user", "content": "And now?"}]
        answer = http.post("/v1/chat/completions", json={**common, "messages": messages, "tool_choice": "auto"})
        assert answer.status_code == 200, answer.text
        free = answer.json()["choices"][0]["message"]
        _check_free(free)
        # The free turn continued the constrained one's ids (the bundle still works as before).
        prefix = constrained["prompt_token_ids"] + constrained["generation_token_ids"]
        assert free["prompt_token_ids"][: len(prefix)] == prefix

        # Streaming: the hook's final chunk carries the same fields.
        with http.stream(
            "POST",
            "/v1/chat/completions",
            json={
                **common,
                "messages": messages[:1],
                "tool_choice": "required",
                "parallel_tool_calls": False,
                "stream": True,
                "stream_options": {"include_usage": True},
            },
        ) as streamed:
            assert streamed.status_code == 200
            chunks = [
                json.loads(line[6:])
                for line in streamed.iter_lines()
                if line.startswith("data: ") and line != "data: [DONE]"
            ]
        final = chunks[-1]["choices"][0]["delta"]
        _check_constrained(final, ["tool_choice:required"])


@pytest.fixture(scope="module")
def adapter_url(vllm_server: VLLMServer) -> Iterator[str]:
    adapter = VLLMModel(
        "policy_model",
        VLLMModelConfig(
            base_url=vllm_server.base_url, model=vllm_server.served_model_name, return_token_id_information=True
        ),
    )
    with serve_in_thread(adapter.build_app()) as url:
        yield url


def test_adapter_reports_a_constrained_then_a_free_turn(adapter_url: str) -> None:
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Where next?"}]
    common = {"model": "policy", "tools": [MOVE_TOOL], "seed": 11, "temperature": 1.0, "max_tokens": 60}
    with httpx.Client(base_url=adapter_url, timeout=300) as http:
        answer = http.post(
            "/v1/chat/completions",
            json={**common, "messages": messages, "tool_choice": "required", "parallel_tool_calls": False},
        )
        assert answer.status_code == 200, answer.text
        constrained = answer.json()["choices"][0]["message"]
        _check_constrained(constrained, ["tool_choice:required"])

        messages += [_history(constrained), *_tool_results(constrained), {"role": "user", "content": "And now?"}]
        answer = http.post("/v1/chat/completions", json={**common, "messages": messages})
        assert answer.status_code == 200, answer.text
        _check_free(answer.json()["choices"][0]["message"])

        # The Responses API puts them on the call's last output item, streamed or not.
        responses_body = {
            "model": "policy",
            "input": "Where next?",
            "max_output_tokens": 60,
            "seed": 11,
            "tools": [{"type": "function", **MOVE_TOOL["function"]}],
            "tool_choice": "required",
            "parallel_tool_calls": False,
        }
        answer = http.post("/v1/responses", json=responses_body)
        assert answer.status_code == 200, answer.text
        _check_constrained(answer.json()["output"][-1], ["tool_choice:required"])
        with http.stream("POST", "/v1/responses", json={**responses_body, "stream": True}) as streamed:
            assert streamed.status_code == 200
            events = [json.loads(line[6:]) for line in streamed.iter_lines() if line.startswith("data: ")]
        final = events[-1]["response"]
        _check_constrained(final["output"][-1], ["tool_choice:required"])
