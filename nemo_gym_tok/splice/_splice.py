"""The prefix splice: the model's exact ids for the history, then the template's ids for what follows, or a refusal.

Given the messages of a request and the prefix of the assistant turn at `messages[a]` (the prompt + generation ids of
the call that produced it), the spliced prompt is

    prefix (its final end token dropped where the template supplies the turn's closing) + the template's ids after
    the closing of messages[a]

and it is returned only once the structural check holds: outside the model's own spans, the prefix is id for id what
the template renders for `messages[:a]` (the messages it was produced from), and the template's rendering of all the
messages has the same turn structure up to messages[a]. The template's rendering is done with neutral assistant turns
(see _neutral), so nothing the model wrote can move a boundary.

Nothing here tokenizes the history: the prefix is checked against the template's text (see _fixed_text; the exact,
id-by-id walk runs only where that cannot prove a match), or found to open with a prompt this server spliced for
the same messages (see _memo), and only the template's text after the boundary is tokenized. The cost per request
is a few renderings of the messages; on a next turn, the one that finishes the proof and the measurement of the
new turn are left to SplicedPrompt, for a server to run while the engine generates.

This module runs the two paths (the placement shortcut and the full check) behind `splice_prompt`; their parts are
_prefix_check (`check_prefix_structure`, the structural check of the prefix), _tail (`template_tail` and the checks
of the template's ids after it, `kept_prefix`, `measure_new_turn`), _turn_edges (the junction after the model's text
and the turn's opening), _template_text (`render_messages`, `render_neutral`, `body_finder` and the memo's proven
prompts) and _result (`SplicedPrompt`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from nemo_gym_tok.splice._ids import PrefixSource, message_field
from nemo_gym_tok.splice._memo import RenderMemo
from nemo_gym_tok.splice._neutral import neutralize
from nemo_gym_tok.splice._new_turn import splice_new_turn
from nemo_gym_tok.splice._prefix_check import check_prefix_structure, describe_source
from nemo_gym_tok.splice._profile import TemplateProfile
from nemo_gym_tok.splice._refusals import SpliceError, StalePrefixError, UnsupportedTemplateError
from nemo_gym_tok.splice._render import ChatRenderer
from nemo_gym_tok.splice._result import SplicedPrompt
from nemo_gym_tok.splice._structure import Layout
from nemo_gym_tok.splice._tail import (
    check_message_placement,
    check_truncation,
    fill_message_texts,
    kept_prefix,
    matched_layout,
    measure_new_turn,
    template_tail,
)
from nemo_gym_tok.splice._template_text import body_finder, remember_prompt, render_messages, render_neutral
from nemo_gym_tok.splice._turn_edges import UNCONFIRMED_JUNCTION, check_turn_opening, junction_length, junction_text


def splice_prompt(
    renderer: ChatRenderer,
    profile: TemplateProfile,
    messages: Sequence[Any],
    source: PrefixSource,
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    truncate_prompt_tokens: int | None = None,
    template_text: str | None = None,
    defer_verify: bool = False,
    new_turn: bool = True,
) -> SplicedPrompt:
    """Splice `source.prefix` (belonging to messages[source.message_index]) into the prompt for `messages`.

    The spliced ids are ready at once (SplicedPrompt.prompt_token_ids); the measurement of the new turn is left for
    later (SplicedPrompt.result() returns the SpliceResult with its telemetry). `template_text` is the server's own
    rendering of the request, when it has one: the tail must agree with it, and the telemetry says whether the
    template would have written the prefix's turn differently. Raises a SpliceError subclass when the result could
    not be proven exact.

    With `defer_verify`, a next turn's tail read from the placement rendering, where the server's rendering did not
    prove it at once, is verified later too (SplicedPrompt
    .verify: a server runs it while the engine generates, and a failure refuses the answer; the renderer's memo then
    sends the same request down the full path, should it come again). Without it, a failed verification falls back to
    the full path at once, as any other reason the fast path cannot decide.

    A next turn whose history this server spliced before is spliced first at the cost of its new messages
    (splice._new_turn: nothing of the history rendered); `new_turn=False` skips that (a caller that tried it)."""
    a = source.message_index
    prefix = source.prefix
    if a < 0:
        raise ValueError("splice_prompt() needs a prefix that belongs to an assistant message; use check_starts_with")
    if not prefix:
        raise StalePrefixError(
            f"{describe_source(source)} is empty, but messages[{a}] is an assistant turn: send the ids of the call "
            "that produced it (prompt + generation), or no prefix at all"
        )
    if new_turn and add_generation_prompt and not continue_final_message:
        spliced = splice_new_turn(renderer, profile, messages, source, truncate_prompt_tokens=truncate_prompt_tokens)
        if spliced is not None:
            return spliced
    earlier = [j for j in range(a) if message_field(messages[j], "role") == "assistant"]
    find = body_finder(profile, messages)
    moved_call_text = bool(
        profile.moves_call_text and message_field(messages[a], "tool_calls") and message_field(messages[a], "content")
    )
    remember = (
        add_generation_prompt
        and not continue_final_message
        and not any(message_field(message, "role") == "assistant" for message in messages[a + 1 :])
    )
    if template_text is not None and add_generation_prompt and not continue_final_message and not moved_call_text:
        try:
            spliced = _splice_by_placement(
                renderer, profile, messages, source, earlier, find, template_text, truncate_prompt_tokens, remember
            )
            if not defer_verify:
                spliced.verify()
            return spliced
        except SpliceError:
            pass  # the full path below decides, with its own reasons
    neutral, neutral_text = render_neutral(renderer, messages, a, [*earlier, a], profile.moves_call_text)
    if add_generation_prompt and not continue_final_message:
        full_text = neutral_text
    else:
        full_text = render_messages(
            renderer,
            neutral,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            what="the messages",
        )
    full_layout = Layout(full_text, find(full_text, [*earlier, a], a if continue_final_message else None))
    generation_start, checked_by_text, prompt_end = check_prefix_structure(
        renderer, profile, messages, neutral, earlier, find, source
    )
    tail_text, tail = template_tail(
        renderer,
        profile,
        messages,
        neutral,
        [*earlier, a],
        find,
        full_layout,
        source,
        add_generation_prompt,
        continue_final_message,
        template_text,
        prompt_end,
    )
    kept, end_replaced = kept_prefix(prefix, tail, profile, continue_final_message, source)
    calls = bool(message_field(messages[a], "tool_calls"))
    junction = (
        ""
        if continue_final_message
        else junction_text(full_layout.text, full_layout.bodies[-1], prefix, kept, end_replaced, profile, calls)
    )
    if junction:
        if template_text is not None and not moved_call_text and not template_text.endswith(junction + tail_text):
            raise UnsupportedTemplateError(UNCONFIRMED_JUNCTION.format(a=a, junction=junction))
        tail = renderer.encode(junction + tail_text)
    spliced = prefix[:kept] + tail
    check_truncation(truncate_prompt_tokens, spliced)
    if moved_call_text:
        template_text = None  # the server's rendering holds the model's text after the results; ours leaves it out
    generation = prefix[generation_start:kept] + tail[: junction_length(renderer, junction)]
    if remember:
        remember_prompt(renderer, messages, spliced, tail_text, checked_by_text)
    return SplicedPrompt(
        spliced,
        kept,
        end_replaced,
        checked_by_text,
        verify=lambda: None,
        measure_turn=lambda: measure_new_turn(
            renderer, full_layout, tail_text, template_text, prompt_end, generation, a
        ),
    )


def _splice_by_placement(
    renderer: ChatRenderer,
    profile: TemplateProfile,
    messages: Sequence[Any],
    source: PrefixSource,
    earlier: list[int],
    find: Any,
    template_text: str,
    truncate_prompt_tokens: int | None,
    remember: bool,
) -> SplicedPrompt:
    """The splice without rendering the neutral messages first (the common next turn, add_generation_prompt).

    The tail is read from the rendering that checks message placement (every message's text a placeholder): its
    text after the turn's closing, each placeholder replaced by its message's text, must end the server's own
    rendering. That holds where the template writes those messages' text as it is; anything else (a template that
    trims or escapes it, text holding special tokens or placeholders, a silent turn) raises, and the full path
    decides. Where the server's rendering is the whole placement rendering with every text in place (any text for
    reasoning and tool-call arguments inside a body), the proof is complete; otherwise it leaves to `verify` (a
    server runs it while the engine generates): that the template's rendering of the neutral messages has exactly
    this tail, as the full path's proof requires.
    """
    a, prefix = source.message_index, source.prefix
    turns = [*earlier, a]
    neutral = neutralize(messages, a, drop_call_text=profile.moves_call_text)
    memo: RenderMemo | None = getattr(renderer, "render_memo", None)
    if memo is not None and memo.distrusts_placement(renderer.render_scope, neutral):
        raise UnsupportedTemplateError("the placement rendering gave these messages a wrong tail before")
    generation_start, checked_by_text, prompt_end = check_prefix_structure(
        renderer, profile, messages, neutral, earlier, find, source
    )
    marked_text, marked_bodies = check_message_placement(renderer, neutral, a, turns, find, True, False)
    check_turn_opening(profile, neutral, marked_text, marked_bodies, prompt_end)
    tail_text = fill_message_texts(marked_text[marked_bodies[-1].end :], messages, renderer.added_tokens)
    if tail_text is None or not template_text.endswith(tail_text):
        raise UnsupportedTemplateError("the tail cannot be read from the placement rendering")
    tail = renderer.encode(tail_text)
    kept, end_replaced = kept_prefix(prefix, tail, profile, False, source)
    calls = bool(message_field(messages[a], "tool_calls"))
    junction = junction_text(marked_text, marked_bodies[-1], prefix, kept, end_replaced, profile, calls)
    if junction:
        if not template_text.endswith(junction + tail_text):
            raise UnsupportedTemplateError(UNCONFIRMED_JUNCTION.format(a=a, junction=junction))
        tail = renderer.encode(junction + tail_text)
    spliced = prefix[:kept] + tail
    check_truncation(truncate_prompt_tokens, spliced)
    generation = prefix[generation_start:kept] + tail[: junction_length(renderer, junction)]
    full: list[Layout] = []

    def settle(layout: Layout) -> None:
        """The proof is complete with `layout` (the template's rendering, cut into bodies): keep it for the
        measurement of the new turn, and the prompt for the next turn."""
        full.append(layout)
        if remember:
            remember_prompt(renderer, messages, spliced, tail_text, checked_by_text)

    def verify() -> None:
        text = render_messages(renderer, neutral, add_generation_prompt=True, what="the messages")
        layout = Layout(text, find(text, turns, None))
        if text[layout.bodies[-1].end :] != tail_text:
            if memo is not None:
                memo.distrust_placement(renderer.render_scope, neutral)
            raise UnsupportedTemplateError(
                f"the chat template's text after the turn of messages[{a}] could not be confirmed in time (its "
                "rendering of the messages differs from the shortcut's); send the request again: it then takes the "
                "full check"
            )
        settle(layout)

    filled = matched_layout(marked_text, marked_bodies, messages, template_text)
    proven = filled is not None
    if proven:
        # The server's rendering is the placement rendering with every message's own text in place of its
        # placeholder (reasoning and tool-call arguments inside a body aside: the model's ids replace them): it cuts
        # into the same bodies, so the tail follows the last body there. Proven now, nothing is left to verify.
        settle(filled)
    return SplicedPrompt(
        spliced,
        kept,
        end_replaced,
        checked_by_text,
        verify=(lambda: None) if proven else verify,
        measure_turn=lambda: measure_new_turn(renderer, full[0], tail_text, template_text, prompt_end, generation, a),
    )
