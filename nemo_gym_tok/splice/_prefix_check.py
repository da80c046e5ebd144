"""The structural check of a prefix: the template's rendering of the messages before its turn, outside the model's
bodies, then a generation that stays inside the turn; a refusal that names the message where it differs (naming the
prefix by `describe_source`, as the splice's other refusals about a prefix do)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from nemo_gym_tok.splice._fixed_text import FixedTextMatcher
from nemo_gym_tok.splice._ids import PrefixSource
from nemo_gym_tok.splice._profile import TemplateProfile
from nemo_gym_tok.splice._refusals import StalePrefixError, StructureMismatchError
from nemo_gym_tok.splice._render import ChatRenderer, batch_decoder
from nemo_gym_tok.splice._structure import Body, Layout, Mismatch, match_fixed_segments
from nemo_gym_tok.splice._template_text import proven_prompt, render_messages
from nemo_gym_tok.types.tokens import PREFIX_KEY


def check_prefix_structure(
    renderer: ChatRenderer,
    profile: TemplateProfile,
    messages: Sequence[Any],
    neutral: list[dict[str, Any]],
    earlier: list[int],
    find: Any,
    source: PrefixSource,
) -> tuple[int, bool, str]:
    """The structural check: the prefix is what the template renders for messages[:a] (with a generation prompt)
    outside the model's bodies, then a non-empty generation with no end token inside. Returns where the generation
    starts, whether the text walk proved it (_fixed_text; id by id where it could not), and the prompt's fixed text
    after its last earlier body (it ends with the generation prompt)."""
    a, prefix = source.message_index, source.prefix
    proven = proven_prompt(renderer, messages[:a], prefix)
    if proven is not None:  # the prompt this server spliced for these messages, sent back as it was given
        generation_start, checked_by_text, prompt_end = proven.length, proven.checked_by_text, proven.closing_text
    else:
        generation_start, checked_by_text, prompt_end = _walk_prompt(renderer, profile, neutral, earlier, find, source)
    check_generation(renderer, profile, source, generation_start)
    return generation_start, checked_by_text, prompt_end


def check_generation(
    renderer: ChatRenderer, profile: TemplateProfile, source: PrefixSource, generation_start: int
) -> None:
    """What the structural check asks of the prefix after its prompt part (the first `generation_start` ids): a
    non-empty generation with no end token inside, and a bundle whose prompt ids are that prompt."""
    a, prefix = source.message_index, source.prefix
    if generation_start == len(prefix):
        raise StalePrefixError(
            f"{describe_source(source)} ends where the prompt for messages[{a}] ends: the last assistant span is "
            "empty. Send the prompt ids followed by the ids the model generated"
        )
    inner_end = next((i for i in range(generation_start, len(prefix) - 1) if prefix[i] in profile.end_token_ids), None)
    if inner_end is not None:
        raise StalePrefixError(
            f"stale prefix: {describe_source(source)} holds the turn end {renderer.decode([prefix[inner_end]])!r} at "
            f"id {inner_end}, inside what would be the model's turn in messages[{a}] (generation stops there, so the "
            "prefix spans more turns than these messages have). Send the prefix of the last assistant message, or "
            "the messages it was produced with"
        )
    if source.prompt_length is not None and source.prompt_length != generation_start:
        raise StructureMismatchError(
            f"messages[{a}].prompt_token_ids holds {source.prompt_length} ids, but the template's prompt for the "
            f"messages before it is {generation_start} ids long (its ids match up to there): the bundle does not "
            "belong to these messages",
            message_index=a,
        )


def _walk_prompt(
    renderer: ChatRenderer,
    profile: TemplateProfile,
    neutral: list[dict[str, Any]],
    earlier: list[int],
    find: Any,
    source: PrefixSource,
) -> tuple[int, bool, str]:
    """The structural check's walk of the prefix along the template's rendering of messages[:a]: where the
    generation starts, whether the text walk proved it, and the prompt's fixed text after its last earlier body."""
    a, prefix = source.message_index, source.prefix
    closer_ids = profile.closer_ids()
    matcher = FixedTextMatcher(
        renderer.encode, batch_decoder(renderer), renderer.added_tokens, getattr(renderer, "piece_cache", None)
    )
    prompt_text = render_messages(
        renderer, neutral[:a], add_generation_prompt=True, what="the messages before the prefix's turn"
    )
    prompt_layout = Layout(prompt_text, find(prompt_text, earlier, None))
    bodies = matcher.body_spans(prefix, prompt_layout, closer_ids, profile.end_token_ids)
    # Templates that move text between turns (Mistral v0.3 puts the system prompt in the last user turn; Kimi
    # renders an earlier turn's thinking block otherwise than its generation prompt did) render the history
    # differently once more messages follow; the prefix then holds each turn's prompt as it was.
    turn_layout = None
    if bodies is None and earlier:
        turn_layout = _turn_by_turn_layout(renderer, neutral, [*earlier, a], find)
        bodies = matcher.body_spans(prefix, turn_layout, closer_ids, profile.end_token_ids)
    checked_by_text = bodies is not None
    if bodies is None:
        bodies, mismatch = match_fixed_segments(
            prefix, prompt_layout, renderer.encode, closer_ids, profile.end_token_ids
        )
        if mismatch is not None and turn_layout is not None:
            turn_bodies, turn_mismatch = match_fixed_segments(
                prefix, turn_layout, renderer.encode, closer_ids, profile.end_token_ids
            )
            if turn_mismatch is None:
                prompt_layout, bodies, mismatch = turn_layout, turn_bodies, None
        if mismatch is not None:
            raise _mismatch_error(renderer, neutral, a, prompt_layout, mismatch, source)
    used = turn_layout if checked_by_text and turn_layout is not None else prompt_layout
    return bodies[-1][0], checked_by_text, used.text[used.bodies[-1].end if used.bodies else 0 :]


def _turn_by_turn_layout(renderer: ChatRenderer, neutral: list[dict[str, Any]], turns: list[int], find: Any) -> Layout:
    """The prompt of the last of `turns` as a chain of splices builds it: the first turn's prompt, then each turn's
    body and what the next turn's prompt renders after it."""
    text = render_messages(renderer, neutral[: turns[0]], add_generation_prompt=True, what="the first turn's messages")
    bodies = []
    for done, following in zip(turns, turns[1:]):
        rendered = render_messages(
            renderer, neutral[:following], add_generation_prompt=True, what="an earlier turn's messages"
        )
        body = find(rendered, [turn for turn in turns if turn <= done], None)[-1]
        start = len(text)
        text += rendered[body.start : body.end]
        bodies.append(Body(done, start, len(text)))
        text += rendered[body.end :]
    return Layout(text, tuple(bodies))


def _mismatch_error(
    renderer: ChatRenderer,
    neutral: list[dict[str, Any]],
    a: int,
    layout: Layout,
    mismatch: Mismatch,
    source: PrefixSource,
) -> StructureMismatchError:
    start, end = mismatch.segment
    offset = start + len(renderer.decode(renderer.encode(layout.text[start:end])[: mismatch.segment_position]))
    index = _message_at(renderer, neutral, a, layout.text, offset)
    where = f"messages[{index}]" if index is not None else f"the prompt the template renders before messages[{a}]"
    return StructureMismatchError(
        f"{describe_source(source)} does not belong to these messages: at id {mismatch.position} it differs from "
        f"what the chat template renders for {where} (template: {renderer.decode(mismatch.expected)!r}, prefix: "
        f"{renderer.decode(mismatch.found)!r}). Send the messages the prefix was produced with; to replace edited "
        "history on purpose, start a new token segment",
        message_index=index,
    )


def _message_at(renderer: ChatRenderer, neutral: list[dict[str, Any]], a: int, text: str, offset: int) -> int | None:
    """The first message whose rendering (with those before it) reaches past `offset` in `text`."""
    for index in range(a):
        try:
            partial = renderer.render(neutral[: index + 1], add_generation_prompt=False)
        except Exception:  # noqa: BLE001 - some templates refuse partial conversations; try a longer one
            continue
        common = 0
        for left, right in zip(partial, text):
            if left != right:
                break
            common += 1
        if common > offset:
            return index
    return None


def describe_source(source: PrefixSource) -> str:
    """How a refusal names the prefix: the request field it came in, or the token bundle of its message, so the
    caller knows which part of the request to fix."""
    return PREFIX_KEY if source.explicit else f"the token bundle of messages[{source.message_index}]"
