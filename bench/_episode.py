"""A synthetic long episode of model calls, each with the token bundle of the call before it."""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import httpx
import orjson
from _server import CONTEXT, JSON_HEADERS, MODEL, BenchError, bench_model

GENERATED_PER_TURN = 232
"""Synthetic model ids per assistant turn: 253 prompt ids a turn with the user message and the template's markup, so
call 128 of an episode holds about 32.3k ids, just inside the 32,768-position limit."""

ANY_ID_SHARE = 0.05
"""Share of a synthetic turn's ids drawn from the whole vocabulary instead of plain words: some turns then drift."""


def user_message(index: int) -> dict[str, Any]:
    return {"role": "user", "content": f"Question {index}: what comes next in the plan?"}


@dataclass
class Call:
    """The k-th model call of an episode (k from 1): the request's messages three ways and the prompt the hook gives."""

    number: int
    bundled: list[dict[str, Any]]
    """History with the bundle of the previous call on the last assistant message only (what the agent sends)."""
    plain: list[dict[str, Any]]
    """The same messages without any bundle: what stock vLLM gets."""
    prompt_ids: list[int]
    """The spliced prompt (hooked `/tokenize` of `bundled`): the ids generation uses, which token-in sends."""

    @property
    def history_ids(self) -> int:
        return len(self.prompt_ids)

    def varied(self, tokenizer: Any, round_: int) -> Call:
        """This call with its last user message ending in " (round N)": a request the server has not seen, as every
        real turn is (the hook keeps renderings it made for earlier requests, splice._memo; repeating one request
        would find its own). The spliced ids get the suffix's ids where the message's text ends."""
        suffix = f" (round {round_})"
        closing = tokenizer.encode("<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
        if self.prompt_ids[-len(closing) :] != closing:
            raise BenchError("the bench prompt does not end with the Qwen generation prompt")
        ids = self.prompt_ids[: -len(closing)] + tokenizer.encode(suffix, add_special_tokens=False) + closing
        last = {**self.bundled[-1], "content": self.bundled[-1]["content"] + suffix}
        return Call(self.number, self.bundled[:-1] + [last], self.plain[:-1] + [last], ids)

    def chat(self, variant: str, **fields: Any) -> dict[str, Any]:
        """The chat-completion body of `variant`: hook (bundle), stock (no bundle) or token_in (no bundle, the spliced
        ids in kv_transfer_params: vLLM's own token reuse, no templating)."""
        if variant == "hook":
            return {"model": MODEL, "messages": self.bundled, **fields}
        if variant == "stock":
            return {"model": MODEL, "messages": self.plain, **fields}
        if variant == "token_in":
            return {
                "model": MODEL,
                "messages": self.plain,
                "kv_transfer_params": {"prompt_token_ids": self.prompt_ids},
                **fields,
            }
        raise ValueError(variant)


def word_ids(tokenizer: Any) -> list[int]:
    """Ids of plain words with a leading space (` plan`, ` River`): model-like text, which re-tokenizes to the same ids
    (random ids of any kind decode to byte soup that re-tokenizes some 4% longer)."""
    tokens = tokenizer.convert_ids_to_tokens(list(range(1000, 150000)))
    return [1000 + i for i, token in enumerate(tokens) if re.fullmatch(r"\u0120[A-Za-z]{2,12}", token or "")]


def build_episode(
    url: str,
    calls: int,
    *,
    generated_per_turn: int = GENERATED_PER_TURN,
    seed: int = 0,
    limit: int = CONTEXT - 8,
) -> list[Call]:
    """One episode of up to `calls` model calls, grown as the gym grows it: each call's assistant answer is
    `generated_per_turn` random ids, words but for ANY_ID_SHARE of any kind (decoded to its text; so some turns
    re-tokenize to other ids, as real histories drift) whose bundle (the call's spliced prompt + those ids)
    rides on that message in the next request, and only there. Stops early where a prompt, spliced or stock, would
    pass `limit` ids. Needs the hooked server: each call's prompt is its `/tokenize` with the bundle."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(bench_model())
    vocabulary = word_ids(tokenizer)
    rng = random.Random(seed)
    episode: list[Call] = []
    plain: list[dict[str, Any]] = [user_message(0)]
    bundled = list(plain)
    with httpx.Client(base_url=url, timeout=600) as http:
        for number in range(1, calls + 1):
            if episode:
                previous = episode[-1]
                generation = [
                    rng.choice(vocabulary) if rng.random() >= ANY_ID_SHARE else rng.randrange(1000, 150000)
                    for _ in range(generated_per_turn)
                ]
                text = tokenizer.decode(generation)
                assistant = {"role": "assistant", "content": text}
                bundle = {
                    "prompt_token_ids": previous.prompt_ids,
                    "generation_token_ids": generation,
                    "generation_log_probs": [0.0] * len(generation),
                }
                bundled = plain + [assistant | bundle, user_message(number - 1)]
                plain = plain + [assistant, user_message(number - 1)]
            prompt = tokenize(http, bundled)
            if len(prompt) >= limit or len(tokenize(http, plain)) >= limit:
                break
            episode.append(Call(number, bundled, plain, prompt))
    return episode


def tokenize(http: httpx.Client, messages: list[dict[str, Any]]) -> list[int]:
    answer = http.post(
        "/tokenize",
        content=orjson.dumps({"model": MODEL, "messages": messages, "add_generation_prompt": True}),
        headers=JSON_HEADERS,
    )
    if answer.status_code != 200:
        raise BenchError(f"/tokenize answered HTTP {answer.status_code}: {answer.text[:500]}")
    return list(answer.json()["tokens"])


def calls_for(history_ids: int, generated_per_turn: int = GENERATED_PER_TURN) -> int:
    """Calls an episode needs to reach about `history_ids` (a little over; 128 at most, the 32k episode)."""
    return max(2, min(128, history_ids // (generated_per_turn + 21) + 3))


def nearest_calls(episode: Sequence[Call], targets: Sequence[int]) -> list[Call]:
    """Per target history size (ids), the call of `episode` whose prompt is closest to it."""
    return [min(episode, key=lambda call: abs(call.history_ids - target)) for target in targets]
