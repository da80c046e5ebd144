"""The adapter in front of the real vLLM server (tiny model), driven by the OpenAI Python SDK."""

from __future__ import annotations

import httpx
import pytest
from openai import OpenAI

from nemo_gym_tok.testing.tiny_model.tokenizer import THINK_START_ID
from nemo_gym_tok.types.tokens import BUNDLE_FIELDS
from nemo_gym_tok.vllm_server import VLLMServer
from responses_api_models.vllm_model.tests.conftest import RecordingProxy

USER = {"role": "user", "content": "Name three rivers."}


def sdk(url: str) -> OpenAI:
    # max_retries=0: the SDK's own retries would hide the adapter's status codes.
    return OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def prompt_prefix(vllm_server: VLLMServer, messages: list[dict], length: int) -> list[int]:
    tokens = httpx.post(
        f"{vllm_server.base_url}/tokenize",
        json={"model": vllm_server.served_model_name, "messages": messages, "add_generation_prompt": True},
    ).json()["tokens"]
    return tokens[:length]


def test_extra_body_fields_reach_vllm_through_chat_completions(
    training_adapter: str, recording_proxy: RecordingProxy, vllm_server: VLLMServer
) -> None:
    prefix = prompt_prefix(vllm_server, [USER], 6)
    extra = {"required_prefix_token_ids": prefix, "harness_tag": {"episode": 7, "ids": [1, 2]}, "min_tokens": 3}
    completion = sdk(training_adapter).chat.completions.create(
        model="anything", messages=[USER], max_tokens=5, seed=1, extra_body=extra
    )
    sent = recording_proxy.bodies("/v1/chat/completions")[-1]
    for key, value in extra.items():
        assert sent[key] == value, key
    assert sent["model"] == vllm_server.served_model_name  # the adapter owns the model name
    assert sent["logprobs"] is True and sent["return_token_ids"] is True and sent["return_tokens_as_token_ids"] is True
    assert len(completion.choices[0].message.generation_token_ids) >= 3  # min_tokens took effect in vLLM


def test_bundles_on_messages_reach_vllm_unchanged(
    training_adapter: str, recording_proxy: RecordingProxy, vllm_server: VLLMServer
) -> None:
    client = sdk(training_adapter)
    first = client.chat.completions.create(model="m", messages=[USER], max_tokens=4, seed=2).choices[0].message
    assistant = first.model_dump(exclude_none=True)
    history = [USER, assistant, {"role": "user", "content": "More."}]
    client.chat.completions.create(model="m", messages=history, max_tokens=4, seed=2)
    sent_assistant = recording_proxy.bodies("/v1/chat/completions")[-1]["messages"][1]
    for key in BUNDLE_FIELDS:
        assert sent_assistant[key] == assistant[key], key


def test_returned_bundle_is_what_vllm_reported(training_adapter: str, recording_proxy: RecordingProxy) -> None:
    message = (
        sdk(training_adapter)
        .chat.completions.create(model="m", messages=[USER], max_tokens=8, seed=3)
        .choices[0]
        .message
    )
    reported = recording_proxy.answers("/v1/chat/completions")[-1]
    choice = reported["choices"][0]
    assert message.prompt_token_ids == reported["prompt_token_ids"]
    assert message.generation_token_ids == choice["token_ids"]
    assert message.generation_log_probs == [entry["logprob"] for entry in choice["logprobs"]["content"]]
    assert message.token_source == "message"  # the hook's bundle, checked against return_token_ids and logprobs


def test_responses_api_carries_extra_body_and_returns_bundle_on_last_item(
    training_adapter: str, recording_proxy: RecordingProxy, vllm_server: VLLMServer
) -> None:
    prefix = prompt_prefix(vllm_server, [USER], 4)
    response = sdk(training_adapter).responses.create(
        model="m",
        input=[USER],
        max_output_tokens=6,
        extra_body={"required_prefix_token_ids": prefix, "harness_tag": "r1", "seed": 4},
    )
    sent = recording_proxy.bodies("/v1/chat/completions")[-1]
    assert sent["required_prefix_token_ids"] == prefix and sent["harness_tag"] == "r1" and sent["seed"] == 4
    assert sent["max_tokens"] == 6
    reported = recording_proxy.answers("/v1/chat/completions")[-1]
    last = response.output[-1].model_dump()
    assert last["prompt_token_ids"] == reported["prompt_token_ids"]
    assert last["generation_token_ids"] == reported["choices"][0]["token_ids"]
    assert response.status == "incomplete"  # 6 tokens from a random model end on max_output_tokens


def test_tokenize_fallback_renders_the_same_prompt(
    training_adapter: str, tokenize_fallback_adapter: str, bundle_free_vllm: RecordingProxy
) -> None:
    tools = [
        {
            "type": "function",
            "function": {"name": "lookup", "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}},
        }
    ]
    kwargs = dict(
        model="m",
        messages=[{"role": "system", "content": "s"}, USER],
        max_tokens=3,
        seed=5,
        tools=tools,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    returned = sdk(training_adapter).chat.completions.create(**kwargs).choices[0].message
    fallback = sdk(tokenize_fallback_adapter).chat.completions.create(**kwargs).choices[0].message
    assert fallback.token_source == "tokenize"
    assert fallback.prompt_token_ids == returned.prompt_token_ids
    generation = bundle_free_vllm.bodies("/v1/chat/completions")[-1]
    tokenize = bundle_free_vllm.bodies("/tokenize")[-1]
    assert "return_token_ids" not in generation
    for key in ("model", "messages", "tools", "chat_template_kwargs"):
        assert tokenize[key] == generation[key], key


@pytest.mark.parametrize("effort", ["none", "high"])
def test_tokenize_fallback_renders_reasoning_effort_as_generation_does(
    training_adapter: str, tokenize_fallback_adapter: str, effort: str
) -> None:
    # vLLM turns reasoning_effort "none" into enable_thinking=false, which this template renders as an empty think
    # block; /tokenize has no reasoning_effort, so the adapter must translate it or the ids differ.
    kwargs = dict(model="m", messages=[USER], max_tokens=2, seed=1, extra_body={"reasoning_effort": effort})
    returned = sdk(training_adapter).chat.completions.create(**kwargs).choices[0].message
    fallback = sdk(tokenize_fallback_adapter).chat.completions.create(**kwargs).choices[0].message
    assert fallback.token_source == "tokenize"
    assert fallback.prompt_token_ids == returned.prompt_token_ids
    assert (THINK_START_ID in returned.prompt_token_ids) == (effort == "none")


def test_tokenize_fallback_refuses_what_it_cannot_render(tokenize_fallback_adapter: str) -> None:
    answer = httpx.post(
        f"{tokenize_fallback_adapter}/v1/chat/completions",
        timeout=60,
        json={
            "model": "m",
            "messages": [USER],
            "max_tokens": 2,
            "truncate_prompt_tokens": 5,
        },
    )
    assert answer.status_code == 400, answer.text
    assert "truncate_prompt_tokens cannot be combined with token capture through the /tokenize fallback" in answer.text


def test_stock_vllm_is_detected_as_not_splicing(stock_training_adapter: str) -> None:
    client = sdk(stock_training_adapter)
    http = httpx.Client(base_url=stock_training_adapter, timeout=120)
    refused = 0
    for seed in range(6):
        first = client.chat.completions.create(model="m", messages=[USER], max_tokens=12, seed=seed).choices[0].message
        assistant = first.model_dump(exclude_none=True)
        answer = http.post(
            "/v1/chat/completions",
            json={
                "messages": [USER, assistant, {"role": "user", "content": "And?"}],
                "max_tokens": 2,
                "seed": seed,
            },
        )
        if answer.status_code == 502:
            assert "is not splicing the required prefix" in answer.json()["error"]["message"]
            refused += 1
        else:  # the rare history that re-tokenizes identically must really be contiguous
            assert answer.status_code == 200
            prompt = answer.json()["choices"][0]["message"]["prompt_token_ids"]
            prefix = assistant["prompt_token_ids"] + assistant["generation_token_ids"]
            assert prompt[: len(prefix)] == prefix
    assert refused >= 4, f"only {refused}/6 drifting histories were refused"


def test_context_overflow_is_a_length_finish_not_an_error(training_adapter: str) -> None:
    huge = {"role": "user", "content": "river " * 6000}
    completion = sdk(training_adapter).chat.completions.create(model="m", messages=[huge], max_tokens=4)
    assert completion.choices[0].finish_reason == "length"
    assert completion.choices[0].message.content == ""
    response = sdk(training_adapter).responses.create(model="m", input=[huge], max_output_tokens=4)
    assert response.status == "incomplete"
    assert response.incomplete_details is not None and response.incomplete_details.reason == "max_output_tokens"


def test_other_vllm_client_errors_pass_through(training_adapter: str) -> None:
    answer = httpx.post(
        f"{training_adapter}/v1/chat/completions", json={"messages": [USER], "max_tokens": 2, "temperature": -3}
    )
    assert answer.status_code == 400
    assert "temperature" in answer.json()["error"]["message"]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/responses"])
def test_adapter_sets_no_session_cookie(training_adapter: str, path: str) -> None:
    # A cookie would pin every conversation of one SDK client to one vLLM URL; routing keys come from the
    # x-session-id header or the conversation's opening messages instead.
    body = (
        {"messages": [USER], "max_tokens": 1}
        if path.endswith("completions")
        else {"input": "hi", "max_output_tokens": 1}
    )
    answer = httpx.post(f"{training_adapter}{path}", json=body, timeout=60)
    assert answer.status_code == 200
    assert "set-cookie" not in answer.headers


def test_inference_adapter_returns_only_what_the_caller_asked_for(vllm_server: VLLMServer) -> None:
    from responses_api_models.vllm_model.tests.conftest import adapter

    prefix = prompt_prefix(vllm_server, [USER], 5)
    for url in adapter(vllm_server.base_url, vllm_server.served_model_name):  # return_token_id_information: false
        plain = (
            sdk(url)
            .chat.completions.create(
                model="m", messages=[USER], max_tokens=3, extra_body={"required_prefix_token_ids": prefix}
            )
            .model_dump()
        )
        asked = (
            sdk(url)
            .chat.completions.create(
                model="m", messages=[USER], max_tokens=3, logprobs=True, extra_body={"return_token_ids": True}
            )
            .model_dump()
        )
    assert "prompt_token_ids" not in plain and plain["choices"][0]["logprobs"] is None
    assert "prompt_token_ids" not in plain["choices"][0]["message"]  # the prefix was checked, nothing leaked
    assert asked["prompt_token_ids"][:5] == prefix and asked["choices"][0]["logprobs"]["content"]
