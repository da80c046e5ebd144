"""The splice done in the adapter against a stock vLLM (no plugin), driven by the OpenAI SDK: contiguous ids, the
same ids as the hook gives, refusals, and `splice: auto` choosing per server."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from openai import AsyncOpenAI, BadRequestError, OpenAI

from nemo_gym_tok.types.tokens import BUNDLE_FIELDS
from nemo_gym_tok.vllm_server import VLLMServer
from responses_api_models.vllm_model.tests.conftest import adapter
from tests.conversations import MOVE_TOOL, turn_settings

SEEDS = range(10)


@pytest.fixture(scope="module")
def adapter_on_stock(plain_vllm_server: VLLMServer) -> Iterator[str]:
    yield from adapter(
        plain_vllm_server.base_url,
        plain_vllm_server.served_model_name,
        return_token_id_information=True,
        splice="adapter",
    )


@pytest.fixture(scope="module")
def auto_on_stock(plain_vllm_server: VLLMServer) -> Iterator[str]:
    yield from adapter(
        plain_vllm_server.base_url, plain_vllm_server.served_model_name, return_token_id_information=True
    )


@pytest.fixture(scope="module")
def auto_on_hooked(vllm_server: VLLMServer) -> Iterator[str]:
    yield from adapter(vllm_server.base_url, vllm_server.served_model_name, return_token_id_information=True)


@dataclass
class SdkConversation:
    seed: int
    messages: list[dict[str, Any]] = field(default_factory=list)
    prompts: list[list[int]] = field(default_factory=list)
    generations: list[list[int]] = field(default_factory=list)
    telemetry: list[dict[str, Any] | None] = field(default_factory=list)
    tool_calls: int = 0

    def contiguous(self) -> bool:
        return all(
            later[: len(prompt) + len(generation)] == prompt + generation
            for prompt, generation, later in zip(self.prompts, self.generations, self.prompts[1:])
        )


async def converse(url: str, seed: int, *, turns: int = 4, mode: str = "bundles") -> SdkConversation:
    """A seeded conversation through the adapter with the OpenAI SDK: odd turns call a tool (tool_choice required),
    even turns answer in text; history goes back with the bundles (or, mode "prefix", as required_prefix_token_ids)."""
    client = AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)
    conversation = SdkConversation(seed)
    messages = conversation.messages
    messages.append({"role": "system", "content": f"You steer robot {seed}."})
    previous: list[int] | None = None
    try:
        for turn in range(turns):
            if turn % 2 == 0:
                messages.append({"role": "user", "content": f"Robot {seed}, turn {turn}: where next?"})
            extra: dict[str, Any] = {"seed": seed * 100 + turn}
            options: dict[str, Any] = {"tools": [MOVE_TOOL]}
            if turn % 2 == 1:
                options.update(tool_choice="required", parallel_tool_calls=False, max_tokens=60)
            else:
                settings = turn_settings(turn)
                options["max_tokens"] = settings["max_tokens"]
                extra.update({key: value for key, value in settings.items() if key != "max_tokens"})
            if mode == "prefix" and previous is not None:
                extra["required_prefix_token_ids"] = previous
            completion = await client.chat.completions.create(
                model="policy", messages=messages, temperature=1.0, extra_body=extra, **options
            )
            message = completion.choices[0].message.model_dump(exclude_none=True)
            conversation.prompts.append(message["prompt_token_ids"])
            conversation.generations.append(message["generation_token_ids"])
            conversation.telemetry.append(message.get("prefix_splice"))
            kept = {key: value for key, value in message.items() if key in ("role", "content", "tool_calls")}
            kept.setdefault("content", "")
            if mode == "bundles":
                kept.update({key: message[key] for key in BUNDLE_FIELDS})
            messages.append(kept)
            for call in message.get("tool_calls") or []:
                conversation.tool_calls += 1
                steps = json.loads(call["function"]["arguments"]).get("steps")
                messages.append({"role": "tool", "tool_call_id": call["id"], "content": f"moved {steps}"})
            previous = message["prompt_token_ids"] + message["generation_token_ids"]
    finally:
        await client.close()
    return conversation


def play(url: str, seeds: range, **options: Any) -> list[SdkConversation]:
    async def all_of_them() -> list[SdkConversation]:
        return await asyncio.gather(*(converse(url, seed, **options) for seed in seeds))

    return asyncio.run(all_of_them())


def test_adapter_splice_on_stock_vllm_is_contiguous_with_tool_calls(adapter_on_stock: str) -> None:
    conversations = play(adapter_on_stock, SEEDS)
    broken = [c.seed for c in conversations if not c.contiguous()]
    assert broken == [], f"not contiguous: {broken}"
    assert all(c.tool_calls >= 2 for c in conversations)  # both tool turns made a real call
    later = [t for c in conversations for t in c.telemetry[1:]]
    assert all(t is not None and t["applied"] and t["spliced_by"] == "adapter" for t in later)
    repaired = sum(t["template_differed"] for t in later)
    print(
        f"\nadapter splice on stock vLLM: {len(conversations)}/{len(conversations)} conversations contiguous "
        f"({sum(c.tool_calls for c in conversations)} tool calls); {repaired}/{len(later)} turns repaired"
    )
    assert repaired > 0  # the random model's text re-tokenizes differently: the splice did real work


def test_explicit_prefix_mode_is_contiguous(adapter_on_stock: str) -> None:
    conversations = play(adapter_on_stock, range(20, 23), mode="prefix")
    assert all(c.contiguous() for c in conversations)


def test_adapter_gives_the_same_ids_as_the_hook(auto_on_stock: str, auto_on_hooked: str) -> None:
    by_adapter = play(auto_on_stock, range(40, 50))
    by_hook = play(auto_on_hooked, range(40, 50))
    assert all(c.contiguous() and c.tool_calls >= 2 for c in by_adapter)
    for adapter_side, hook_side in zip(by_adapter, by_hook):
        assert adapter_side.prompts == hook_side.prompts, adapter_side.seed
        assert adapter_side.generations == hook_side.generations, adapter_side.seed
    # splice: auto found the hook on one server and not on the other.
    assert {t["spliced_by"] for c in by_adapter for t in c.telemetry[1:]} == {"adapter"}
    assert {t["spliced_by"] for c in by_hook for t in c.telemetry[1:]} == {"hook"}


def test_prefix_that_does_not_fit_is_refused(adapter_on_stock: str) -> None:
    (conversation,) = play(adapter_on_stock, range(60, 61), turns=2)
    client = OpenAI(base_url=f"{adapter_on_stock}/v1", api_key="unused", max_retries=0)
    edited = [{**conversation.messages[0], "content": "You steer another robot."}, *conversation.messages[1:]]
    edited.append({"role": "user", "content": "And now?"})
    with pytest.raises(BadRequestError) as refused:
        client.chat.completions.create(model="policy", messages=edited, max_tokens=4)
    assert "messages[0]" in str(refused.value)
    with pytest.raises(BadRequestError) as empty:
        client.chat.completions.create(
            model="policy",
            messages=[*conversation.messages, {"role": "user", "content": "?"}],
            max_tokens=4,
            extra_body={"required_prefix_token_ids": []},
        )
    assert "empty" in str(empty.value)


def test_a_local_template_unlike_the_servers_is_refused(plain_vllm_server: VLLMServer) -> None:
    other_template = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    for url in adapter(
        plain_vllm_server.base_url,
        plain_vllm_server.served_model_name,
        return_token_id_information=True,
        splice="adapter",
        chat_template=other_template,
    ):
        (conversation,) = play(url, range(61, 62), turns=1)
        answer = httpx.post(
            f"{url}/v1/chat/completions",
            timeout=300,
            json={
                "model": "policy",
                "messages": [*conversation.messages, {"role": "user", "content": "?"}],
                "max_tokens": 4,
            },
        )
        assert answer.status_code == 502, answer.text
        error = answer.json()["error"]
        assert error["type"] == "adapter_template_mismatch"
        assert "does not render prompts as the vLLM server does" in error["message"]
