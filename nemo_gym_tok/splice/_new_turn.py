"""The splice of a next turn at the cost of the new messages: the history is proven by the prompt this server spliced
for it, and the template renders only a short conversation around the new turn.

A next turn's prefix opens with the prompt the previous call was given. Where the render memo holds that prompt for
the same messages (see _memo), the prefix's prompt part is proven by one digest, and the rest is the model's
generation. What the template writes after the turn is read from the short conversation (see _locality), once the
probes of its template scope and shape have shown that the history before the turn's context does not change it. The
short conversation is rendered twice, as the full check renders the whole one: with every text a placeholder (where
the turn's body lies; memoized by shape) and with the messages' own text (the template's text after the turn, which
must be what the placement rendering says). Nothing here renders, tokenizes or walks the history. Where any of that
cannot be shown, `splice_new_turn` returns None and the caller takes the full check, which splices or refuses with
its own reasons; a refusal about the prefix itself (an empty generation, an end token inside it) is raised here too.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from nemo_gym_tok.splice._ids import PrefixSource, check_in_vocabulary, message_field
from nemo_gym_tok.splice._locality import short_conversation, tail_is_local
from nemo_gym_tok.splice._memo import TOKEN_FIELDS, ProvenPrompt, RenderMemo, extend_ids_hash, prompt_keys
from nemo_gym_tok.splice._neutral import neutralize, placeholder_spans, with_own_tool_calls
from nemo_gym_tok.splice._prefix_check import check_generation
from nemo_gym_tok.splice._profile import TemplateProfile
from nemo_gym_tok.splice._refusals import SpliceError, UnsupportedTemplateError, raised_in_this_package
from nemo_gym_tok.splice._render import ChatRenderer
from nemo_gym_tok.splice._result import RepairedTurn, SplicedPrompt
from nemo_gym_tok.splice._structure import Layout
from nemo_gym_tok.splice._tail import (
    check_message_placement,
    check_truncation,
    fill_message_texts,
    kept_prefix,
    matched_layout,
    measure_new_turn,
)
from nemo_gym_tok.splice._template_text import body_finder
from nemo_gym_tok.splice._turn_edges import check_turn_opening, junction_length, junction_text

StageClock = Callable[[str], None]
"""Called with each stage's name as it ends."""
SPLICE_STAGES = ("history key", "proof", "short render", "tail tokenize", "prompt")
"""The stages of a next turn's splice, in order: the history's key (one digest of the messages), the proof of the
prefix's prompt part (one digest of its ids), the short conversation's renderings (with the locality probes, once
per template scope and shape), the tokenization of the template's text after the turn, the prompt's ids and their
digest for the next turn."""


def splice_new_turn(
    renderer: ChatRenderer,
    profile: TemplateProfile,
    messages: Sequence[Any],
    source: PrefixSource,
    *,
    truncate_prompt_tokens: int | None = None,
    vocab_size: int | None = None,
    clock: StageClock | None = None,
) -> SplicedPrompt | None:
    """The spliced prompt of a next turn (a generation prompt after the new messages), rendering only the short
    conversation; None where that cannot be proven, for the caller's full check to decide. `vocab_size`: the ids
    after the proven prompt are checked against it (a caller that read the prefix without the vocabulary). `clock` is
    called with the name of each stage as it ends (SPLICE_STAGES), for a server that times them."""
    tick = clock or _untimed
    a, prefix = source.message_index, source.prefix
    if getattr(renderer, "render_memo", None) is None or a < 1 or not prefix:
        return None
    if any(message_field(message, "role") == "assistant" for message in messages[a + 1 :]):
        return None
    calls = bool(message_field(messages[a], "tool_calls"))
    if profile.moves_call_text and calls and message_field(messages[a], "content"):
        return None  # the template moves the turn's text after the results: the full check handles it
    short = short_conversation(messages, a)
    if short is None:
        return None
    memo: RenderMemo = renderer.render_memo  # type: ignore[attr-defined]
    keys = prompt_keys(renderer.render_scope, messages, a)  # type: ignore[attr-defined]
    tick("history key")
    if keys is None:
        return None
    before, whole = keys
    found = memo.proven_prompt_by_key(before, prefix, source.prompt_json, source.prompt_length)
    if found is None:
        return None
    proven, prompt_hash = found
    check_generation(renderer, profile, source, proven.length)
    check_in_vocabulary(source, vocab_size, proven.length)  # the prompt part is a prompt spliced here: in it
    tick("proof")
    try:
        tail = _short_tail(renderer, profile, short, prefix, proven, calls, source, tick)
    except SpliceError:
        return None
    except Exception as exc:  # noqa: BLE001 - a template raising on the short conversation: the full check decides
        if raised_in_this_package(exc):
            raise
        return None
    if tail is None:
        return None
    ids, kept, end_replaced, tail_text, measure = tail
    spliced = prefix[:kept] + ids
    check_truncation(truncate_prompt_tokens, spliced)
    digest = extend_ids_hash(prompt_hash, prefix[proven.length : kept] + ids)
    memo.remember_prompt_by_key(whole, digest, len(spliced), tail_text, proven.checked_by_text)
    tick("prompt")
    return SplicedPrompt(
        spliced,
        kept,
        end_replaced,
        proven.checked_by_text,
        verify=lambda: None,
        measure_turn=measure,
        new_turn=True,
    )


def _short_tail(
    renderer: ChatRenderer,
    profile: TemplateProfile,
    short: tuple[list[Any], int, int, bool],
    prefix: list[int],
    proven: ProvenPrompt,
    calls: bool,
    source: PrefixSource,
    tick: StageClock,
) -> tuple[list[int], int, bool, str, Any] | None:
    """The template's ids after the turn, read from the short conversation: (those ids, how many prefix ids open the
    prompt, whether the model's end token gave way to the template's closing, the tail's text, the measurement of the
    turn); None where the short conversation cannot show them."""
    conversation, a, context_start, stand_in = short
    neutral = neutralize(conversation, a, drop_call_text=profile.moves_call_text)
    turns = [index for index in range(a + 1) if message_field(conversation[index], "role") == "assistant"]
    find = body_finder(profile, neutral)
    marked_text, marked_bodies = check_message_placement(renderer, neutral, a, turns, find, True, False)
    if not tail_is_local(renderer, neutral, a, context_start, stand_in, profile.moves_call_text):
        return None
    check_turn_opening(profile, neutral, marked_text, marked_bodies, proven.closing_text)
    own = [_template_input(message) for message in conversation]
    template_text = renderer.render(own, add_generation_prompt=True)
    layout = matched_layout(marked_text, marked_bodies, own, template_text)
    if layout is not None:
        tail_text = template_text[layout.bodies[-1].end :]
        filled = fill_message_texts(marked_text[marked_bodies[-1].end :], own, renderer.added_tokens)
        if filled != tail_text:
            return None
    else:  # the template writes some text otherwise than given: its neutral rendering says where the turn ends
        neutral_text = renderer.render(neutral, add_generation_prompt=True)
        layout = Layout(neutral_text, find(neutral_text, turns, None))
        tail_text = neutral_text[layout.bodies[-1].end :]
        if not template_text.endswith(tail_text):
            raise UnsupportedTemplateError("the template's text after the turn depends on the model's text")
    if placeholder_spans(tail_text):
        return None  # the template writes a turn's text again after it: the full check refuses that
    tick("short render")
    tail = renderer.encode(tail_text)
    kept, end_replaced = kept_prefix(prefix, tail, profile, False, source)
    junction = junction_text(marked_text, marked_bodies[-1], prefix, kept, end_replaced, profile, calls)
    if junction:
        if not template_text.endswith(junction + tail_text):
            return None
        tail = renderer.encode(junction + tail_text)
    tick("tail tokenize")
    generation = prefix[proven.length : kept] + tail[: junction_length(renderer, junction)]
    full = layout

    def measure() -> tuple[bool, int, tuple[RepairedTurn, ...] | None]:
        opening, prompt_end = _turn_opening(full, conversation[context_start], proven.closing_text)
        if prompt_end is None:
            return False, 0, None
        differed, replaced, repaired = measure_new_turn(
            renderer, full, tail_text, template_text, prompt_end, generation, a, opening
        )
        if repaired:  # the short conversation's index of the turn, as the request numbers it
            repaired = tuple(RepairedTurn(source.message_index, turn.replaced_tokens) for turn in repaired)
        return differed, replaced, repaired

    return tail, kept, end_replaced, tail_text, measure


def _untimed(stage: str) -> None:
    pass


def _turn_opening(full: Layout, context: Any, prompt_end: str) -> tuple[str | None, str | None]:
    """The text that opens the turn in the short conversation and the prompt's end, cut alike for measure_new_turn:
    after an earlier body in the short conversation (its context holds the calling turn) both start where that
    turn closes; otherwise both start after the context's first message's text (None, None where it has none, or
    either lacks it: the measurement is then unknown)."""
    if len(full.bodies) > 1:
        return None, prompt_end
    text = message_field(context, "content")
    body = full.bodies[-1]
    if not isinstance(text, str) or not text:
        return None, None
    in_history, in_prompt = full.text.rfind(text, 0, body.start), prompt_end.rfind(text)
    if in_history < 0 or in_prompt < 0:
        return None, None
    return full.text[in_history + len(text) : body.start], prompt_end[in_prompt + len(text) :]


def _template_input(message: Any) -> dict[str, Any]:
    """A message as the template reads it: a plain dict without the gym's token fields, with tool calls of its own
    (a renderer may edit them in place, as vLLM's does: the request's messages must stay as they were sent)."""
    return with_own_tool_calls({key: value for key, value in dict(message).items() if key not in TOKEN_FIELDS})
