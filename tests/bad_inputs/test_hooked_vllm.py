"""The hooked vLLM (the shared real server) refuses bad hook fields with a 400 naming the field."""

from __future__ import annotations

import httpx
import pytest

from nemo_gym_tok.vllm_server import VLLMServer

pytestmark = pytest.mark.vllm

USER = {"role": "user", "content": "hi"}
BUNDLE = {"prompt_token_ids": [1, 2], "generation_token_ids": [3], "generation_log_probs": [-0.1]}


def assistant(**fields: object) -> dict:
    return {"role": "assistant", "content": "x", **fields}


HOOK_CASES = [
    # (kind, extra chat fields, the field the 400 must name)
    ("prefix_string", {"required_prefix_token_ids": "abc"}, "required_prefix_token_ids"),
    ("prefix_negative", {"required_prefix_token_ids": [-1]}, "required_prefix_token_ids"),
    ("prefix_floats", {"required_prefix_token_ids": [1.5, 2]}, "required_prefix_token_ids"),
    ("prefix_past_vocab", {"required_prefix_token_ids": [10**9]}, "required_prefix_token_ids"),
    (
        "bundle_ids_strings",
        {"messages": [USER, assistant(**{**BUNDLE, "generation_token_ids": ["3"]}), USER]},
        "generation_token_ids",
    ),
    ("bundle_partial", {"messages": [USER, assistant(prompt_token_ids=[1, 2]), USER]}, "generation_token_ids"),
    ("new_segment_string", {"start_token_segment": "yes"}, "start_token_segment"),
    ("new_segment_number", {"start_token_segment": 1}, "start_token_segment"),
]


@pytest.mark.parametrize("fields, field", [case[1:] for case in HOOK_CASES], ids=[case[0] for case in HOOK_CASES])
def test_bad_hook_fields_are_400_naming_the_field(vllm_server: VLLMServer, fields: dict, field: str) -> None:
    body = {"model": vllm_server.served_model_name, "messages": [USER], "max_tokens": 2, **fields}
    answer = httpx.post(f"{vllm_server.base_url}/v1/chat/completions", json=body, timeout=60)
    assert answer.status_code == 400, answer.text[:500]
    assert "Traceback" not in answer.text
    error = answer.json()["error"]
    assert field in error["message"] or error.get("param") == field, error
