"""Drift-prone multi-turn episodes played through the pure splice, with an oracle that judges every spliced prompt.

A simulated model answers each turn with ids that decode to its text but are not the tokenizer's canonical ids
(random cuts before tokenizing, as sampling produces), so the template's re-tokenized history drifts from them.
Turns end on one of the model's end tokens or are cut as by max_tokens. The oracle does not reuse the splice's own
reasoning: it checks the result against the real (not neutral) rendering and the messages' text.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from nemo_gym_tok.common.exact_json import loads_exact
from nemo_gym_tok.splice import (
    ChatRenderer,
    PrefixSource,
    TemplateProfile,
    find_prefix_source,
    splice_prompt,
)

WORDS = (
    "the",
    "model",
    "said",
    "ok",
    "Paris",
    "42",
    "  spaced",
    "\n",
    "\n\n",
    "tab\t",
    "naïve",
    "日本語",
    "emoji🙂",
    "x=1;",
    '{"k": 2}',
    "</",
    "<|",
    "|>",
    "end",
    "assistant",
    "user",
    ".",
    ",",
    "?",
    "-",
    "'",
    "```",
    "def f():",
)
TOOL = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "Look a word up.",
        "parameters": {"type": "object", "properties": {"word": {"type": "string"}}, "required": ["word"]},
    },
}


@dataclass
class ModelTurn:
    prompt_token_ids: list[int]
    generation_token_ids: list[int]
    ended: bool


@dataclass
class Episode:
    messages: list[dict[str, Any]] = field(default_factory=list)
    turns: list[ModelTurn] = field(default_factory=list)
    telemetry: list[dict[str, Any]] = field(default_factory=list)
    checked_by_text: list[bool] = field(default_factory=list)
    """Per splice, whether the structural check was proven by text (no tokenization of the history)."""
    new_turn: list[bool] = field(default_factory=list)
    """Per splice, whether it rendered the new messages only (a renderer with a memo: splice._new_turn)."""


class WrongSplice(AssertionError):
    """The splice returned a prompt the oracle proves wrong."""


@dataclass
class EpisodeSettings:
    turns: int = 4
    tools: bool = False
    reasoning: bool = False
    system: bool = True
    spelled_specials: bool = True
    """Let the model's text spell special tokens (turn terminators included) as plain text."""


def play_episode(
    renderer: ChatRenderer, profile: TemplateProfile, rng: random.Random, settings: EpisodeSettings
) -> Episode:
    """Play `settings.turns` model turns; each later prompt is the splice's, checked by `check_splice`.

    Raises SpliceError when the splice refuses and WrongSplice when the oracle finds a wrong result.
    """
    episode = Episode()
    if settings.system:
        episode.messages.append({"role": "system", "content": "You answer briefly. " + _text(rng, renderer, False, 6)})
    episode.messages.append({"role": "user", "content": "Question: " + _text(rng, renderer, False, 8)})
    prompt = renderer.encode(renderer.render(episode.messages, add_generation_prompt=True))
    for turn in range(settings.turns):
        calls = settings.tools and rng.random() < 0.6
        content = _text(rng, renderer, settings.spelled_specials, rng.randint(1, 12))
        if calls and rng.random() < 0.5:
            content = ""  # a model that answers with a tool call alone
        ended = rng.random() < 0.6
        generation = _drifting_ids(renderer, content or "<call>", rng)
        if ended:
            generation.append(_end_token(profile, rng, calls, renderer))
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if settings.reasoning:
            message["reasoning_content"] = _text(rng, renderer, settings.spelled_specials, 5)
        if calls:
            word = _text(rng, renderer, settings.spelled_specials, 2)
            message["tool_calls"] = [
                {
                    "id": f"call_{turn}",
                    "type": "function",
                    "function": {"name": "lookup", "arguments": json.dumps({"word": word})},
                }
            ]
        message.update(
            prompt_token_ids=prompt, generation_token_ids=generation, generation_log_probs=[0.0] * len(generation)
        )
        episode.messages.append(message)
        episode.turns.append(ModelTurn(prompt, generation, ended))
        if calls:
            episode.messages.append(
                {"role": "tool", "tool_call_id": f"call_{turn}", "content": "found: " + _text(rng, renderer, False, 4)}
            )
        else:
            episode.messages.append({"role": "user", "content": "Next: " + _text(rng, renderer, False, 6)})
        source = find_prefix_source(episode.messages)
        assert source is not None
        full_text = renderer.render(episode.messages, add_generation_prompt=True)
        spliced = splice_prompt(renderer, profile, episode.messages, source, template_text=full_text)
        result = spliced.result()
        episode.new_turn.append(spliced.new_turn)
        check_splice(renderer, profile, episode.messages, source, result.prompt_token_ids, result.kept_prefix_length)
        episode.telemetry.append(result.telemetry())
        episode.checked_by_text.append(result.checked_by_text)
        prompt = result.prompt_token_ids
    return episode


def check_splice(
    renderer: ChatRenderer,
    profile: TemplateProfile,
    messages: Sequence[dict[str, Any]],
    source: PrefixSource,
    spliced: list[int],
    kept: int,
) -> None:
    """The oracle: the result starts with the prefix (its final end token may give way to the template's closing),
    and the rest is the template's own text after that assistant message, character for character.

    Where the rest starts is read from the template's rendering of the messages with the prefix's message marked
    (its model-written text replaced by a marker), not from the splice's reasoning: the text between the marker and
    the tail is the junction. A turn that kept the model's end token may skip what the template writes before its
    closing (the model's ids are the turn), but nothing after it; any other turn (cut by max_tokens, or whose end
    token gave way to the template's closing) continues with exactly the template's text after the message,
    whitespace included. A tool-calling turn's junction may hold the call syntax, which the model writes itself."""
    prefix = source.prefix
    if spliced[:kept] != prefix[:kept]:
        raise WrongSplice("the spliced prompt does not start with the model's prefix")
    if kept < len(prefix) - 1 or (
        kept == len(prefix) - 1 and prefix[-1] not in profile.end_token_ids | profile.closer_ids()
    ):
        raise WrongSplice(
            f"the splice dropped prefix ids that are not a final end token ({len(prefix) - kept} dropped)"
        )
    tail = spliced[kept:]
    if profile.moves_call_text:  # the text of a tool-calling turn lives in the model's ids, before the call
        messages = [
            {**m, "content": ""} if m.get("role") == "assistant" and m.get("tool_calls") else m for m in messages
        ]
    full_text = renderer.render(list(messages), add_generation_prompt=True)
    tail_text = renderer.decode(tail)
    if not full_text.endswith(tail_text):
        raise WrongSplice("the text after the prefix is not the end of the template's text for the messages")
    if tail != renderer.encode(tail_text):
        raise WrongSplice("the ids after the prefix are not the tokenizer's ids for the template's text")
    if any(tail_text.startswith(token) for token in renderer.added_tokens):
        # A tail opening on an added token is tokenized the same way inside the whole prompt (tokenizers split at
        # added tokens first); a tail opening on text is tokenized on its own by design (the model's ids before it
        # stand for the text the whole prompt's tokenization would merge it with).
        full_ids = renderer.encode(full_text)
        if full_ids[len(full_ids) - len(tail) :] != tail:
            raise WrongSplice("the ids after the prefix are not the end of the template's ids for the messages")
    kept_end = kept == len(prefix) or spliced[kept : kept + 1] == prefix[-1:]
    _check_junction(renderer, profile, messages, source, tail_text, kept_end=kept_end)
    for later in messages[source.message_index + 1 :]:
        text = later.get("content")
        rendered = isinstance(text, str) and text.strip() and text.strip() in full_text
        if rendered and text.strip() not in tail_text:
            raise WrongSplice(f"the ids after the prefix leave out a later message's text: {text[:40]!r}")
    own = messages[source.message_index].get("content")
    plain = own if isinstance(own, str) else ""
    for token in renderer.added_tokens:
        plain = plain.replace(token, " ")
    later_texts = [m.get("content") for m in messages[source.message_index + 1 :] if isinstance(m.get("content"), str)]
    repeats = own.strip() and tail_text.count(own.strip()) > sum(text.count(own.strip()) for text in later_texts)
    if len(plain.strip()) >= 12 and plain == own and repeats:
        raise WrongSplice("the ids after the prefix render the prefix's own assistant turn again")


ORACLE_MARK = "Qzxoraclemark"
"""Stands for the prefix's message's model-written text in the oracle's marked rendering (letters only, so no
template trims or escapes it)."""


def _check_junction(
    renderer: ChatRenderer,
    profile: TemplateProfile,
    messages: Sequence[dict[str, Any]],
    source: PrefixSource,
    tail_text: str,
    *,
    kept_end: bool,
) -> None:
    """The tail starts right where the template's text after messages[a] starts (see check_splice)."""
    a = source.message_index
    for forced in (False, True):  # a tool call alone that the template does not render: mark its (empty) text
        marked = [dict(m) for m in messages]
        marked[a] = _marked(marked[a], force_content=forced)
        marked_text = renderer.render(marked, add_generation_prompt=True)
        if ORACLE_MARK in marked_text:
            break
    if not marked_text.endswith(tail_text):
        return  # the template renders what follows differently for other text of this message: nothing to anchor
    junction_start = len(marked_text) - len(tail_text)
    mark_end = marked_text.rfind(ORACLE_MARK, 0, junction_start)
    if mark_end < 0:
        raise WrongSplice(
            f"the tail starts before the template's rendering of messages[{a}]'s text ends (or where the template "
            "does not render it): the splice joined the model's ids to the wrong place of the template's text"
        )
    junction = marked_text[mark_end + len(ORACLE_MARK) : junction_start]
    if ORACLE_MARK in junction or any(m.get("content") and m["content"] in junction for m in messages[a + 1 :]):
        raise WrongSplice(
            f"the template's text between messages[{a}] and the tail holds other messages' text: {junction!r}"
        )
    closings = [renderer.decode([token]) for token in profile.end_token_ids | profile.closer_ids()]
    closing_at = min((junction.find(c) for c in closings if c and c in junction), default=-1)
    if kept_end and source.prefix[-1] in profile.end_token_ids:
        # The model closed its turn: what the template writes before its closing is the model's to write, but the
        # tail must hold everything after that closing.
        if closing_at >= 0:
            closing = next(c for c in closings if c and junction.startswith(c, closing_at))
            if junction[closing_at + len(closing) :]:
                raise WrongSplice(
                    f"the tail leaves out {junction[closing_at + len(closing) :]!r}, which the template "
                    f"writes after the closing of messages[{a}]"
                )
        return
    if messages[a].get("tool_calls") and closing_at < 0 and junction and not junction[-1].isspace():
        return  # the call's own syntax after its last argument: the model writes it
    if junction:
        raise WrongSplice(
            f"the template's text after messages[{a}] starts with {junction!r}, which the tail leaves out: a turn "
            "without the model's closing continues with the template's text right after the message's text"
        )


def _marked(message: dict[str, Any], *, force_content: bool = False) -> dict[str, Any]:
    """`message` with its model-written text (content, reasoning, tool-call argument values) replaced by the mark."""
    marked = dict(message)
    if isinstance(marked.get("content"), str) and (marked["content"] or force_content):
        marked["content"] = ORACLE_MARK
    for key in ("reasoning_content", "reasoning"):
        if marked.get(key):
            marked[key] = ORACLE_MARK
    if marked.get("tool_calls"):
        calls = []
        for call in marked["tool_calls"]:
            function = dict(call["function"])
            arguments = function["arguments"]
            arguments = loads_exact(arguments) if isinstance(arguments, str) else arguments
            function["arguments"] = json.dumps({key: ORACLE_MARK for key in arguments})
            calls.append({**call, "function": function})
        marked["tool_calls"] = calls
    return marked


def _text(rng: random.Random, renderer: ChatRenderer, spelled_specials: bool, words: int) -> str:
    pool = list(WORDS)
    if spelled_specials:
        pool += list(renderer.special_tokens)[:12]
    return " ".join(rng.choice(pool) for _ in range(words)).strip() or "ok"


def _drifting_ids(renderer: ChatRenderer, text: str, rng: random.Random) -> list[int]:
    """Ids that decode to `text` but are cut where a sampler might have cut it, with special tokens kept as text."""
    specials = sorted(renderer.added_tokens, key=len, reverse=True)
    ids: list[int] = []
    position = 0
    while position < len(text):
        end = min(len(text), position + rng.randint(1, 6))
        piece = text[position:end]
        # Spelled-out special tokens stay text: cut them so the tokenizer cannot match them as added tokens.
        if any(token in piece or any(piece.endswith(token[:k]) for k in range(1, len(token))) for token in specials):
            end = position + 1
            piece = text[position:end]
        ids.extend(renderer.encode(piece))
        position = end
    if renderer.decode(ids) != text:  # byte-level pieces cut inside a character: take the canonical ids
        return renderer.encode(text) if not any(token in text for token in specials) else _char_ids(renderer, text)
    return ids


def _char_ids(renderer: ChatRenderer, text: str) -> list[int]:
    ids: list[int] = []
    for character in text:
        ids.extend(renderer.encode(character))
    return ids


def _end_token(profile: TemplateProfile, rng: random.Random, calls: bool, renderer: ChatRenderer) -> int:
    closers = sorted(profile.closer_ids() & profile.end_token_ids) or sorted(profile.end_token_ids)
    return rng.choice(closers)
