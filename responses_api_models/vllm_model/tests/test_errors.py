"""Caller mistakes are 400s naming the field; upstream failures are clear 502/503s after bounded retries."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from nemo_gym_tok.common.net import free_port
from nemo_gym_tok.servers.inprocess import serve_in_thread
from responses_api_models.vllm_model.app import VLLMModel, VLLMModelConfig
from responses_api_models.vllm_model.tests.fake_upstream import FakeUpstream

USER = {"role": "user", "content": "hi"}
BUNDLE = {"prompt_token_ids": [1, 2], "generation_token_ids": [3], "generation_log_probs": [-0.1]}


def assistant(**fields) -> dict:
    return {"role": "assistant", "content": "x", **fields}


@pytest.fixture
def upstream() -> Iterator[tuple[str, FakeUpstream]]:
    fake = FakeUpstream("fake")
    with serve_in_thread(fake.app()) as url:
        yield url, fake


def serve_adapter(base_url: str, **fields) -> Iterator[str]:
    config = VLLMModelConfig(base_url=base_url, model="m", retry_backoff_seconds=0.01, **fields)
    with serve_in_thread(VLLMModel("policy_model", config).build_app()) as url:
        yield url


@pytest.fixture
def capture_adapter(upstream) -> Iterator[str]:
    yield from serve_adapter(upstream[0], return_token_id_information=True)


MALFORMED = [
    ({"messages": [USER, assistant(prompt_token_ids=[1])]}, "messages[1]: Value error, token bundle is all or none"),
    ({"messages": [USER, assistant(prompt_token_ids=[1], generation_token_ids=[2])]}, "without generation_log_probs"),
    (
        {"messages": [USER, assistant(**{**BUNDLE, "generation_log_probs": [-1.0, -2.0]})]},
        "generation_token_ids (1) and generation_log_probs (2) must have the same length",
    ),
    (
        {"messages": [USER, assistant(**{**BUNDLE, "prompt_token_ids": ["1", 2]})]},
        "messages[1].prompt_token_ids[0]: Input should be a valid integer",
    ),
    (
        {"messages": [USER, assistant(**{**BUNDLE, "prompt_token_ids": [1.0, 2]})]},
        "messages[1].prompt_token_ids[0]: Input should be a valid integer",
    ),
    (
        {"messages": [USER, assistant(**{**BUNDLE, "generation_token_ids": [-3]})]},
        "messages[1].generation_token_ids[0]: Input should be greater than or equal to 0",
    ),
    (
        {"messages": [USER, assistant(**{**BUNDLE, "prompt_token_ids": [True, 2]})]},
        "messages[1].prompt_token_ids[0]: Input should be a valid integer",
    ),
    (
        {"messages": [USER], "required_prefix_token_ids": "1,2"},
        "required_prefix_token_ids: Input should be a valid list",
    ),
    (
        {"messages": [USER], "required_prefix_token_ids": [1, -2]},
        "required_prefix_token_ids[1]: Input should be greater than or equal to 0",
    ),
    (
        {"messages": [USER], "required_prefix_token_ids": [1, 2.5]},
        "required_prefix_token_ids[1]: Input should be a valid integer",
    ),
    ({"messages": [USER], "n": 2}, "n > 1 is not supported with token ids"),
    ({"messages": {"role": "user", "content": "hi"}}, "messages: Input should be a valid list"),
    ({"messages": "hi"}, "messages: Input should be a valid list"),
    ({}, "messages: Field required"),
]


@pytest.mark.parametrize("body, message", MALFORMED)
def test_malformed_chat_requests_are_400_naming_the_field(capture_adapter: str, upstream, body, message) -> None:
    answer = httpx.post(f"{capture_adapter}/v1/chat/completions", json=body)
    assert answer.status_code == 400, answer.text
    assert message.removeprefix("messages[1]: Value error, ") in answer.json()["error"]["message"]
    assert answer.json()["error"]["type"] == "invalid_request_error"
    assert upstream[1].requests == []  # nothing reached vLLM


@pytest.mark.parametrize("raw", [b"{not json", b"[1, 2]", b'"text"'])
def test_body_that_is_not_a_json_object(capture_adapter: str, raw: bytes) -> None:
    answer = httpx.post(
        f"{capture_adapter}/v1/chat/completions", content=raw, headers={"content-type": "application/json"}
    )
    assert answer.status_code == 400
    assert "request body" in answer.json()["error"]["message"]


@pytest.mark.parametrize(
    "body, message",
    [
        ({"input": [{"type": "function_call", "name": "f"}]}, "function_call item needs call_id"),
        ({"input": "hi", "required_prefix_token_ids": [-1]}, "required_prefix_token_ids[0]"),
        ({"input": [{"type": "web_search_call"}]}, "has no chat equivalent"),
    ],
)
def test_malformed_responses_requests_are_400(capture_adapter: str, body, message) -> None:
    answer = httpx.post(f"{capture_adapter}/v1/responses", json=body)
    assert answer.status_code == 400, answer.text
    assert message in answer.json()["error"]["message"]


def test_n_above_one_is_fine_without_token_capture(upstream) -> None:
    for adapter in serve_adapter(upstream[0]):
        assert httpx.post(f"{adapter}/v1/chat/completions", json={"messages": [USER], "n": 2}).status_code == 200


def test_unreachable_vllm_is_503_after_bounded_retries() -> None:
    for adapter in serve_adapter(f"http://127.0.0.1:{free_port()}/v1", max_attempts=2):
        answer = httpx.post(f"{adapter}/v1/chat/completions", json={"messages": [USER]}, timeout=30)
        assert answer.status_code == 503
        assert "is unreachable after 2 attempts" in answer.json()["error"]["message"]


def test_vllm_500_is_a_502_at_once_carrying_its_reason() -> None:
    # A live vLLM's 500 is about this request (e.g. a JSON-schema enum holding 10**30): the same request fails the
    # same way again, so one attempt.
    broken = FakeUpstream("broken", status=500)
    with serve_in_thread(broken.app()) as url:
        for adapter in serve_adapter(url, max_attempts=3):
            answer = httpx.post(f"{adapter}/v1/chat/completions", json={"messages": [USER]})
            assert answer.status_code == 502
            assert (
                answer.json()["error"]["message"]
                == f"vLLM at {url}/v1/chat/completions answered HTTP 500: broken is broken"
            )
            assert answer.json()["error"]["type"] == "upstream_error"
            streamed = httpx.post(f"{adapter}/v1/chat/completions", json={"messages": [USER], "stream": True})
            assert streamed.status_code == 502 and "broken is broken" in streamed.json()["error"]["message"]
    assert len(broken.requests) == 2  # one attempt each


@pytest.mark.parametrize(
    ("status", "attempts", "answered", "says"),
    [
        (503, 3, 502, "answered HTTP 503 3 times: busy is broken"),  # vLLM not taking requests: none generated
        (502, 2, 502, "after 2 attempts that may each have generated the turn (not sent again)"),
        (504, 1, 504, "(a timeout: not sent again, the engine may still be producing the turn)"),
    ],
)
def test_an_answer_that_says_no_engine_took_the_call_is_retried_one_that_may_have_generated_once_a_timeout_never(
    status: int, attempts: int, answered: int, says: str
) -> None:
    busy = FakeUpstream("busy", status=status)
    with serve_in_thread(busy.app()) as url:
        for adapter in serve_adapter(url, max_attempts=3):
            answer = httpx.post(f"{adapter}/v1/chat/completions", json={"messages": [USER]})
            assert answer.status_code == answered
            assert says in answer.json()["error"]["message"]
    assert len(busy.requests) == attempts


def test_a_503_that_clears_is_answered_by_the_retry() -> None:
    flaky = FakeUpstream("flaky", status=503, fail_times=1)
    with serve_in_thread(flaky.app()) as url:
        for adapter in serve_adapter(url, max_attempts=3):
            answer = httpx.post(f"{adapter}/v1/chat/completions", json={"messages": [USER]})
            assert answer.status_code == 200, answer.text
    assert len(flaky.requests) == 2


def test_429_is_retried_then_passed_through() -> None:
    throttled = FakeUpstream("throttled", status=429)
    with serve_in_thread(throttled.app()) as url:
        for adapter in serve_adapter(url, max_attempts=2):
            answer = httpx.post(f"{adapter}/v1/chat/completions", json={"messages": [USER]})
            assert answer.status_code == 429 and answer.json()["error"]["message"] == "throttled is broken"
    assert len(throttled.requests) == 2


def test_a_500_from_a_server_whose_health_fails_says_so() -> None:
    dying = FakeUpstream("dying", status=500, healthy=False)
    with serve_in_thread(dying.app()) as url:
        for adapter in serve_adapter(url):
            answer = httpx.post(f"{adapter}/v1/chat/completions", json={"messages": [USER]})
            assert answer.status_code == 502
            assert "dying is broken (and its GET /health does not answer 200)" in answer.json()["error"]["message"]
    assert len(dying.requests) == 1


def test_vllm_4xx_passes_through_with_status_and_message() -> None:
    teapot = FakeUpstream("teapot", status=422)
    with serve_in_thread(teapot.app()) as url:
        for adapter in serve_adapter(url):
            answer = httpx.post(f"{adapter}/v1/chat/completions", json={"messages": [USER]})
            assert answer.status_code == 422
            assert answer.json()["error"]["message"] == "teapot is broken"
    assert len(teapot.requests) == 1  # client errors are not retried
