"""vLLM's chat answer as the adapter's Responses answer: the prompt ids that skip the Response model change nothing."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from responses_api_models.vllm_model.chat_answer import chat_result_to_response, response_body

ECHO = {"tools": [], "tool_choice": "auto", "parallel_tool_calls": True}


def answer(**message: Any) -> dict[str, Any]:
    return {
        "id": "chatcmpl-1",
        "model": "m",
        "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", **message}}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
    }


BUNDLED = answer(
    content="hi",
    reasoning_content="think",
    prompt_token_ids=list(range(3000)),
    generation_token_ids=[7, 8],
    generation_log_probs=[-0.5, -0.25],
    token_source="return_token_ids",
    prefix_splice={"applied": True, "template_differed": False, "replaced_tokens": 0},
    constrained_by=[],
    generation_forced_mask=[0, 0],
    weight_version=None,
)


@pytest.mark.parametrize("result", [BUNDLED, answer(content="plain")], ids=["bundled", "no bundle"])
def test_the_answer_body_is_the_response_models_dump(result: dict[str, Any]) -> None:
    body = response_body(result, "m", ECHO)
    expected = chat_result_to_response(result, "m", ECHO).model_dump(exclude_none=True)
    assert {**body, "id": "", "created_at": 0} | {"output": strip_ids(body["output"])} == {
        **expected,
        "id": "",
        "created_at": 0,
    } | {"output": strip_ids(expected["output"])}
    assert [item.get("prompt_token_ids") for item in body["output"]] == [
        item.get("prompt_token_ids") for item in expected["output"]
    ]


def test_prompt_ids_that_are_not_plain_go_through_the_model() -> None:
    broken = answer(**{**BUNDLED["choices"][0]["message"], "prompt_token_ids": [1, 2.0]})
    with pytest.raises(ValidationError, match="prompt_token_ids"):
        response_body(broken, "m", ECHO)


def test_the_other_bundle_rules_still_apply() -> None:
    short = answer(**{**BUNDLED["choices"][0]["message"], "generation_log_probs": [-0.5]})
    with pytest.raises(ValidationError, match="must have the same length"):
        response_body(short, "m", ECHO)


def strip_ids(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Items without their fresh random ids (each conversion makes new ones)."""
    return [{key: value for key, value in item.items() if key != "id"} for item in items]
