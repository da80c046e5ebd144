"""The prefix-splice hook on the real vLLM server (tiny model): contiguity, /tokenize, telemetry, metrics, errors."""

from __future__ import annotations

import asyncio
import re

import httpx
import pytest
from openai import OpenAI

from nemo_gym_tok.servers.http_pool import pool_limits
from nemo_gym_tok.types.tokens import BUNDLE_FIELDS
from nemo_gym_tok.vllm_server import VLLMServer
from tests.conversations import Conversation, converse

SEEDS = range(20)


def play(server: VLLMServer, seeds, **options) -> list[Conversation]:
    async def all_of_them() -> list[Conversation]:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=300, limits=pool_limits()) as http:
            return await asyncio.gather(*(converse(http, server.served_model_name, s, **options) for s in seeds))

    return asyncio.run(all_of_them())


def test_bundled_conversations_are_contiguous_while_stock_drifts(vllm_server: VLLMServer) -> None:
    bundled = play(vllm_server, SEEDS, mode="bundles")
    stock = play(vllm_server, SEEDS, mode="stock")
    assert all(len(c.turns) == 4 for c in bundled)
    broken = [c.seed for c in bundled if not c.contiguous]
    assert broken == [], f"bundled conversations not contiguous: {broken}"
    drifting = sum(not c.contiguous for c in stock)
    print(
        f"\nhook: {len(bundled) - len(broken)}/{len(bundled)} bundled conversations contiguous; "
        f"stock: {drifting}/{len(stock)} drift"
    )
    assert drifting >= 15
    endings = {turn.finish_reason for c in bundled for turn in c.turns}
    assert endings == {"stop", "length"}  # turns ended on <|im_end|> and on max_tokens
    # A turn cut by max_tokens is followed by a contiguous one (the template closes it after the model's ids).
    assert any(c.turns[1].finish_reason == "length" and c.turns[2].contiguous for c in bundled)


def test_telemetry_reports_splices_and_repairs(vllm_server: VLLMServer) -> None:
    (conversation,) = play(vllm_server, [101], mode="bundles")
    assert conversation.turns[0].prefix_splice is None  # no prefix on turn 1
    later = [turn.prefix_splice for turn in conversation.turns[1:]]
    assert all(t is not None and t["applied"] for t in later)
    assert any(t["template_differed"] and t["replaced_tokens"] > 0 for t in later)  # the random model's text drifts


def test_required_prefix_via_openai_sdk_extra_body(vllm_server: VLLMServer) -> None:
    client = OpenAI(base_url=f"{vllm_server.base_url}/v1", api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "Tell me a story."}]
    previous: list[int] | None = None
    for turn in range(4):
        extra = {"return_token_ids": True}
        if previous is not None:
            extra["required_prefix_token_ids"] = previous
        completion = client.chat.completions.create(
            model=vllm_server.served_model_name, messages=messages, max_tokens=10 + turn, seed=turn, extra_body=extra
        )
        data = completion.model_dump()
        prompt, generation = data["prompt_token_ids"], data["choices"][0]["token_ids"]
        if previous is not None:
            assert prompt[: len(previous)] == previous, f"turn {turn} not contiguous"
            assert data["prefix_splice"]["applied"] is True
        messages += [
            {"role": "assistant", "content": completion.choices[0].message.content},
            {"role": "user", "content": "Go on."},
        ]
        previous = prompt + generation


def test_tool_call_conversations_are_contiguous(vllm_server: VLLMServer) -> None:
    conversations = play(vllm_server, range(5), mode="bundles", tools=True, turns=3)
    calls = [call for c in conversations for t in c.turns for call in t.message.get("tool_calls") or []]
    assert len(calls) >= 10 and all(call["function"]["name"] == "move" for call in calls)  # real, parsed tool calls
    assert [c.seed for c in conversations if not c.contiguous] == []
    repaired = [t.prefix_splice["replaced_tokens"] for c in conversations for t in c.turns[1:]]
    assert all(count > 0 for count in repaired)  # vLLM re-serializes the arguments; the model's ids replace them


def test_tokenize_returns_the_prompt_ids_generation_used(vllm_server: VLLMServer) -> None:
    for tools in (False, True):
        (conversation,) = play(vllm_server, [7], mode="bundles", tools=tools, turns=3)
        last = conversation.turns[-1]
        history = conversation.messages[: _index_of_last_assistant(conversation.messages)]
        body = {"model": vllm_server.served_model_name, "messages": history, "add_generation_prompt": True}
        if tools:
            from tests.conversations import MOVE_TOOL

            body["tools"] = [MOVE_TOOL]
        tokens = httpx.post(f"{vllm_server.base_url}/tokenize", json=body, timeout=60).json()["tokens"]
        assert tokens == last.prompt_token_ids


def _index_of_last_assistant(messages: list[dict]) -> int:
    return max(i for i, m in enumerate(messages) if m["role"] == "assistant")


def metric(server: VLLMServer, name: str) -> float:
    text = httpx.get(f"{server.base_url}/metrics").text
    match = re.search(rf"^{name}_total (\S+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def test_metrics_count_splices_repairs_and_rejections(vllm_server: VLLMServer) -> None:
    names = [
        "nemo_gym_tok_prefix_splices",
        "nemo_gym_tok_prefix_splice_drifted_turns",
        "nemo_gym_tok_prefix_splice_replaced_tokens",
        "nemo_gym_tok_prefix_splice_rejected",
    ]
    before = {name: metric(vllm_server, name) for name in names}
    (conversation,) = play(vllm_server, [55], mode="bundles", turns=3)
    bad = httpx.post(
        f"{vllm_server.base_url}/v1/chat/completions",
        json={
            "model": vllm_server.served_model_name,
            "messages": conversation.messages,
            "required_prefix_token_ids": [-1],
        },
    )
    assert bad.status_code == 400
    after = {name: metric(vllm_server, name) for name in names}
    splices = [t.prefix_splice for t in conversation.turns[1:]]
    assert after[names[0]] - before[names[0]] == 2
    assert after[names[1]] - before[names[1]] == sum(s["template_differed"] for s in splices)
    assert after[names[2]] - before[names[2]] == sum(s["replaced_tokens"] for s in splices)
    assert after[names[3]] - before[names[3]] == 1


def test_later_turns_are_spliced_at_the_cost_of_the_new_turn(vllm_server: VLLMServer) -> None:
    """From the third turn on, the history's prompt is one this server spliced: the hook renders the new messages
    only (vLLM renders nothing) and the prompts stay contiguous; the template's own prompt of turn 1 and the splice
    of turn 2 take the full check."""
    assert_new_turn_splices(vllm_server, tools=False)


def test_later_tool_call_turns_are_spliced_at_the_cost_of_the_new_turn(vllm_server: VLLMServer) -> None:
    """The same with a forced tool call every turn, each answered by a tool result."""
    assert_new_turn_splices(vllm_server, tools=True)


def assert_new_turn_splices(server: VLLMServer, *, tools: bool) -> None:
    name = "nemo_gym_tok_prefix_splices_new_turn"
    before = metric(server, name)
    conversations = play(server, [61, 62], mode="bundles", turns=5, tools=tools)
    assert all(conversation.contiguous for conversation in conversations)
    assert metric(server, name) - before == 2 * 3


def preprocess_counts(server: VLLMServer) -> dict[str, float]:
    text = httpx.get(f"{server.base_url}/metrics").text
    return {
        path: float(count)
        for path, count in re.findall(
            r'^nemo_gym_tok_preprocess_seconds_count\{path="(\w+)"\} (\S+)$', text, re.MULTILINE
        )
    }


def test_metrics_time_preprocessing_by_path(vllm_server: VLLMServer) -> None:
    """The histogram counts each chat request once, under the path it took: spliced, stock templating, vLLM's
    token-reuse path, or refused."""
    before = preprocess_counts(vllm_server)
    (conversation,) = play(vllm_server, [56], mode="bundles", turns=3)  # 1 templated, 2 spliced
    plain = [{k: v for k, v in m.items() if k not in BUNDLE_FIELDS} for m in conversation.messages]
    url, model = f"{vllm_server.base_url}/v1/chat/completions", vllm_server.served_model_name
    token_in = httpx.post(
        url,
        json={
            "model": model,
            "messages": plain,
            "max_tokens": 1,
            "kv_transfer_params": {"prompt_token_ids": conversation.turns[-1].prompt_token_ids},
        },
    )
    refused = httpx.post(
        url, json={"model": model, "messages": conversation.messages, "required_prefix_token_ids": [-1]}
    )
    assert token_in.status_code == 200 and refused.status_code == 400
    after = preprocess_counts(vllm_server)
    grown = {path: after.get(path, 0.0) - before.get(path, 0.0) for path in after}
    assert grown == {**{path: 0.0 for path in grown}, "template": 1, "spliced": 2, "token_in": 1, "refused": 1}


@pytest.fixture(scope="module")
def two_turns(vllm_server: VLLMServer) -> Conversation:
    (conversation,) = play(vllm_server, [3], mode="bundles", turns=2)
    return conversation


def with_assistant(conversation: Conversation, **changes) -> list[dict]:
    messages = [dict(m) for m in conversation.messages[:2]] + [{"role": "user", "content": "and?"}]
    messages[1].update(changes)
    for key, value in list(messages[1].items()):
        if value is None:
            del messages[1][key]
    return messages


MALFORMED = [
    ({"prompt_token_ids": [1, True]}, "messages[1].prompt_token_ids[1] must be an int token id, got True"),
    ({"generation_token_ids": [-5]}, "messages[1].generation_token_ids[0] must be non-negative, got -5"),
    ({"prompt_token_ids": [1, "2"]}, "messages[1].prompt_token_ids[1] must be an int token id, got '2'"),
    (
        {"generation_token_ids": [999999]},
        "messages[1].generation_token_ids[0] = 999999 is out of vocabulary (size 151936)",
    ),
    ({"generation_log_probs": None}, "messages[1]: token bundle is all or none; generation_log_probs missing"),
]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/tokenize"])
@pytest.mark.parametrize("changes, message", MALFORMED)
def test_malformed_bundles_are_400(vllm_server: VLLMServer, two_turns: Conversation, path, changes, message) -> None:
    body = {"model": vllm_server.served_model_name, "messages": with_assistant(two_turns, **changes), "max_tokens": 2}
    answer = httpx.post(f"{vllm_server.base_url}{path}", json=body, timeout=60)
    assert answer.status_code == 400, answer.text
    assert message in answer.json()["error"]["message"]


@pytest.mark.parametrize(
    "prefix, message",
    [
        ("1,2", "required_prefix_token_ids must be a list of token ids, got str"),
        ([1.5], "required_prefix_token_ids[0] must be an int token id, got 1.5"),
        ([2**40], "is out of vocabulary"),
    ],
)
def test_malformed_required_prefix_is_400(vllm_server: VLLMServer, two_turns: Conversation, prefix, message) -> None:
    body = {
        "model": vllm_server.served_model_name,
        "messages": with_assistant(two_turns),
        "required_prefix_token_ids": prefix,
    }
    answer = httpx.post(f"{vllm_server.base_url}/v1/chat/completions", json=body, timeout=60)
    assert answer.status_code == 400, answer.text
    assert message in answer.json()["error"]["message"]


def test_stale_prefix_is_400(vllm_server: VLLMServer, two_turns: Conversation) -> None:
    turn = two_turns.turns[1]  # the prefix of turn 2 does not belong to the turn-1 history sent here
    body = {
        "model": vllm_server.served_model_name,
        "messages": with_assistant(two_turns),
        "required_prefix_token_ids": turn.prompt_token_ids + turn.generation_token_ids,
    }
    answer = httpx.post(f"{vllm_server.base_url}/v1/chat/completions", json=body, timeout=60)
    assert answer.status_code == 400
    assert "stale prefix" in answer.json()["error"]["message"]


def test_requests_without_prefix_behave_as_stock(vllm_server: VLLMServer) -> None:
    body = {
        "model": vllm_server.served_model_name,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 3,
        "return_token_ids": True,
        "seed": 1,
    }
    answer = httpx.post(f"{vllm_server.base_url}/v1/chat/completions", json=body, timeout=60).json()
    assert "prefix_splice" not in answer
    assert "prompt_token_ids" not in answer["choices"][0]["message"]  # no logprobs asked: no bundle added
    tokens = httpx.post(f"{vllm_server.base_url}/tokenize", json={**body, "add_generation_prompt": True}).json()[
        "tokens"
    ]
    assert tokens == answer["prompt_token_ids"]
