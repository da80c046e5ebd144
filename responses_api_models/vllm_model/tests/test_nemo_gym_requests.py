"""NeMo Gym's request shapes at the adapter: rollout paths, metadata settings, capture records (fake upstreams)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest

from nemo_gym_tok.servers.api_errors import ApiError
from nemo_gym_tok.servers.inprocess import serve_in_thread
from responses_api_models.vllm_model.app import VLLMModel, VLLMModelConfig
from responses_api_models.vllm_model.nemo_gym_token_store import NeMoGymTokenStore, sequence_digest
from responses_api_models.vllm_model.request_metadata import apply_metadata
from responses_api_models.vllm_model.rollout_paths import Rollout, parse_rollout_path
from responses_api_models.vllm_model.tests.fake_upstream import FakeUpstream

CHAT = {"messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        ("/ng-rollout/3-0/v1/responses", (Rollout("3-0", False), "/v1/responses")),
        ("/ng-rollout/3-0/training-token-capture/v1/chat/completions", (Rollout("3-0", True), "/v1/chat/completions")),
        ("/ng-rollout/task.7_b/training-token-capture/v1/responses", (Rollout("task.7_b", True), "/v1/responses")),
        ("/v1/responses", None),
        ("/ng-rolloutx/3/v1/responses", None),
    ],
)
def test_rollout_paths_parse(path: str, expected: Any) -> None:
    assert parse_rollout_path(path) == expected


@pytest.mark.parametrize(
    ("path", "says"),
    [
        ("/ng-rollout/3-0", "is /ng-rollout/<rollout id>"),
        ("/ng-rollout/3-0/training-token-capture", "is /ng-rollout/<rollout id>"),
        ("/ng-rollout//v1/responses", "rollout id ''"),
        ("/ng-rollout/.hidden/v1/responses", "starting with a letter or digit"),
        ("/ng-rollout/a%20b/v1/responses", "letters, digits"),
    ],
)
def test_malformed_rollout_paths_say_what_to_fix(path: str, says: str) -> None:
    message = parse_rollout_path(path)
    assert isinstance(message, str) and says in message


def test_metadata_template_kwargs_merge_over_the_request_and_extra_body_fills_gaps() -> None:
    body = {
        **CHAT,
        "temperature": 0.5,
        "chat_template_kwargs": {"a": 1, "b": 1},
        "metadata": {
            "chat_template_kwargs": '{"b": 2, "enable_thinking": false}',
            "extra_body": '{"temperature": 1.0, "seed": 7, "top_k": 5}',
            "task": "x",
        },
    }
    out, added = apply_metadata(body)
    assert out["chat_template_kwargs"] == {"a": 1, "b": 2, "enable_thinking": False}
    assert out["temperature"] == 0.5 and out["seed"] == 7 and out["top_k"] == 5  # the request's own field wins
    assert added == ["seed", "top_k"]
    assert out["metadata"] is body["metadata"] and body["chat_template_kwargs"] == {"a": 1, "b": 1}  # input untouched
    as_objects, _ = apply_metadata({**CHAT, "metadata": {"chat_template_kwargs": {"x": 1}, "extra_body": ""}})
    assert as_objects["chat_template_kwargs"] == {"x": 1}
    assert apply_metadata({**CHAT, "metadata": {"task": "x"}}) == ({**CHAT, "metadata": {"task": "x"}}, [])


@pytest.mark.parametrize(
    ("metadata", "param", "says"),
    [
        ({"chat_template_kwargs": "{enable_thinking: false}"}, "metadata.chat_template_kwargs", "not valid JSON"),
        ({"chat_template_kwargs": "[1, 2]"}, "metadata.chat_template_kwargs", "must be a JSON object"),
        ({"extra_body": "7"}, "metadata.extra_body", "must be a JSON object"),
        ({"extra_body": '{"stream": true}'}, "metadata.extra_body", "'stream' cannot be set per row"),
        ({"audio_path": "a.wav"}, "metadata.audio_path", "audio side channel"),
    ],
)
def test_malformed_metadata_is_a_400_naming_it(metadata: dict[str, Any], param: str, says: str) -> None:
    with pytest.raises(ApiError) as caught:
        apply_metadata({**CHAT, "metadata": metadata})
    assert caught.value.status == 400 and caught.value.param == param and says in caught.value.message


@pytest.fixture
def adapter() -> Iterator[tuple[str, FakeUpstream]]:
    upstream = FakeUpstream("a")
    with ExitStack() as stack:
        url = stack.enter_context(serve_in_thread(upstream.app()))
        config = VLLMModelConfig(base_url=url, model="m", forwarded_fields=["temperature", "metadata", "seed"])
        yield stack.enter_context(serve_in_thread(VLLMModel("policy_model", config).build_app())), upstream


def test_adapter_serves_rollout_paths_and_applies_metadata(adapter: tuple[str, FakeUpstream]) -> None:
    url, upstream = adapter
    metadata = {"chat_template_kwargs": '{"enable_thinking": false}', "extra_body": '{"seed": 3}'}
    answer = httpx.post(f"{url}/ng-rollout/5-1/v1/responses", json={"input": "hi", "metadata": metadata})
    assert answer.status_code == 200, answer.text
    assert upstream.requests[-1]["chat_template_kwargs"] == {"enable_thinking": False}
    assert upstream.requests[-1]["seed"] == 3
    assert upstream.sessions[-1] == "rollout:5-1"  # one NeMo Gym rollout, one conversation on the router
    assert not answer.cookies  # the adapter keys NeMo Gym's rollouts by their id, not by a cookie
    # extra_body adds fields under the operator's forwarded_fields like the caller's own.
    refused = httpx.post(f"{url}/v1/chat/completions", json={**CHAT, "metadata": {"extra_body": '{"top_k": 2}'}})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "top_k", refused.text
    bad = httpx.post(f"{url}/ng-rollout/5-1/v1/chat/completions", json={**CHAT, "metadata": {"extra_body": "{"}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "metadata.extra_body"
    malformed = httpx.post(f"{url}/ng-rollout/no slash", json=CHAT)
    assert malformed.status_code == 400 and "/ng-rollout/<rollout id>" in malformed.json()["error"]["message"]


def test_training_capture_without_ids_or_store_is_refused(adapter: tuple[str, FakeUpstream]) -> None:
    url, upstream = adapter
    answer = httpx.post(f"{url}/ng-rollout/5-1/training-token-capture/v1/chat/completions", json=CHAT)
    assert answer.status_code == 400 and "return_token_id_information" in answer.json()["error"]["message"]
    assert not upstream.requests


def test_capture_dir_needs_bundles() -> None:
    with pytest.raises(ValueError, match="return_token_id_information: true"):
        VLLMModelConfig(base_url="http://x", model="m", nemo_gym_token_capture_dir="/tmp/x")


def _answer(prompt: list[int], generation: list[int], answer_id: str) -> dict[str, Any]:
    item = {
        "type": "message",
        "role": "assistant",
        "content": [{"type": "output_text", "text": "t"}],
        "prompt_token_ids": prompt,
        "generation_token_ids": generation,
        "generation_log_probs": [-0.5] * len(generation),
    }
    return {"id": answer_id, "model": "m", "output": [{"type": "reasoning", "summary": []}, item]}


def _records(root: Path, rollout_id: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (root / f"{rollout_id}.tokens.jsonl").read_text().splitlines()]


def test_store_links_each_call_to_the_recorded_call_its_prefix_is(tmp_path: Path) -> None:
    store = NeMoGymTokenStore(tmp_path)
    record = lambda *args, **kwargs: asyncio.run(store.record(*args, **kwargs))  # noqa: E731
    history = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    first = record("7-0", _answer([1, 2], [3, 4], "resp_a"), chat_body=CHAT, required_prefix=None)
    second = record("7-0", _answer([1, 2, 3, 4, 5], [6], "resp_b"), chat_body=history, required_prefix=[1, 2, 3, 4])
    orphan = record("7-0", _answer([9], [8], "resp_c"), chat_body=history, required_prefix=[9, 9])
    blind = record("7-0", _answer([1], [2], "resp_d"), chat_body=history, required_prefix=None)
    records = _records(tmp_path, "7-0")
    assert [r["model_call_id"] for r in records] == [first, second, orphan, blind]
    assert [(r["parent_resolution"], r["parent_call_id"]) for r in records] == [
        ("root", None),
        ("resolved", first),
        ("unresolved", None),
        ("unresolved", None),
    ]
    assert records[1]["cum_len"] == 6 and records[1]["digest"] == sequence_digest([1, 2, 3, 4, 5, 6])
    assert records[1]["token_item_index"] == 1 and records[1]["response_id"] == "resp_b"
    assert "prompt_token_ids" not in records[1]["output_items"][1]
    assert records[1]["generation_log_probs"] == [-0.5] and records[1]["schema_version"] == 1


def test_store_marks_a_call_without_ids_incomplete_and_refuses_a_frozen_rollout(tmp_path: Path) -> None:
    store = NeMoGymTokenStore(tmp_path)
    record = lambda *args, **kwargs: asyncio.run(store.record(*args, **kwargs))  # noqa: E731
    empty = {"id": "r", "output": [{"type": "message", "role": "assistant", "content": []}]}
    record("8-0", empty, chat_body=CHAT, required_prefix=None)
    assert json.loads((tmp_path / "8-0.tokens.state.json").read_bytes())["incomplete"] is True
    (tmp_path / "9-0.tokens.state.json").write_text(json.dumps({"frozen": True}))
    with pytest.raises(ApiError) as caught:
        record("9-0", _answer([1], [2], "r"), chat_body=CHAT, required_prefix=None)
    assert caught.value.status == 409 and "already collected" in caught.value.message
