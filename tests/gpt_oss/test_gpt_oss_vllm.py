"""The hook on the real vLLM serving the tiny GPT-OSS through Harmony: contiguous multi-turn conversations (turns
ended on <|return|>, cut by max_tokens, forced tool calls ended on <|call|>), stock drift, refusals."""

from __future__ import annotations

import asyncio
import re
import time
from collections import Counter

import httpx
import pytest

from nemo_gym_tok.servers.http_pool import pool_limits
from nemo_gym_tok.testing.tiny_model.gpt_oss import CALL_ID, END_ID
from nemo_gym_tok.types.tokens import BUNDLE_FIELDS
from nemo_gym_tok.vllm_server import VLLMServer
from tests.gpt_oss.play import MODEL, Conversation, converse

CONVERSATIONS = 10
TURNS = 4


def _play(server: VLLMServer, seeds: range, **options) -> list[Conversation]:
    async def run() -> list[Conversation]:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=120.0, limits=pool_limits()) as http:
            return [await converse(http, seed, turns=TURNS, **options) for seed in seeds]

    return asyncio.run(run())


@pytest.fixture(scope="module")
def hooked(gpt_oss_server: VLLMServer) -> list[Conversation]:
    start = time.perf_counter()
    played = _play(gpt_oss_server, range(CONVERSATIONS), tools=False)
    played += _play(gpt_oss_server, range(100, 100 + CONVERSATIONS // 2), tools=True)
    print(f"\n{len(played)} conversations x {TURNS} turns in {time.perf_counter() - start:.1f} s")
    return played


def test_every_conversation_is_contiguous_with_the_hook(hooked: list[Conversation]) -> None:
    broken = [(c.seed, [(t.contiguous, t.prefix_splice) for t in c.turns]) for c in hooked if not c.contiguous]
    turns = [turn for conversation in hooked for turn in conversation.turns]
    later = [turn for conversation in hooked for turn in conversation.turns[1:]]
    repaired = sum(bool((turn.prefix_splice or {}).get("template_differed")) for turn in later)
    replaced = sum(bool((turn.prefix_splice or {}).get("end_token_replaced")) for turn in later)
    print(
        f"\n{len(hooked) - len(broken)} of {len(hooked)} GPT-OSS conversations contiguous; {repaired} of {len(later)} "
        f"later turns repaired, {replaced} with <|return|> given way to <|end|>; turns ended "
        f"{dict(Counter(turn.ended_on for turn in turns))}"
    )
    assert not broken, broken
    assert all((turn.prefix_splice or {}).get("applied") for turn in later)


def test_turns_end_on_return_and_are_cut_by_max_tokens(hooked: list[Conversation]) -> None:
    endings = Counter(turn.ended_on for conversation in hooked for turn in conversation.turns)
    assert endings["return"] >= CONVERSATIONS and endings["cut"] >= CONVERSATIONS, endings
    for conversation in hooked:
        for before, after in zip(conversation.turns, conversation.turns[1:]):
            spliced = after.prompt_token_ids[len(before.prompt_token_ids) + len(before.generation_token_ids) - 1]
            if before.ended_on == "return":
                # Harmony's history closes the turn with <|end|>; the model's ids up to there are kept.
                assert after.prefix_splice["end_token_replaced"] and spliced == END_ID
            elif before.ended_on == "call" and before.message.get("tool_calls"):
                # A parsed tool call is history with <|call|> too. (A call the parser did not take comes back as
                # text, which Harmony re-renders as a final message closed by <|end|>.)
                assert not after.prefix_splice.get("end_token_replaced") and spliced == CALL_ID


def test_forced_tool_calls_parse_and_end_on_call(hooked: list[Conversation]) -> None:
    tool_turns = [c.turns[1] for c in hooked if c.seed >= 100]
    parsed = [turn for turn in tool_turns if turn.message.get("tool_calls")]
    print(
        f"\nforced tool calls: {len(parsed)} of {len(tool_turns)} parsed as tool_calls; ended "
        f"{dict(Counter(turn.ended_on for turn in tool_turns))}"
    )
    assert len(parsed) >= len(tool_turns) // 2
    assert all(turn.ended_on == "call" and turn.finish_reason == "tool_calls" for turn in parsed)


def test_stock_history_drifts(gpt_oss_server: VLLMServer) -> None:
    """Without bundles the hook does nothing: Harmony re-renders the random turn with its channel header."""
    stock = _play(gpt_oss_server, range(CONVERSATIONS), mode="stock")
    drifting = sum(not conversation.turns[1].contiguous for conversation in stock)
    print(f"\nstock (no bundle): {drifting} of {len(stock)} GPT-OSS conversations drift at turn 2")
    assert drifting >= CONVERSATIONS - 1
    assert all(turn.prefix_splice is None for conversation in stock for turn in conversation.turns)


def _two_turns(gpt_oss_server: VLLMServer) -> Conversation:
    return _play(gpt_oss_server, range(7, 8))[0]


def test_edited_history_is_refused(gpt_oss_server: VLLMServer) -> None:
    conversation = _two_turns(gpt_oss_server)
    messages = [dict(message) for message in conversation.messages[:-1]]  # up to the last user message
    edited_index = next(i for i, m in enumerate(messages) if m["role"] == "user")
    messages[edited_index]["content"] += " (edited)"
    answer = httpx.post(
        f"{gpt_oss_server.base_url}/v1/chat/completions",
        timeout=60,
        json={"model": MODEL, "messages": messages, "max_tokens": 4},
    )
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == "required_prefix_token_ids"
    assert "does not belong to these messages" in error["message"] and f"messages[{edited_index}]" in error["message"]


def test_stale_bundle_is_refused(gpt_oss_server: VLLMServer) -> None:
    """The bundle of a later turn on an earlier message: the prefix holds more turns than the messages."""
    conversation = _two_turns(gpt_oss_server)
    messages = [dict(message) for message in conversation.messages]
    assistants = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    first, last = assistants[0], assistants[-1]
    for key in BUNDLE_FIELDS:
        messages[first][key] = messages[last][key]
    truncated = messages[: first + 2]
    answer = httpx.post(
        f"{gpt_oss_server.base_url}/v1/chat/completions",
        timeout=60,
        json={"model": MODEL, "messages": truncated, "max_tokens": 4},
    )
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == "required_prefix_token_ids"


def test_tokenize_refuses_a_prefix_on_a_harmony_model(gpt_oss_server: VLLMServer) -> None:
    conversation = _two_turns(gpt_oss_server)
    url = f"{gpt_oss_server.base_url}/tokenize"
    answer = httpx.post(url, json={"model": MODEL, "messages": conversation.messages}, timeout=60)
    assert answer.status_code == 400, answer.text
    assert re.search(r"Harmony.*/tokenize.*Hugging Face chat template", answer.json()["error"]["message"], re.S)
    plain = [{"role": "user", "content": "Hello"}]
    assert httpx.post(url, json={"model": MODEL, "messages": plain}, timeout=60).status_code == 200


def test_metrics_count_the_splices(gpt_oss_server: VLLMServer, hooked: list[Conversation]) -> None:
    text = httpx.get(f"{gpt_oss_server.base_url}/metrics", timeout=30).text
    spliced = re.search(r"^nemo_gym_tok_prefix_splices_total(?:\{[^}]*\})? ([0-9.e+]+)$", text, re.M)
    assert spliced and float(spliced.group(1)) >= sum(len(c.turns) - 1 for c in hooked)
