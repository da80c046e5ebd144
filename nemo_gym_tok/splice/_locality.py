"""Whether a chat template writes a next turn's text without reading the history before it, so that a short
conversation (the system message, the turn's context, the turn and what follows) renders the same text after the turn.

The short conversation keeps what a template reads around a turn in practice: the system message (tools and
instructions live there), the message the turn answers (the user's, or the tool results with the call that asked for
them, opened by a stand-in user message), the turn and the messages after it. Whether that is all the template reads
is decided per template scope and conversation shape, by probes: the short conversation rendered with every text a
placeholder, and again with earlier exchanges inserted before its context (one, three, and a tool call where the
conversation has tools). Everything after the context's first message must be the same text in every rendering, with
no placeholder of an inserted message in it. A template that numbers messages, counts turns, or repeats earlier text
after the turn fails that, and its next turns take the full check. The probes bound what is proven: a template whose
text after the turn changes only past histories the probes do not reach (after the tenth exchange, say) is not caught;
docs/hook.md names that limit.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from nemo_gym_tok.splice._ids import message_field
from nemo_gym_tok.splice._memo import RenderMemo
from nemo_gym_tok.splice._neutral import ANY_PLACEHOLDER, neutralize
from nemo_gym_tok.splice._refusals import SpliceError, raised_in_this_package
from nemo_gym_tok.splice._render import ChatRenderer

STAND_IN_USER = {"role": "user", "content": "ngtstandin"}
"""Opens a short conversation whose turn follows tool results: the user message the calls answer lies further back."""

_OPENING_ROLES = ("system", "developer")


def short_conversation(messages: Sequence[Any], a: int) -> tuple[list[Any], int, int, bool] | None:
    """`messages` cut to what a next turn's rendering reads: (the short conversation, the index of messages[a] in it,
    the index of its context's first message, whether that message is the stand-in); None for a turn that follows
    neither a user message nor tool results (a template's rendering then needs the full check)."""
    head = [messages[0]] if a > 0 and message_field(messages[0], "role") in _OPENING_ROLES else []
    start = a - 1
    while start >= len(head) and message_field(messages[start], "role") == "tool":
        start -= 1
    if start < len(head):
        return None
    role = message_field(messages[start], "role")
    if start == a - 1:
        if role != "user":
            return None
        context: list[Any] = [messages[start]]
    elif role == "assistant" and message_field(messages[start], "tool_calls"):
        context = [STAND_IN_USER, *messages[start:a]]
    else:
        return None
    short = [*head, *context, *messages[a:]]
    return short, len(head) + len(context), len(head), start != a - 1


def tail_is_local(
    renderer: ChatRenderer,
    neutral: list[dict[str, Any]],
    a: int,
    context_start: int,
    stand_in: bool,
    drop_call_text: bool,
) -> bool:
    """Whether the template's text after the context's first message of the short conversation (`neutral`, its
    turns up to messages[a] neutral) is the same with earlier exchanges before that context; decided once per
    template scope and shape where the renderer keeps a memo."""
    marked = neutralize(neutral, -1, others=True)

    def decide() -> bool:
        base = _region(renderer, marked, context_start, 0, stand_in)
        if base is None:
            return False
        for history in _probe_histories(neutral):
            longer = neutralize(
                [*neutral[:context_start], *history, *neutral[context_start:]],
                a + len(history),
                drop_call_text=drop_call_text,
            )
            region = _region(renderer, neutralize(longer, -1, others=True), context_start, len(history), stand_in)
            if region != base:
                return False
        return True

    memo: RenderMemo | None = getattr(renderer, "render_memo", None)
    if memo is None:
        return decide()
    return memo.verdict(renderer.render_scope, marked, "tail is local", decide)


def _region(
    renderer: ChatRenderer, marked: list[dict[str, Any]], context_start: int, inserted: int, stand_in: bool
) -> str | None:
    """The rendering of `marked` after the placeholder of its context's first message (at `context_start` +
    `inserted`), with message indices as in the short conversation; None where it cannot be told (the template
    raises, drops that message, or writes an inserted message's text, or the stand-in's, after it)."""
    try:
        text = renderer.render(marked, add_generation_prompt=True)
    except SpliceError:
        raise
    except Exception as exc:  # noqa: BLE001 - a template refusing a probe's shape proves nothing: take the full check
        if raised_in_this_package(exc):
            raise
        return None
    first = context_start + inserted
    found = re.search(rf"ngtmsg{first}q", text)
    if found is None:
        return None
    region = text[found.end() :]
    forbidden = range(context_start, context_start + inserted + (1 if stand_in else 0))
    if any(int(match.group(2)) in forbidden for match in ANY_PLACEHOLDER.finditer(region)):
        return None

    def short_index(match: re.Match[str]) -> str:
        index = int(match.group(2))
        return f"ngt{match.group(1)}{index - inserted if index >= first else index}q"

    return ANY_PLACEHOLDER.sub(short_index, region)


def _probe_histories(neutral: Sequence[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """Earlier exchanges to insert before the context: one, three, and a tool call answered where the conversation
    has tools; assistant turns with reasoning where the conversation's have it."""
    user = {"role": "user", "content": "probe"}
    answer: dict[str, Any] = {"role": "assistant", "content": "probe"}
    assistants = [message for message in neutral if message.get("role") == "assistant"]
    if any(message.get("reasoning_content") for message in assistants):
        answer["reasoning_content"] = "probe"
    histories = [[user, answer], [user, answer] * 3]
    calls = [call for message in assistants for call in message.get("tool_calls") or []]
    if calls or any(message.get("role") == "tool" for message in neutral):
        name = (calls[0].get("function") or {}).get("name", "lookup") if calls else "lookup"
        call = {"id": "ngtprobe", "type": "function", "function": {"name": name, "arguments": "{}"}}
        histories.append(
            [
                user,
                {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "ngtprobe", "content": "probe"},
                answer,
            ]
        )
    return histories
