"""What a chat template does at the end of an assistant turn, read from renderings of probe conversations.

Detected once per served template: which special tokens close an assistant turn (a terminator such as <|im_end|>,
<end_of_turn> or <|eot_id|>, or the next role token where the template has none, as GLM-4 does), which of the model's
end tokens the template renders as another token (GPT-OSS ends with <|return|>, its history says <|end|>), and the
text between the last special token of an assistant header and the body.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from nemo_gym_tok.splice._neutral import neutralize, placeholder_spans
from nemo_gym_tok.splice._refusals import NoAssistantTurnsError, UnsupportedTemplateError
from nemo_gym_tok.splice._render import ChatRenderer

_TOOL = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "Look a word up.",
        "parameters": {"type": "object", "properties": {"word": {"type": "string"}}, "required": ["word"]},
    },
}
_CALL = {"id": "call_0", "type": "function", "function": {"name": "lookup", "arguments": '{"word": "x"}'}}


@dataclass(frozen=True)
class Header:
    """Template text that ends right before an assistant body, where the model's ids start."""

    text: str
    follows_special: bool = True
    """True when it comes right after its anchor (ChatML's "assistant\\n"); False when message text lies between them
    (Llama 2's "[INST] ... [/INST]"), so the header is its last occurrence before the body."""
    anchors: frozenset[str] = frozenset()
    """The special tokens that come before the header (<|im_start|>, <|end_header_id|>, <start_of_turn>, ...); the last
    one before a body anchors it, so special tool-call markup inside the body (Kimi) is not taken for it."""

    def describe(self) -> str:
        where = "after" if self.follows_special else "after message text after"
        return f"{self.text!r} ({where} {' or '.join(sorted(self.anchors)) or 'the start'})"


@dataclass(frozen=True)
class TemplateProfile:
    """How one chat template closes assistant turns; what the splice and the structural check rely on."""

    closers: frozenset[str]
    """Special tokens that close an assistant turn in the template's rendering (the first one after a body)."""
    end_token_ids: frozenset[int]
    """Ids the model stops on."""
    replaced_end_tokens: frozenset[str]
    """Model end tokens that the template renders as another closer once the turn is history."""
    assistant_header: Header
    """What opens an assistant body (e.g. "assistant\\n" or " [/INST]")."""
    header_after_tool: Header
    """What opens an assistant body that follows a tool result (Gemma 4 continues the same turn, with no header)."""
    special_tokens: Mapping[str, int]
    """Special tokens by text: the anchors of the structure."""
    closed_by_text: bool = False
    """No special token closes an assistant turn (`### Response:` templates): a body ends where its text ends, the
    template's closing text follows, and the model's own end token (which the template does not render) stays."""
    moves_call_text: bool = False
    """The template renders the text of an assistant message that calls tools after the tools' results (Gemma 4):
    that text is part of the model's ids, before the call, and the template's rendering of it is left out."""
    overridden: bool = False

    def closer_ids(self) -> frozenset[int]:
        return frozenset(self.special_tokens[token] for token in self.closers)

    def replaced_end_ids(self) -> frozenset[int]:
        return frozenset(self.special_tokens[token] for token in self.replaced_end_tokens)

    def describe(self) -> str:
        how = "set by NEMO_GYM_TOK_TURN_TERMINATOR" if self.overridden else "detected"
        if self.closed_by_text:
            how += "; no special token: a turn ends where the model's text ends"
        replaced = (
            f"; model end tokens rendered as a closer: {sorted(self.replaced_end_tokens)}"
            if self.replaced_end_tokens
            else ""
        )
        if self.moves_call_text:
            replaced += "; text of tool-calling turns rendered after the results (kept where the model wrote it)"
        after_tool = (
            ""
            if self.header_after_tool == self.assistant_header
            else (f"; after a tool result {self.header_after_tool.describe()}")
        )
        return (
            f"assistant turns close with {sorted(self.closers)} ({how}); assistant header "
            f"{self.assistant_header.describe()}{after_tool}{replaced}"
        )


TERMINATOR_ENV = "NEMO_GYM_TOK_TURN_TERMINATOR"
"""The environment variable that names a template's turn terminator where detection cannot (read by the vLLM hook and
the adapter, passed here as `terminator_override`)."""


def detect_profile(renderer: ChatRenderer, *, terminator_override: str | None = None) -> TemplateProfile:
    """Read the template's turn structure from probe conversations rendered with neutral assistant turns.

    Raises UnsupportedTemplateError when no special token closes an assistant turn (the splice could not tell where
    the model's ids end), NoAssistantTurnsError when no probe renders an assistant turn at all.
    """
    special = special_tokens_of(renderer)
    pattern = re.compile("|".join(re.escape(t) for t in sorted(special, key=len, reverse=True))) if special else None
    closers: set[str] = set()
    last_closers: set[str] = set()
    headers: dict[bool, list[tuple[str, bool, str | None]]] = {False: [], True: []}
    rendered_any = False
    for conversation, assistant_index, tools in _probes():
        after_tool = conversation[assistant_index - 1]["role"] == "tool"
        neutral = neutralize(conversation, assistant_index)
        try:
            text = _render(renderer, neutral, tools, add_generation_prompt=assistant_index < len(conversation) - 1)
        except Exception:  # noqa: BLE001 - a template may refuse a probe shape (no tools, no system); try the others
            continue
        spans = placeholder_spans(text)
        if assistant_index not in spans:  # a template that renders nothing of a bare tool call: show its text
            neutral = neutralize(conversation, assistant_index, frozenset({assistant_index}))
            try:
                text = _render(renderer, neutral, tools, add_generation_prompt=assistant_index < len(conversation) - 1)
            except Exception:  # noqa: BLE001 - as above
                continue
            spans = placeholder_spans(text)
            if assistant_index not in spans:
                continue
        rendered_any = True
        first, last = spans[assistant_index]
        is_last = assistant_index == len(conversation) - 1
        closer = _closer(pattern, text, last, _next_text_at(text, conversation, assistant_index), renderer, special)
        if closer is not None:
            (last_closers if is_last else closers).add(closer)
        try:
            prompt = _render(renderer, neutral[:assistant_index], tools, add_generation_prompt=True)
        except Exception:  # noqa: BLE001 - probes are best effort
            continue
        # The model's ids start where the generation prompt ends: the header is the history's text before the body
        # (from the last special token) as far as the generation prompt's text (from its last special token) agrees.
        anchor, anchor_end = _last_special(pattern, text, first)
        before_body = text[anchor_end:first]
        generation_tail = prompt[_last_special(pattern, prompt, len(prompt))[1] :]
        header = before_body[: _common_prefix_length(before_body, generation_tail)]
        texts = [m["content"] for m in conversation if m["role"] != "assistant" and isinstance(m.get("content"), str)]
        holds_message_text = any(message_text in header for message_text in texts if message_text)
        if holds_message_text:  # what follows the last message text: the role header itself
            header = header[max(header.rfind(t) + len(t) for t in texts if t and t in header) :]
        headers[after_tool].append((header, holds_message_text, anchor))
    if not rendered_any:
        raise NoAssistantTurnsError(
            "the chat template renders no assistant turn in any probe conversation (a reranker, embedder or other "
            "fixed-prompt template?), so there is no model turn to splice"
        )
    if terminator_override:
        if terminator_override not in special:
            raise UnsupportedTemplateError(f"{TERMINATOR_ENV}={terminator_override!r} is not a special token")
        closers = {terminator_override}
    if not closers and not renderer.end_token_ids:
        raise UnsupportedTemplateError(
            "the chat template closes assistant turns with no special token and the model has no end token, so the "
            "model's own ids cannot be told apart from the template's text"
        )
    end_tokens = {token for token, token_id in special.items() if token_id in renderer.end_token_ids}
    moves_call_text = _moves_call_text(renderer)
    replaced = {token for token in last_closers - closers if token in end_tokens}
    return TemplateProfile(
        closers=frozenset(closers),
        end_token_ids=frozenset(renderer.end_token_ids),
        replaced_end_tokens=frozenset(replaced),
        assistant_header=_header(headers[False]),
        header_after_tool=_header(headers[True]) if headers[True] else _header(headers[False]),
        special_tokens=special,
        closed_by_text=not closers,
        moves_call_text=moves_call_text,
        overridden=bool(terminator_override),
    )


def _moves_call_text(renderer: ChatRenderer) -> bool:
    """Whether a tool-calling assistant message's text comes after the tool's result in the template's rendering."""
    conversation = [
        {"role": "user", "content": "Hello there."},
        {"role": "assistant", "content": "ngtcalltext7q", "tool_calls": [_CALL]},
        {"role": "tool", "tool_call_id": "call_0", "content": "ngtresult7q"},
    ]
    try:
        text = _render(renderer, conversation, [_TOOL], add_generation_prompt=True)
    except Exception:  # noqa: BLE001 - no tool support: nothing to move
        return False
    return "ngtresult7q" in text and text.find("ngtcalltext7q") > text.find("ngtresult7q")


def special_tokens_of(renderer: ChatRenderer) -> dict[str, int]:
    """The renderer's special tokens (role markers, terminators); every added token where none is marked."""
    return dict(renderer.special_tokens) if renderer.special_tokens else dict(renderer.added_tokens)


def _render(renderer: ChatRenderer, messages: list[dict[str, Any]], tools: Any, *, add_generation_prompt: bool) -> str:
    render_with_tools = getattr(renderer, "render_with_tools", None)
    if tools and render_with_tools is not None:
        return render_with_tools(messages, tools, add_generation_prompt=add_generation_prompt)
    return renderer.render(messages, add_generation_prompt=add_generation_prompt)


def _probes() -> list[tuple[list[dict[str, Any]], int, list[dict[str, Any]] | None]]:
    """(conversation, index of the assistant turn looked at, tools) to render, most common shapes first."""
    user = {"role": "user", "content": "Hello there."}
    again = {"role": "user", "content": "And once more?"}
    system = {"role": "system", "content": "Be brief."}
    reply = {"role": "assistant", "content": "Hi."}
    call = {"role": "assistant", "content": "", "tool_calls": [_CALL]}  # a tool call alone, as models send them
    thought = {"role": "assistant", "content": "Hi.", "reasoning_content": "Greet back."}
    result = {"role": "tool", "tool_call_id": "call_0", "content": "a greeting"}
    other_result = {"role": "tool", "tool_call_id": "call_0", "content": "no such word"}
    return [
        ([user, reply, again], 1, None),
        ([system, user, reply, again], 2, None),
        ([user, reply, again, dict(reply), dict(again)], 3, None),
        ([user, call, result], 1, [_TOOL]),
        ([user, call, result, reply, again], 3, [_TOOL]),
        ([user, call, other_result, reply, again], 3, [_TOOL]),
        ([user, thought, again], 1, None),
        ([user, reply], 1, None),
        ([system, user, reply], 2, None),
    ]


def _next_text_at(text: str, conversation: list[dict[str, Any]], assistant_index: int) -> int:
    """Where the next message's text starts in `text` (the end of the text when there is none)."""
    for message in conversation[assistant_index + 1 :]:
        at = text.find(message["content"]) if isinstance(message.get("content"), str) and message["content"] else -1
        if at >= 0:
            return at
    return len(text)


def _closer(
    pattern: re.Pattern[str] | None,
    text: str,
    body_end: int,
    next_text: int,
    renderer: ChatRenderer,
    special: dict[str, int],
) -> str | None:
    """The special token that closes the turn: the first of the model's end tokens between the body and the next
    message, else the first special token there (GLM-4: the next role token; GPT-OSS history: <|end|>). Tool-call
    markup that is itself special (Kimi's <|tool_call_end|>) comes first but does not end the turn."""
    if pattern is None:
        return None
    found = [match.group(0) for match in pattern.finditer(text, body_end, max(next_text, body_end))]
    if not found:
        match = pattern.search(text, body_end)
        return match.group(0) if match else None
    ends = [token for token in found if special[token] in renderer.end_token_ids]
    return ends[0] if ends else found[0]


def _header(samples: list[tuple[str, bool, str | None]]) -> Header:
    """One header from the probes': what they all start with (templates that add a reasoning block to some turns
    only still share the role header). Where message text precedes it, each sample starts after the last message
    text, and the header is the longer of what they all start with and what they all end with."""
    trailing = any(has_text for _, has_text, _ in samples)
    texts = [text for text, _, _ in samples]
    anchors = frozenset(anchor for _, _, anchor in samples if anchor is not None)
    if trailing:
        # A reasoning block opened in some turns only (ERNIE: "\nAssistant: <think>") extends those samples at the
        # end; samples that differ at the start instead share their end: the header is the longer shared part.
        header = max(_common_prefix(texts), _common_suffix(texts), key=len)
        return Header(header, follows_special=False, anchors=anchors)
    return Header(_common_prefix(texts), anchors=anchors)


def _last_special(pattern: re.Pattern[str] | None, text: str, before: int) -> tuple[str | None, int]:
    """The last special token before `before` and where it ends (None, 0 when there is none)."""
    last: tuple[str | None, int] = (None, 0)
    if pattern:
        for match in pattern.finditer(text, 0, before):
            last = (match.group(0), match.end())
    return last


def _common_prefix_length(left: str, right: str) -> int:
    length = 0
    for a, b in zip(left, right):
        if a != b:
            break
        length += 1
    return length


def _common_prefix(texts: list[str]) -> str:
    if not texts:
        return ""
    prefix = texts[0]
    for text in texts[1:]:
        prefix = prefix[: _common_prefix_length(prefix, text)]
    return prefix


def _common_suffix(texts: list[str]) -> str:
    if not texts:
        return ""
    suffix = texts[0]
    for text in texts[1:]:
        while suffix and not text.endswith(suffix):
            suffix = suffix[1:]
    return suffix
