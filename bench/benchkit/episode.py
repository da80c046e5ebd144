"""A synthetic long episode of model calls, each with the token bundle of the call before it."""

from __future__ import annotations

import json
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson

from benchkit.server import CONTEXT, JSON_HEADERS, MODEL, BenchError, bench_model
from nemo_gym_tok.common.exact_json import loads_exact

GENERATED_PER_TURN = 232
"""Synthetic model ids per assistant turn: 253 prompt ids a turn with the user message and the template's markup, so
call 128 of an episode holds about 32.3k ids, just inside the 32,768-position limit."""

ANY_ID_SHARE = 0.05
"""Share of a synthetic turn's ids drawn from the whole vocabulary instead of plain words: some turns then drift."""

KINDS = ("words", "random", "tools", "reasoning", "mixed")
"""What a synthetic history's assistant turns hold:
  words      plain words but for ANY_ID_SHARE of any kind, cut by max_tokens (the bench's one history until now);
  random     text decoded from ids of any kind: byte soup that re-tokenizes to other ids (drift-prone);
  tools      a few words, then a tool call (Qwen's <tool_call> JSON) and <|im_end|>, answered by a tool message;
  reasoning  <think> words </think>, then words and <|im_end|>: the template drops the reasoning of earlier turns,
             the spliced prompt keeps the ids the model saw;
  mixed      each turn one of the four, drawn at random."""

DEFAULT_HISTORIES = ("words-0", "random-1", "tools-2", "reasoning-3", "mixed-4")
"""The histories P1a and P2 measure per size (kind-seed); the first is the words episode of earlier runs."""

LOOKUP_TOOL = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "Look a term up in the plan's notes.",
        "parameters": {
            "type": "object",
            "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}},
            "required": ["query"],
        },
    },
}


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
    fields: dict[str, Any] = field(default_factory=dict)
    """Request fields besides the messages that every variant sends alike (the tools of a history with tool calls)."""

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
        return Call(self.number, self.bundled[:-1] + [last], self.plain[:-1] + [last], ids, self.fields)

    def chat(self, variant: str, **fields: Any) -> dict[str, Any]:
        """The chat-completion body of `variant`: hook (bundle), stock (no bundle) or token_in (no bundle, the spliced
        ids in kv_transfer_params: vLLM's own token reuse, no templating)."""
        if variant == "hook":
            return {"model": MODEL, "messages": self.bundled, **self.fields, **fields}
        if variant == "stock":
            return {"model": MODEL, "messages": self.plain, **self.fields, **fields}
        if variant == "token_in":
            return {
                "model": MODEL,
                "messages": self.plain,
                "kv_transfer_params": {"prompt_token_ids": self.prompt_ids},
                **self.fields,
                **fields,
            }
        raise ValueError(variant)


def word_ids(tokenizer: Any) -> list[int]:
    """Ids of plain words with a leading space (` plan`, ` River`): model-like text, which re-tokenizes to the same ids
    (random ids of any kind decode to byte soup that re-tokenizes some 4% longer)."""
    tokens = tokenizer.convert_ids_to_tokens(list(range(1000, 150000)))
    return [1000 + i for i, token in enumerate(tokens) if re.fullmatch(r"\u0120[A-Za-z]{2,12}", token or "")]


def parse_history(name: str) -> tuple[str, int]:
    """ "kind-seed" (e.g. tools-2) as (kind, seed); a clear error for anything else."""
    kind, _, seed = name.rpartition("-")
    if kind not in KINDS or not seed.isdigit():
        raise BenchError(f"history {name!r}: expected KIND-SEED with KIND one of {', '.join(KINDS)} (e.g. tools-2)")
    return kind, int(seed)


@dataclass
class _Turn:
    """One synthetic assistant turn: the ids the model generated, its message, and what follows it."""

    generation: list[int]
    message: dict[str, Any]
    after: list[dict[str, Any]]


class _Writer:
    """Synthetic assistant turns of one history kind, from one random stream."""

    def __init__(self, tokenizer: Any, kind: str, seed: int, generated_per_turn: int) -> None:
        self.tokenizer, self.kind, self.per_turn = tokenizer, kind, generated_per_turn
        self.rng = random.Random(seed)
        self.vocabulary = word_ids(tokenizer)
        self.im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")

    def ids(self, count: int, any_share: float) -> list[int]:
        rng = self.rng
        return [
            rng.choice(self.vocabulary) if rng.random() >= any_share else rng.randrange(1000, 150000)
            for _ in range(count)
        ]

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def turn(self, number: int) -> _Turn:
        kind = self.kind
        if kind == "mixed":
            kind = self.rng.choice(KINDS[:-1])
        if kind in ("words", "random"):
            generation = self.ids(self.per_turn, ANY_ID_SHARE if kind == "words" else 1.0)
            return _Turn(generation, {"role": "assistant", "content": self.tokenizer.decode(generation)}, [])
        if kind == "tools":
            arguments = {"query": self.tokenizer.decode(self.ids(4, 0.0)).strip(), "limit": self.rng.randrange(1, 9)}
            call = self.encode(
                "\n<tool_call>\n" + json.dumps({"name": "lookup", "arguments": arguments}) + "\n</tool_call>"
            )
            words = self.ids(max(8, self.per_turn - len(call) - 1), ANY_ID_SHARE)
            tool_call = {
                "id": f"call_{number}",
                "type": "function",
                "function": {"name": "lookup", "arguments": json.dumps(arguments)},
            }
            message = {"role": "assistant", "content": self.tokenizer.decode(words), "tool_calls": [tool_call]}
            answer = {"role": "tool", "tool_call_id": f"call_{number}", "content": f"{arguments['limit']} notes found"}
            return _Turn(words + call + [self.im_end], message, [answer])
        opening, closing = self.encode("<think>\n"), self.encode("\n</think>\n\n")
        thought = self.ids(self.per_turn // 2, ANY_ID_SHARE)
        words = self.ids(max(8, self.per_turn - len(thought) - len(opening) - len(closing) - 1), ANY_ID_SHARE)
        message = {
            "role": "assistant",
            "content": self.tokenizer.decode(words),
            "reasoning_content": self.tokenizer.decode(thought),
        }
        return _Turn(opening + thought + closing + words + [self.im_end], message, [])


def build_episode(
    url: str,
    calls: int,
    *,
    generated_per_turn: int = GENERATED_PER_TURN,
    kind: str = "words",
    seed: int = 0,
    limit: int = CONTEXT - 8,
) -> list[Call]:
    """One episode of up to `calls` model calls, grown as the gym grows it: each call's assistant answer is about
    `generated_per_turn` random ids of the history `kind` (KINDS), decoded to its text (so some turns re-tokenize to
    other ids, as real histories drift), whose bundle (the call's spliced prompt + those ids) rides on that message in
    the next request, and only there. Stops early where a prompt, spliced or stock, would pass `limit` ids. Needs the
    hooked server: each call's prompt is its `/tokenize` with the bundle. The words kind with seed 0 is the episode of
    earlier runs, id for id."""
    from transformers import AutoTokenizer

    if kind not in KINDS:
        raise BenchError(f"unknown history kind {kind!r}: one of {', '.join(KINDS)}")
    writer = _Writer(AutoTokenizer.from_pretrained(bench_model()), kind, seed, generated_per_turn)
    # tool_choice "none": "auto" needs a tool-call parser on the server; the template renders the tools all the same.
    fields = {"tools": [LOOKUP_TOOL], "tool_choice": "none"} if kind in ("tools", "mixed") else {}
    episode: list[Call] = []
    plain: list[dict[str, Any]] = [user_message(0)]
    bundled = list(plain)
    with httpx.Client(base_url=url, timeout=600) as http:
        for number in range(1, calls + 1):
            if episode:
                previous = episode[-1]
                turn = writer.turn(number)
                bundle = {
                    "prompt_token_ids": previous.prompt_ids,
                    "generation_token_ids": turn.generation,
                    "generation_log_probs": [0.0] * len(turn.generation),
                }
                following = turn.after + [user_message(number - 1)]
                bundled = plain + [turn.message | bundle] + following
                plain = plain + [turn.message] + following
            prompt = tokenize(http, bundled, fields)
            if len(prompt) >= limit or len(tokenize(http, plain, fields)) >= limit:
                break
            episode.append(Call(number, bundled, plain, prompt, fields))
    return episode


def tokenize(http: httpx.Client, messages: list[dict[str, Any]], fields: dict[str, Any] | None = None) -> list[int]:
    answer = http.post(
        "/tokenize",
        content=orjson.dumps(
            {"model": MODEL, "messages": messages, "add_generation_prompt": True, **tokenize_fields(fields or {})}
        ),
        headers=JSON_HEADERS,
    )
    if answer.status_code != 200:
        raise BenchError(f"/tokenize answered HTTP {answer.status_code}: {answer.text[:500]}")
    return list(loads_exact(answer.content)["tokens"])


def tokenize_fields(fields: dict[str, Any]) -> dict[str, Any]:
    """The request fields `/tokenize` takes for the prompt (the tools); the others only matter to generation."""
    return {key: value for key, value in fields.items() if key == "tools"}


def calls_for(history_ids: int, generated_per_turn: int = GENERATED_PER_TURN) -> int:
    """Calls an episode needs to reach about `history_ids` (a little over; 128 at most, the 32k episode)."""
    return max(2, min(128, history_ids // (generated_per_turn + 21) + 3))


def nearest_calls(episode: Sequence[Call], targets: Sequence[int]) -> list[Call]:
    """Per target history size (ids), the call of `episode` whose prompt is closest to it."""
    return [min(episode, key=lambda call: abs(call.history_ids - target)) for target in targets]
