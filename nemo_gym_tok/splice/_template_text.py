"""The template's text for neutral messages (memoized where the renderer keeps a memo), where the model's bodies lie
in it, and the prompts the memo keeps as proven."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from nemo_gym_tok.splice._ids import message_field
from nemo_gym_tok.splice._memo import ProvenPrompt, RenderMemo
from nemo_gym_tok.splice._neutral import neutralize, placeholder_spans
from nemo_gym_tok.splice._profile import TemplateProfile
from nemo_gym_tok.splice._refusals import (
    BoundaryNotFoundError,
    SpliceError,
    UnsupportedTemplateError,
    raised_in_this_package,
)
from nemo_gym_tok.splice._render import ChatRenderer
from nemo_gym_tok.splice._structure import locate_bodies


def render_neutral(
    renderer: ChatRenderer, messages: Sequence[Any], a: int, turns: list[int], drop_call_text: bool
) -> tuple[list[dict[str, Any]], str]:
    """Neutral messages in which every assistant turn up to messages[a] renders a placeholder, and their rendering
    with a generation prompt: the text the full check cuts into bodies (a turn whose placeholder that rendering lacks
    is given a content placeholder and rendered again, so its body can be found)."""
    neutral = neutralize(messages, a, drop_call_text=drop_call_text)
    text = render_messages(renderer, neutral, add_generation_prompt=True, what="the messages")
    silent = frozenset(turns) - set(placeholder_spans(text))
    if not silent:
        return neutral, text
    neutral = neutralize(messages, a, force_content=silent, drop_call_text=drop_call_text)
    return neutral, render_messages(renderer, neutral, add_generation_prompt=True, what="the messages")


def body_finder(profile: TemplateProfile, messages: Sequence[Any]) -> Any:
    """A function `find(text, indices, open_ended)` that locates the assistant bodies of messages[indices] in a
    rendering of `messages` (by the profile's headers, the one after a tool result where it differs, and closers),
    so every check cuts a rendering alike; where it cannot, it refuses with BoundaryNotFoundError."""

    def header_for(index: int) -> tuple[str, bool, frozenset[str]]:
        after_tool = index > 0 and message_field(messages[index - 1], "role") == "tool"
        header = profile.header_after_tool if after_tool else profile.assistant_header
        return header.text, header.follows_special, header.anchors

    def find(text: str, indices: list[int], open_ended: int | None) -> Any:
        try:
            return locate_bodies(
                text,
                indices,
                special_tokens=profile.special_tokens,
                closers=profile.closers,
                header_for=header_for,
                open_ended=open_ended,
                closed_by_text=profile.closed_by_text,
            )
        except LookupError as exc:
            raise BoundaryNotFoundError(f"{exc}; the splice cannot tell where the model's ids end") from None

    return find


def render_messages(renderer: ChatRenderer, messages: list[dict[str, Any]], *, what: str, **kwargs: Any) -> str:
    """The template's text for neutral `messages`, from the renderer's memo (see _memo) when it keeps one. A
    template that raises on the messages is refused as UnsupportedTemplateError (`what` names them); an error raised
    in this package is a bug and propagates."""
    memo: RenderMemo | None = getattr(renderer, "render_memo", None)
    try:
        if memo is None:
            return renderer.render(messages, **kwargs)
        return memo.render(renderer.render_scope, messages, kwargs, lambda: renderer.render(messages, **kwargs))
    except SpliceError:
        raise
    except Exception as exc:  # noqa: BLE001 - a template raising on a message shape is the caller's input problem
        if raised_in_this_package(exc):
            raise  # a bug of ours, not the template's: a refusal would hide it
        raise UnsupportedTemplateError(f"the chat template cannot render {what}: {exc}") from None


def proven_prompt(renderer: ChatRenderer, messages: Sequence[Any], prefix: list[int]) -> ProvenPrompt | None:
    """The prompt this server spliced for these messages, where `prefix` opens with it (from the renderer's memo;
    None without one): the structural check of that part is then already done."""
    memo: RenderMemo | None = getattr(renderer, "render_memo", None)
    return None if memo is None else memo.proven_prompt(renderer.render_scope, messages, prefix)


def remember_prompt(
    renderer: ChatRenderer,
    messages: Sequence[Any],
    prompt_ids: list[int],
    closing_text: str,
    checked_by_text: bool,
) -> None:
    """Keep a proven spliced prompt in the renderer's memo (where it keeps one), so the next turn's prefix, which
    opens with it, need not be checked again (see proven_prompt)."""
    memo: RenderMemo | None = getattr(renderer, "render_memo", None)
    if memo is not None:
        memo.remember_prompt(renderer.render_scope, messages, prompt_ids, closing_text, checked_by_text)
