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

from nemo_gym_tok.splice import (
    PrefixSource,
    TemplateProfile,
    find_prefix_source,
    splice_prefix,
)
from nemo_gym_tok.splice._render import ChatRenderer

WORDS = (
    "the", "model", "said", "ok", "Paris", "42", "  spaced", "\n", "\n\n", "tab\t", "naïve", "日本語", "emoji🙂", "x=1;",
    "{\"k\": 2}", "</", "<|", "|>", "end", "assistant", "user", ".", ",", "?", "-", "'", "```", "def f():",
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
            message["tool_calls"] = [{
                "id": f"call_{turn}", "type": "function",
                "function": {"name": "lookup", "arguments": json.dumps({"word": word})},
            }]
        message.update(prompt_token_ids=prompt, generation_token_ids=generation, generation_log_probs=[0.0] * len(generation))
        episode.messages.append(message)
        episode.turns.append(ModelTurn(prompt, generation, ended))
        if calls:
            episode.messages.append({"role": "tool", "tool_call_id": f"call_{turn}", "content": "found: " + _text(rng, renderer, False, 4)})
        else:
            episode.messages.append({"role": "user", "content": "Next: " + _text(rng, renderer, False, 6)})
        source = find_prefix_source(episode.messages)
        assert source is not None
        full_text = renderer.render(episode.messages, add_generation_prompt=True)
        result = splice_prefix(renderer, profile, episode.messages, source, template_text=full_text)
        check_splice(renderer, profile, episode.messages, source, result.prompt_token_ids, result.kept_prefix_length)
        episode.telemetry.append(result.telemetry())
        episode.checked_by_text.append(result.checked_by_text)
        prompt = result.prompt_token_ids
    return episode


def check_splice(
    renderer: ChatRenderer, profile: TemplateProfile, messages: Sequence[dict[str, Any]], source: PrefixSource,
    spliced: list[int], kept: int,
) -> None:
    """The oracle: the result starts with the prefix (its final end token may give way to the template's closing),
    and the rest is the end of the template's own ids for the messages, holding every later message's text."""
    prefix = source.prefix
    if spliced[:kept] != prefix[:kept]:
        raise WrongSplice("the spliced prompt does not start with the model's prefix")
    if kept < len(prefix) - 1 or (kept == len(prefix) - 1 and prefix[-1] not in profile.end_token_ids | profile.closer_ids()):
        raise WrongSplice(f"the splice dropped prefix ids that are not a final end token ({len(prefix) - kept} dropped)")
    tail = spliced[kept:]
    if profile.moves_call_text:  # the text of a tool-calling turn lives in the model's ids, before the call
        messages = [{**m, "content": ""} if m.get("role") == "assistant" and m.get("tool_calls") else m for m in messages]
    full_text = renderer.render(list(messages), add_generation_prompt=True)
    full_ids = renderer.encode(full_text)
    if profile.closed_by_text:  # the template's own tokenization may merge across the turn's end: compare text
        if not full_text.endswith(renderer.decode(tail)):
            raise WrongSplice("the text after the prefix is not the end of the template's text for the messages")
    elif tail and full_ids[len(full_ids) - len(tail):] != tail:
        raise WrongSplice("the ids after the prefix are not the end of the template's ids for the messages")
    tail_text = renderer.decode(tail)
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
