"""forwarded_fields: a caller field outside the operator's list is a 400 naming it; the adapter's own fields pass."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from nemo_gym_tok.servers.inprocess import serve_in_thread
from responses_api_models.vllm_model.app import VLLMModel, VLLMModelConfig
from responses_api_models.vllm_model.tests.fake_upstream import FakeUpstream

USER = {"role": "user", "content": "hi"}


@pytest.fixture
def narrowed() -> Iterator[tuple[str, FakeUpstream]]:
    fake = FakeUpstream("fake")
    with serve_in_thread(fake.app()) as url:
        config = VLLMModelConfig(base_url=url, model="m", forwarded_fields=["temperature", "max_tokens"])
        with serve_in_thread(VLLMModel("policy_model", config).build_app()) as adapter:
            yield adapter, fake


def test_listed_and_adapter_fields_are_forwarded(narrowed) -> None:
    adapter, fake = narrowed
    body = {"model": "x", "messages": [USER], "temperature": 0.5, "max_tokens": 3, "n": 1, "stream": False}
    assert httpx.post(f"{adapter}/v1/chat/completions", json=body).status_code == 200
    assert fake.requests[-1]["temperature"] == 0.5 and fake.requests[-1]["max_tokens"] == 3
    # Responses: input and instructions become messages; max_output_tokens reaches vLLM as the listed max_tokens.
    answer = httpx.post(
        f"{adapter}/v1/responses",
        json={"input": "hi", "instructions": "Be brief.", "max_output_tokens": 4, "temperature": 0.1},
    )
    assert answer.status_code == 200, answer.text
    assert fake.requests[-1]["max_tokens"] == 4


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/chat/completions", {"messages": [USER], "temperature": 0.5, "guided_json": {"type": "object"}}),
        ("/v1/responses", {"input": "hi", "guided_json": {"type": "object"}}),
    ],
)
def test_an_unlisted_field_is_a_400_naming_it(narrowed, path: str, body: dict) -> None:
    adapter, fake = narrowed
    answer = httpx.post(f"{adapter}{path}", json=body)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == "guided_json" and "'guided_json'" in error["message"]
    assert "forwarded_fields: max_tokens, temperature" in error["message"]
    assert fake.requests == []  # refused before vLLM


def test_default_forwards_every_field() -> None:
    fake = FakeUpstream("fake")
    with serve_in_thread(fake.app()) as url:
        config = VLLMModelConfig(base_url=url, model="m")
        with serve_in_thread(VLLMModel("policy_model", config).build_app()) as adapter:
            body = {"messages": [USER], "guided_json": {"type": "object"}, "seed": 7}
            assert httpx.post(f"{adapter}/v1/chat/completions", json=body).status_code == 200
    assert fake.requests[-1]["guided_json"] == {"type": "object"} and fake.requests[-1]["seed"] == 7
