"""The hook's bundles carry vLLM's weight version: read from CompletionOutput.weight_versions through internals.py, on
stand-ins and on the real hooked vLLM (whose label the tests set, then put back); the wheel check is in
test_vllm_compat.py."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Iterator
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from nemo_gym_tok.vllm import chat_responses, internals
from nemo_gym_tok.vllm_server import VLLMServer
from tests.weights_support import pause_keeping_requests, resume, set_weight_version, weight_version

# --- reading CompletionOutput.weight_versions -----------------------------------------------------------------------


def span(version: object, start: int, end: int) -> SimpleNamespace:
    """vllm.outputs.WeightVersionSpan's shape."""
    return SimpleNamespace(version=version, start=start, end=end)


def completion(ids: list[int], spans: list[SimpleNamespace] | None, index: int = 0) -> SimpleNamespace:
    steps = [{token: SimpleNamespace(logprob=-0.5)} for token in ids]
    return SimpleNamespace(index=index, token_ids=ids, logprobs=steps, weight_versions=spans, finish_reason="stop")


def test_one_version_gives_weight_version_alone() -> None:
    assert internals.weight_version_fields(completion([1, 2, 3], [span("v1", 0, 3)]), 3) == {"weight_version": "v1"}


def test_several_versions_give_the_spans_too() -> None:
    fields = internals.weight_version_fields(completion([1, 2, 3], [span("v1", 0, 2), span("v2", 2, 3)]), 3)
    assert fields == {
        "weight_version": "v1",
        "weight_version_spans": [{"version": "v1", "start": 0, "end": 2}, {"version": "v2", "start": 2, "end": 3}],
    }


def test_a_release_without_weight_versions_says_nothing() -> None:
    before_032 = SimpleNamespace(index=0, token_ids=[1, 2])  # no such attribute at all (vLLM 0.29 to 0.31)
    assert internals.weight_version_fields(before_032, 2) == {}
    assert internals.weight_version_fields(completion([], []), 0) == {}  # no generated ids: nothing to attribute


def test_spans_past_the_ids_are_cut_where_vllm_trimmed_and_ones_that_do_not_fit_say_nothing() -> None:
    # A stop string trimmed the last ids: a span that starts past them goes, the last one ends with the ids.
    trimmed = completion([1, 2], [span("v1", 0, 2), span("v2", 2, 4)])
    assert internals.weight_version_fields(trimmed, 2) == {"weight_version": "v1"}
    # Spans that leave ids unattributed are no guess to make: unknown.
    assert internals.weight_version_fields(completion([1, 2, 3], [span("v1", 0, 2)]), 3) == {}
    assert internals.weight_version_fields(completion([1, 2, 3], [span("v1", 1, 3)]), 3) == {}
    gap = [span("v1", 0, 1), span("v2", 2, 3)]
    assert internals.weight_version_fields(completion([1, 2, 3], gap), 3) == {}


@pytest.mark.parametrize("label", [None, 7])
def test_a_span_without_a_string_label_says_unknown_not_its_text(label: object) -> None:
    """vLLM types the label as str; a null one is no version called "None" (nor an int one "7")."""
    assert internals.weight_version_fields(completion([1, 2, 3], [span(label, 0, 3)]), 3) == {}
    later = [span("v1", 0, 2), span(label, 2, 3)]
    assert internals.weight_version_fields(completion([1, 2, 3], later), 3) == {}


class Message(SimpleNamespace):
    """vLLM's ChatMessage stand-in: extra attributes allowed, as on vLLM's pydantic models."""


def test_the_whole_answer_carries_each_choices_version() -> None:
    final = SimpleNamespace(
        prompt_token_ids=[5, 6],
        outputs=[completion([1, 2], [span("v3", 0, 2)]), completion([7], None, index=1)],
    )
    response = SimpleNamespace(
        choices=[SimpleNamespace(index=0, message=Message()), SimpleNamespace(index=1, message=Message())]
    )
    chat_responses.attach_bundles(response, final, SimpleNamespace())
    first, second = (choice.message for choice in response.choices)
    assert first.weight_version == "v3" and not hasattr(first, "weight_version_spans")
    assert first.generation_token_ids == [1, 2]
    assert not hasattr(second, "weight_version")  # the release said nothing: the bundle says nothing (unknown)


def test_a_stream_takes_the_versions_from_its_last_delta() -> None:
    record = chat_responses.StreamRecord(keep_ids=True, constrained_by=[])

    async def deltas() -> AsyncIterator[Any]:
        yield SimpleNamespace(prompt_token_ids=[5], outputs=[completion([1, 2], None)])
        yield SimpleNamespace(prompt_token_ids=None, outputs=[completion([3], [span("a", 0, 1), span("b", 1, 3)])])

    async def read() -> None:
        async for _ in record.watch(deltas()):
            pass

    asyncio.run(read())
    (choice,) = record.choices()
    assert choice["delta"]["generation_token_ids"] == [1, 2, 3]
    assert choice["delta"]["weight_version"] == "a"
    assert [s["version"] for s in choice["delta"]["weight_version_spans"]] == ["a", "b"]


# --- the internals discipline -----------------------------------------------------------------------------------------


def test_the_installed_vllm_has_the_fields_the_hook_reads() -> None:
    import vllm
    import vllm.outputs

    expected = internals.field_expected(internals.WEIGHT_VERSIONS_FIELD, vllm.__version__)  # .venv: 0.32, so True
    assert internals.has_field(vllm.outputs.CompletionOutput, "weight_versions") == expected
    assert internals.check_internals() == []


def test_a_moved_field_is_named_from_its_first_release_on(monkeypatch: pytest.MonkeyPatch) -> None:
    import vllm
    import vllm.outputs

    class Moved:  # CompletionOutput without weight_versions
        index: int

    monkeypatch.setattr(vllm.outputs, "CompletionOutput", Moved)
    assert internals.check_internals() == [".".join(internals.WEIGHT_VERSIONS_FIELD)]
    monkeypatch.setattr(vllm, "__version__", "0.31.0")  # a release before it: expected, not missing
    assert internals.check_internals() == []


# --- the real hooked vLLM --------------------------------------------------------------------------------------------


@contextlib.contextmanager
def labelled(server: VLLMServer) -> Iterator[str]:
    """The server's current label; whatever a test sets, the label it had is put back (other tests share it)."""
    original = weight_version(server.base_url)
    try:
        yield original
    finally:
        set_weight_version(server.base_url, original)


def chat_body(server: VLLMServer, **options: Any) -> dict[str, Any]:
    return {
        "model": server.served_model_name,
        "messages": [{"role": "user", "content": "Count to ten."}],
        "max_tokens": 6,
        "seed": 7,
        "logprobs": True,
        **options,
    }


def whole(server: VLLMServer, **options: Any) -> dict[str, Any]:
    answer = httpx.post(f"{server.base_url}/v1/chat/completions", json=chat_body(server, **options), timeout=120)
    assert answer.status_code == 200, answer.text
    return answer.json()["choices"][0]["message"]


def streamed_final_delta(server: VLLMServer, on_first_chunk: Any = None, **options: Any) -> dict[str, Any]:
    """The hook's final chunk's delta (the bundle) of a streamed call; `on_first_chunk()` runs once the first
    generated text is in (not at the role's chunk, which can come before the engine has run a step)."""
    body = chat_body(server, stream=True, stream_options={"include_usage": True}, **options)
    final: dict[str, Any] = {}
    with httpx.stream("POST", f"{server.base_url}/v1/chat/completions", json=body, timeout=300) as answer:
        assert answer.status_code == 200
        for line in answer.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choices = json.loads(line[6:]).get("choices") or []
            if on_first_chunk is not None and any((choice.get("delta") or {}).get("content") for choice in choices):
                on_first_chunk()
                on_first_chunk = None
            for choice in choices:
                if "generation_token_ids" in (choice.get("delta") or {}):
                    final = choice["delta"]
    assert final, "no bundle in the stream's final chunk"
    return final


def test_hooked_bundles_carry_the_servers_weight_version(vllm_server: VLLMServer) -> None:
    with labelled(vllm_server) as original:
        message = whole(vllm_server)
        assert message["weight_version"] == original  # "default" on a fresh server
        assert "weight_version_spans" not in message
        assert streamed_final_delta(vllm_server)["weight_version"] == original
        set_weight_version(vllm_server.base_url, "wv-hook-test-1")
        assert whole(vllm_server)["weight_version"] == "wv-hook-test-1"
        assert streamed_final_delta(vllm_server)["weight_version"] == "wv-hook-test-1"
    assert whole(vllm_server)["weight_version"] == original  # put back for the other tests


def test_a_label_set_while_a_call_generates_splits_its_ids_into_spans(vllm_server: VLLMServer) -> None:
    """A push landing mid-call (here only the label changes: vLLM records the label each step ran under). As a push
    does, the engine is frozen with the call in it (pause mode `keep`) before the label changes. The change is asked
    for once the call's first text is in, but vLLM can take seconds to act on a pause while it generates on 2 busy
    cores: a call that ended under its first label before the change proves nothing, and is tried again longer."""

    def relabel_mid_call() -> None:
        pause_keeping_requests(vllm_server.base_url)
        try:
            set_weight_version(vllm_server.base_url, "wv-hook-test-2")
        finally:
            resume(vllm_server.base_url)

    for max_tokens in (400, 1200, 3000):
        with labelled(vllm_server) as original:
            delta = streamed_final_delta(
                vllm_server, on_first_chunk=relabel_mid_call, max_tokens=max_tokens, ignore_eos=True
            )
        generated = len(delta["generation_token_ids"])
        assert generated == max_tokens
        assert delta["weight_version"] == original  # its first text came before the change: never the new label
        if "weight_version_spans" in delta:
            break
        print(f"\nhook: the label changed after the {max_tokens}-id call ended; trying a longer one")
    else:
        raise AssertionError("no call was still generating when its label changed (vLLM never acted on the pause)")
    spans = delta["weight_version_spans"]
    assert [span["version"] for span in spans] == [original, "wv-hook-test-2"]
    assert spans[0]["start"] == 0 and spans[0]["end"] == spans[1]["start"] and spans[1]["end"] == generated
    print(f"\nhook: {generated} ids, label changed after id {spans[0]['end']}")
