"""The edges of an assistant turn in the template's text: what follows the model's text, and how the turn opens.

After a turn the model did not close itself, the spliced prompt continues with the template's own text right after
the message's text (the junction), whitespace included. Before the model's text, the history must open the turn with
the role header the model's prompt ended with; a template that quotes the message elsewhere is refused.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from nemo_gym_tok.splice._ids import message_field
from nemo_gym_tok.splice._neutral import PLACEHOLDER
from nemo_gym_tok.splice._profile import TemplateProfile
from nemo_gym_tok.splice._refusals import UnsupportedTemplateError
from nemo_gym_tok.splice._render import ChatRenderer
from nemo_gym_tok.splice._structure import Body, special_pattern

UNCONFIRMED_JUNCTION = (
    "the chat template writes {junction!r} between the text of messages[{a}] and the turn's closing, but its rendering "
    "of these messages does not end with that text before what follows the turn; the splice cannot prove where the "
    "template's text after the turn starts"
)


def junction_text(
    text: str, body: Body, prefix: list[int], kept: int, end_replaced: bool, profile: TemplateProfile, calls: bool
) -> str:
    """What the template writes between an assistant message's text and the turn's closing (Llama 2's space before
    `</s>`, deepseek-coder's newline before `<|EOT|>`, Cohere's `<|END_RESPONSE|>`), where the spliced prompt must hold
    it: after a turn the model did not close itself (cut by max_tokens, or its end token gave way to the template's
    closing). A turn the model closed keeps its own ids up to its end token, which stand for all of it. After a tool
    call only the whitespace before the closing: the call's own syntax is text the model writes itself."""
    kept_own_end = kept == len(prefix) and prefix[-1] in profile.end_token_ids
    closed_by_model = (kept < len(prefix) and not end_replaced) or kept_own_end
    if closed_by_model or profile.closed_by_text:
        return ""
    last = None
    for last in PLACEHOLDER.finditer(text, body.start, body.end):
        pass
    after_text = text[last.end() if last is not None else body.end : body.end]
    return after_text[len(after_text.rstrip()) :] if calls else after_text


def junction_length(renderer: ChatRenderer, junction: str) -> int:
    """How many ids of the tail the junction takes (it opens the tail, before the closing special token)."""
    return len(renderer.encode(junction)) if junction else 0


def check_turn_opening(
    profile: TemplateProfile, messages: Sequence[Any], text: str, bodies: Sequence[Body], prompt_end: str
) -> None:
    """The template opens the prefix's turn in the history with the role header the model's prompt ended with.

    The role header is the generation prompt's last special token with the role name written right after it
    (`<|im_start|>assistant`, `<|start|>assistant`), or, where only whitespace follows that token, the last two
    special tokens with the role name between them (`<|start_of_role|>assistant<|end_of_role|>`). It must lie
    between the previous turn and the body. A template that prints the assistant's text somewhere else (a judge
    prompt quoting it inside a user turn) would otherwise have the model's ids spliced before a second generation
    prompt. Where the generation prompt names no role that way (Llama 2's `<s>[INST] ... [/INST]`, `User: ...
    Assistant:` after a bos token) there is nothing to look for. `text` is the placement rendering."""
    pattern = special_pattern(tuple(sorted(profile.special_tokens, key=len, reverse=True)))
    anchors = list(pattern.finditer(prompt_end))
    if not anchors:
        return
    after = prompt_end[anchors[-1].end() :]
    if any(
        isinstance(content := message_field(message, "content"), str) and content and content in after
        for message in messages[: bodies[-1].message_index]
    ):
        return  # message text after the last special token: the role is written as text (`User: ... Assistant:`)
    role = ROLE_NAME.match(after)
    between = prompt_end[anchors[-2].end() : anchors[-1].start()] if len(anchors) > 1 else ""
    if role is not None:
        opening = prompt_end[anchors[-1].start() : anchors[-1].end() + role.end(1)]
    elif not after.strip() and re.fullmatch(r"[A-Za-z][A-Za-z_]*", between):
        opening = prompt_end[anchors[-2].start() : anchors[-1].end()]
    else:
        return
    body = bodies[-1]
    previous_end = bodies[-2].end if len(bodies) > 1 else 0
    # The template's header may be shorter than the role name (a body found right after the special token).
    if text.rfind(opening, previous_end, body.start + len(opening)) not in range(previous_end, body.start + 1):
        raise UnsupportedTemplateError(
            f"the chat template does not open the turn of messages[{body.message_index}] with the role header the "
            f"model's prompt ended with ({opening!r}): it renders that message's text elsewhere (quoted inside "
            "another turn?), so the model's ids cannot be spliced in as that turn"
        )


ROLE_NAME = re.compile(r"([A-Za-z][A-Za-z_]*)(?=\s|$)")
"""A role name right after (or alone between) the generation prompt's special tokens: `assistant`, `model`."""
