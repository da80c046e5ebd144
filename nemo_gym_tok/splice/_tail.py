"""The template's part of a spliced prompt: its text after the prefix's turn (checked against the server's, and read
from the placement rendering on the shortcut), where the template places the other messages, how much of the prefix
it keeps, that truncation leaves it whole, and how the template would have written the new turn."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from nemo_gym_tok.contract.token_sources import first_difference
from nemo_gym_tok.splice._fixed_text import added_token_pattern
from nemo_gym_tok.splice._ids import PrefixSource, message_field
from nemo_gym_tok.splice._memo import RenderMemo
from nemo_gym_tok.splice._neutral import (
    ANY_PLACEHOLDER,
    MESSAGE_PLACEHOLDER,
    PLACEHOLDER,
    neutralize,
    placeholder_spans,
)
from nemo_gym_tok.splice._prefix_check import describe_source
from nemo_gym_tok.splice._profile import TemplateProfile
from nemo_gym_tok.splice._refusals import StalePrefixError, UnsupportedTemplateError
from nemo_gym_tok.splice._render import ChatRenderer
from nemo_gym_tok.splice._result import RepairedTurn
from nemo_gym_tok.splice._structure import Body, Layout
from nemo_gym_tok.splice._template_text import render_messages
from nemo_gym_tok.splice._turn_edges import check_turn_opening


def fill_message_texts(text: str, messages: Sequence[Any], added_tokens: Mapping[str, int]) -> str | None:
    """`text` with each message placeholder replaced by its message's text; None where a text holds what would make
    that replacement ambiguous (a placeholder, or an added token's text, which the template's own text is made of)."""
    texts: dict[int, str] = {}
    for match in MESSAGE_PLACEHOLDER.finditer(text):
        index = int(match.group(1))
        content = message_field(messages[index], "content") if index < len(messages) else None
        if not isinstance(content, str) or PLACEHOLDER.search(content) or MESSAGE_PLACEHOLDER.search(content):
            return None
        texts[index] = content
    if PLACEHOLDER.search(text):
        return None  # the template writes an assistant turn's text again after the turn: the full path refuses it
    added = added_token_pattern(added_tokens)
    if any(added.search(content) for content in texts.values()):
        return None
    return MESSAGE_PLACEHOLDER.sub(lambda match: texts[int(match.group(1))], text)


WILDCARD_KINDS = frozenset(("think", "arg"))
"""Placeholders that stand for text the template renders through its own filters (`tojson`, trims): inside a body,
where the model's ids replace whatever the template wrote, the proof lets them match any text."""


def matched_layout(text: str, bodies: Sequence[Body], messages: Sequence[Any], rendered: str) -> Layout | None:
    """`rendered` cut into the bodies of the placement rendering `text`, where it is that rendering with each
    message's text in place of its placeholder; None otherwise.

    Character for character, except that a reasoning or tool-call argument placeholder inside a body (with the
    quotes around it) matches any text: the template's rendering of those is not the text itself, and the model's
    ids replace it. Everything outside the bodies, and every message's own text, must match exactly; a placeholder
    of those kinds outside a body, or a message without text, gives None. Where it matches, the template wrote
    every text as it is, and the bodies lie where the placement rendering has them."""
    cuts = [0, *(offset for body in bodies for offset in (body.start, body.end)), len(text)]
    contents = [message_field(message, "content") for message in messages]
    chunks: list[str] = []  # the literal text between wildcards
    parts: list[str] = []
    length = 0
    boundaries: list[tuple[int, int]] = []  # each body's start and end: (chunk, offset in it)
    for number in range(len(cuts) - 1):
        inside = number % 2 == 1
        # At C speed: the segment's literal texts, each placeholder's kind and message index between them.
        pieces = ANY_PLACEHOLDER.split(text[cuts[number] : cuts[number + 1]])
        literal = pieces[0]
        for at in range(1, len(pieces), 3):
            kind, index, after = pieces[at], int(pieces[at + 1]), pieces[at + 2]
            if kind in WILDCARD_KINDS:
                if not inside:
                    return None
                if literal.endswith('"') and after.startswith('"'):
                    literal, after = literal[:-1], after[1:]  # a non-string value renders without the quotes
                parts.append(literal)
                chunks.append("".join(parts))
                parts, length = [], 0
            else:
                content = contents[index] if index < len(contents) else None
                if not isinstance(content, str):
                    return None
                parts += (literal, content)
                length += len(literal) + len(content)
            literal = after
        parts.append(literal)
        length += len(literal)
        if number < len(cuts) - 2:
            boundaries.append((len(chunks), length))
    chunks.append("".join(parts))
    starts = match_chunks(chunks, rendered)
    if starts is None:
        return None
    offsets = [starts[chunk] + offset for chunk, offset in boundaries]
    cut = tuple(Body(body.message_index, offsets[2 * k], offsets[2 * k + 1]) for k, body in enumerate(bodies))
    return Layout(rendered, cut)


def match_chunks(chunks: Sequence[str], rendered: str) -> list[int] | None:
    """Where each chunk starts in `rendered`, which must be the chunks in order with any text between consecutive
    ones, the first at its start and the last at its end; None where it is not. Taking each middle chunk's leftmost
    place is enough to find a match where one exists (every gap matches anything)."""
    if len(chunks) == 1:
        return [0] if rendered == chunks[0] else None
    first, last = chunks[0], chunks[-1]
    limit = len(rendered) - len(last)
    if limit < len(first) or not rendered.startswith(first) or not rendered.endswith(last):
        return None
    starts, position = [0], len(first)
    for chunk in chunks[1:-1]:
        found = rendered.find(chunk, position, limit)
        if found < 0:
            return None
        starts.append(found)
        position = found + len(chunk)
    starts.append(limit)
    return starts


def check_truncation(truncate_prompt_tokens: int | None, spliced: list[int]) -> None:
    """Refuse a `truncate_prompt_tokens` that would cut the spliced prompt: vLLM keeps its last ids, so the cut would
    fall in the model's prefix, and the prompt would no longer open with the model's own ids."""
    if truncate_prompt_tokens is not None and 0 <= truncate_prompt_tokens < len(spliced):
        raise StalePrefixError(
            f"truncate_prompt_tokens={truncate_prompt_tokens} would cut the first "
            f"{len(spliced) - truncate_prompt_tokens} ids of the spliced prompt ({len(spliced)} ids), which are the "
            "model's prefix; drop truncate_prompt_tokens or start a new token segment"
        )


def template_tail(
    renderer: ChatRenderer,
    profile: TemplateProfile,
    messages: Sequence[Any],
    neutral: list[dict[str, Any]],
    turns: list[int],
    find: Any,
    full_layout: Layout,
    source: PrefixSource,
    add_generation_prompt: bool,
    continue_final_message: bool,
    template_text: str | None,
    prompt_end: str,
) -> tuple[str, list[int]]:
    """The template's text and ids from the closing of messages[a] on, checked against the server's own rendering.

    The tail is tokenized on its own. Where a closing special token starts it, that is what tokenizing the whole
    prompt gives too (tokenizers split at added tokens first); for turns closed by text, the template's text after
    the model's is tokenized on its own by design (inside the whole prompt the tokenizer may merge it with the
    model's last characters, which the model's own ids replace).
    """
    a = source.message_index
    marked_text, marked_bodies = check_message_placement(
        renderer, neutral, a, turns, find, add_generation_prompt, continue_final_message
    )
    check_turn_opening(profile, neutral, marked_text, marked_bodies, prompt_end)
    tail_text = full_layout.text[full_layout.bodies[-1].end :]
    repeated = sorted(set(placeholder_spans(tail_text)))
    if repeated:
        raise UnsupportedTemplateError(
            f"the chat template renders text of messages[{repeated[0]}] again after the turn of messages[{a}] closes; "
            "the splice cannot prove such a prompt exact"
        )
    moved_call_text = (
        profile.moves_call_text and message_field(messages[a], "tool_calls") and message_field(messages[a], "content")
    )
    # Where the template moves a tool-calling turn's text after the results, the server's rendering holds it there
    # and ours leaves it out (it lives in the model's ids): nothing to compare.
    if template_text is not None and not moved_call_text and not template_text.endswith(tail_text):
        raise UnsupportedTemplateError(
            "the chat template renders the turns after the prefix differently depending on earlier assistant text; "
            "the splice cannot prove such a prompt exact"
        )
    return tail_text, renderer.encode(tail_text)


def check_message_placement(
    renderer: ChatRenderer,
    neutral: list[dict[str, Any]],
    a: int,
    turns: list[int],
    find: Any,
    add_generation_prompt: bool,
    continue_final_message: bool,
) -> tuple[str, tuple[Body, ...]]:
    """Every message after messages[a] is rendered after its turn closes, and no message lies inside an assistant
    body: the structural check does not look inside bodies, and a template that renders a tool result inside the
    assistant turn (Gemma 4 after a turn with text) would hide it. Rendered with every message's text a placeholder;
    returns that rendering and its assistant bodies."""
    marked = neutralize(neutral, -1, others=True)
    text = render_messages(
        renderer,
        marked,
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message,
        what="the messages",
    )
    open_ended = a if continue_final_message else None
    memo: RenderMemo | None = getattr(renderer, "render_memo", None)
    if memo is None:
        bodies = find(text, turns, open_ended)
    else:  # requests of one shape share the rendering, and so where its bodies lie (headers depend on the roles)
        roles = tuple(message_field(message, "role") for message in neutral)
        key = (renderer.render_scope, text, roles, tuple(turns), open_ended)
        bodies = memo.located(key, lambda: find(text, turns, open_ended))
    for later in MESSAGE_PLACEHOLDER.finditer(text, 0, bodies[-1].end):
        if int(later.group(1)) > a:
            raise UnsupportedTemplateError(
                f"the chat template renders messages[{later.group(1)}] before the turn of messages[{a}] closes, so the "
                "model's ids for that turn cannot be followed by the template's ids for what comes after it"
            )
    for body in bodies:
        inside = MESSAGE_PLACEHOLDER.search(text, body.start, body.end)
        if inside is not None:
            raise UnsupportedTemplateError(
                f"the chat template renders messages[{inside.group(1)}] inside the assistant turn of "
                f"messages[{body.message_index}] (between the model's text and the turn's end), so the model's ids "
                "cannot be spliced in without dropping or reordering it"
            )
    return text, bodies


def kept_prefix(
    prefix: list[int], tail: list[int], profile: TemplateProfile, continue_final_message: bool, source: PrefixSource
) -> tuple[int, bool]:
    """How many prefix ids open the prompt, and whether the model's end token was replaced by the template's closing."""
    last = prefix[-1]
    if continue_final_message:
        if last in profile.end_token_ids:
            raise StalePrefixError(
                f"continue_final_message asks to continue messages[{source.message_index}], but "
                f"{describe_source(source)} ends on the model's end token {last}: that turn is over. Drop "
                "continue_final_message"
            )
        return len(prefix), False
    if tail and last == tail[0]:
        return len(prefix) - 1, False
    if last in profile.end_token_ids and (last in profile.closer_ids() or last in profile.replaced_end_ids()):
        return len(prefix) - 1, True
    return len(prefix), False


def measure_new_turn(
    renderer: ChatRenderer,
    full: Layout,
    tail_text: str,
    template_text: str | None,
    prompt_end: str,
    generation: list[int],
    a: int,
    opening: str | None = None,
) -> tuple[bool, int, tuple[RepairedTurn, ...] | None]:
    """Whether the template's ids for messages[a]'s turn differ from the model's, and from where.

    The turn starts where the prompt the model saw ends: after the generation prompt. In the history the template
    may open the turn with more (Harmony's `<|channel|>final<|message|>`) or less; both sides are compared from the
    first character where the history's opening of the turn and the prompt's end part. The template's side is read
    from the server's rendering: it ends where the tail starts and begins after the fixed text that opens the turn
    in the neutral rendering (its last occurrence, so model text that happens to spell it is not mistaken for it);
    each side's text is tokenized on its own. `opening`: that fixed text, where the caller cut it and `prompt_end`
    from the same place (a short conversation, whose first turn has another start than the prompt).
    """
    if template_text is None:
        return False, 0, None
    body = full.bodies[-1]
    first_turn = opening is None and len(full.bodies) == 1
    if opening is None:
        opening = full.text[(full.bodies[-2].end if len(full.bodies) > 1 else 0) : body.start]
    end = len(template_text) - len(tail_text)
    start = template_text.rfind(opening, 0, end)
    if start < 0 or (first_turn and start != 0):
        return False, 0, None
    shared = len(os.path.commonprefix([opening, prompt_end]))
    template_ids = renderer.encode(template_text[start + shared : end])
    if shared < len(prompt_end):  # the generation prompt wrote more than the history's opening of the turn
        generation = renderer.encode(prompt_end[shared:]) + generation
    difference = first_difference(template_ids, generation)
    if difference is None:
        return False, 0, ()
    replaced = len(template_ids) - difference
    return True, replaced, (RepairedTurn(a, replaced),)
