"""Token-contract models: bundles are all-or-none, ids are strict, and no caller field is lost."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from nemo_gym_tok.types import ChatCompletionRequest, ChatMessage, ResponsesRequest
from nemo_gym_tok.types.tokens import plain_token_ids

BUNDLE = {"prompt_token_ids": [1, 2, 3], "generation_token_ids": [4, 5], "generation_log_probs": [-0.5, -1.25]}


def assistant(**fields):
    return {"role": "assistant", "content": "hi", **fields}


def test_chat_request_round_trip_keeps_bundles_prefix_and_unknown_fields() -> None:
    body = {
        "model": "m",
        "messages": [
            {"role": "user", "content": "a", "name": "u1", "custom_user_field": {"x": 1}},
            assistant(**BUNDLE, prefix_splice={"applied": True, "template_differed": False, "replaced_tokens": 0}),
            {"role": "user", "content": [{"type": "text", "text": "b"}]},
        ],
        "required_prefix_token_ids": [1, 2, 3, 4, 5],
        "chat_template_kwargs": {"enable_thinking": False},
        "some_future_vllm_field": [1, "two"],
        "min_tokens": 3,
    }
    request = ChatCompletionRequest.model_validate(body)
    dumped = request.model_dump(exclude_unset=True)
    assert dumped == body
    assert ChatCompletionRequest.model_validate(dumped).model_dump(exclude_unset=True) == body


@pytest.mark.parametrize("missing", ["prompt_token_ids", "generation_token_ids", "generation_log_probs"])
def test_bundle_with_a_field_missing_is_rejected_naming_it(missing: str) -> None:
    partial = {k: v for k, v in BUNDLE.items() if k != missing}
    with pytest.raises(ValidationError, match=f"token bundle is all or none: .* without {missing}"):
        ChatMessage.model_validate(assistant(**partial))


def test_bundle_with_only_one_field_is_rejected() -> None:
    with pytest.raises(ValidationError, match="without generation_token_ids, generation_log_probs"):
        ChatMessage.model_validate(assistant(prompt_token_ids=[1]))


def test_generation_ids_and_log_probs_must_have_equal_length() -> None:
    with pytest.raises(ValidationError, match=r"generation_token_ids \(2\) and generation_log_probs \(1\)"):
        ChatMessage.model_validate(assistant(**{**BUNDLE, "generation_log_probs": [-1.0]}))


@pytest.mark.parametrize("bad", ["7", 7.0, -1, True, None, [1]])
def test_ids_must_be_non_negative_ints(bad) -> None:
    with pytest.raises(ValidationError) as info:
        ChatMessage.model_validate(assistant(**{**BUNDLE, "prompt_token_ids": [1, bad]}))
    assert info.value.errors()[0]["loc"] == ("prompt_token_ids", 1)


@pytest.mark.parametrize("bad", [[1, 2**31], [1, 10**30], [1, -(10**12)], [1, 1e300], [1, {"id": 2}]])
def test_ids_past_the_fast_check_are_judged_one_by_one(bad) -> None:
    with pytest.raises(ValidationError) as info:
        ChatMessage.model_validate(assistant(**{**BUNDLE, "prompt_token_ids": bad}))
    assert info.value.errors()[0]["loc"] == ("prompt_token_ids", 1)


@pytest.mark.parametrize(
    ("ids", "plain"),
    [([], True), ([0, 7, 999_999_999], True), ([2**31 - 1], False), ([True], False), ([3.0], False), ((1,), False)],
)
def test_plain_token_ids_takes_only_what_needs_no_item_check(ids, plain) -> None:
    assert plain_token_ids(ids) is plain
    # Either way the model takes every valid id list, as a copy of the caller's.
    if all(type(value) is int for value in ids) and isinstance(ids, list):
        message = ChatMessage.model_validate(assistant(**{**BUNDLE, "prompt_token_ids": ids}))
        assert message.prompt_token_ids == ids and message.prompt_token_ids is not ids


@pytest.mark.parametrize("bad", [[1, "2"], [-3], [False], "1,2", 5, [1.5]])
def test_required_prefix_must_be_a_list_of_ids(bad) -> None:
    with pytest.raises(ValidationError) as info:
        ChatCompletionRequest.model_validate({"messages": [], "required_prefix_token_ids": bad})
    assert info.value.errors()[0]["loc"][0] == "required_prefix_token_ids"


def test_bundle_on_a_user_message_is_rejected() -> None:
    with pytest.raises(ValidationError, match="belongs on an assistant message"):
        ChatMessage.model_validate({"role": "user", "content": "x", **BUNDLE})


def test_messages_must_be_a_list() -> None:
    with pytest.raises(ValidationError) as info:
        ChatCompletionRequest.model_validate({"messages": {"role": "user"}})
    assert info.value.errors()[0]["loc"] == ("messages",)


def test_vllm_reasoning_is_accepted_as_reasoning_content() -> None:
    message = ChatMessage.model_validate({"role": "assistant", "content": "", "reasoning": "because"})
    assert message.reasoning_content == "because"
    assert "reasoning" not in message.model_dump(exclude_unset=True)


def test_responses_request_keeps_prefix_items_and_unknown_fields() -> None:
    body = {
        "model": "m",
        "input": [
            {"role": "user", "content": "q"},
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}", **BUNDLE, "id": "fc_1"},
            {"type": "function_call_output", "call_id": "c1", "output": "42"},
        ],
        "required_prefix_token_ids": [1, 2],
        "my_harness_field": {"episode": 3},
    }
    assert ResponsesRequest.model_validate(body).model_dump(exclude_unset=True) == body


def test_responses_item_shape_errors() -> None:
    with pytest.raises(ValidationError, match="function_call item needs"):
        ResponsesRequest.model_validate({"input": [{"type": "function_call", "name": "f"}]})
