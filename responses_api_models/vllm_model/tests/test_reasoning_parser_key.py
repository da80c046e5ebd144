"""NeMo Gym's `uses_reasoning_parser` on the adapter: accepted (its training configs set it), and `false` refuses an
answer whose reasoning a server-side parser split from the content (a fake vLLM: which parser a real one runs is
its start-up flag)."""

from __future__ import annotations

from contextlib import ExitStack
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request

from nemo_gym_tok.servers.inprocess import serve_in_thread
from responses_api_models.vllm_model.app import VLLMModel, VLLMModelConfig
from responses_api_models.vllm_model.tests.fake_upstream import chat_completion


def vllm_answering(message: dict[str, Any]) -> FastAPI:
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> dict[str, Any]:
        return chat_completion((await request.json())["model"], message)

    return app


@pytest.mark.parametrize(
    ("uses_reasoning_parser", "message", "status"),
    [
        (False, {"role": "assistant", "content": "42", "reasoning_content": "six times seven"}, 502),
        (False, {"role": "assistant", "content": "42", "reasoning": "six times seven"}, 502),
        (False, {"role": "assistant", "content": "<think>six times seven</think>42"}, 200),
        (True, {"role": "assistant", "content": "42", "reasoning_content": "six times seven"}, 200),
        (None, {"role": "assistant", "content": "42", "reasoning_content": "six times seven"}, 200),
    ],
)
def test_false_refuses_reasoning_a_parser_split_off(
    uses_reasoning_parser: bool | None, message: dict[str, Any], status: int
) -> None:
    with ExitStack() as stack:
        url = stack.enter_context(serve_in_thread(vllm_answering(message)))
        config = VLLMModelConfig(base_url=url, model="m", uses_reasoning_parser=uses_reasoning_parser)
        adapter = stack.enter_context(serve_in_thread(VLLMModel("policy_model", config).build_app()))
        body = {"messages": [{"role": "user", "content": "6 x 7?"}]}
        answer = httpx.post(f"{adapter}/v1/chat/completions", json=body, timeout=30)
        responses = httpx.post(f"{adapter}/v1/responses", json={"input": "6 x 7?"}, timeout=30)
    assert answer.status_code == responses.status_code == status, answer.text
    if status == 502:
        error = answer.json()["error"]
        assert error["type"] == "reasoning_parser_mismatch" and "uses_reasoning_parser: false" in error["message"]
    elif message.get("reasoning_content"):
        assert answer.json()["choices"][0]["message"]["reasoning_content"] == "six times seven"
        assert [item["type"] for item in responses.json()["output"]][0] == "reasoning"
