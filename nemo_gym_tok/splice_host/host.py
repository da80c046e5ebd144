"""One server's splice state and the splice of one request with it, the same for the hook and the adapter.

What renders the template differs (vLLM's own renderer in the hook, the adapter's local copy of the served template):
both are a TemplateRenderer. Everything else is kept here once: template profiles and renderers by scope with one
eviction policy (least recently used out past `max_scopes`), the piece cache and the render memo every request of
the server shares, the first-turn check and the telemetry's shape.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, TypeVar

from nemo_gym_tok.splice import (
    ChatRenderer,
    PrefixSource,
    RenderMemo,
    SplicedPrompt,
    StageClock,
    TemplateProfile,
    check_starts_with,
    detect_profile,
    splice_new_turn,
    splice_prompt,
)
from nemo_gym_tok.splice_host.request import first_turn_telemetry

MAX_SCOPES = 256
"""Profiles and renderers kept per server: callers choose template arguments and tools freely, so both are bounded."""
RENDERING_FLAGS = ("add_generation_prompt", "continue_final_message", "tools")
"""Template arguments a profile does not depend on (it renders its own probes with and without them)."""

Made = TypeVar("Made")


class TemplateRenderer(ChatRenderer, Protocol):
    """What renders a server's chat template for the splice: a ChatRenderer that can also render other tools."""

    def render_with_tools(
        self, messages: Sequence[Mapping[str, Any]], tools: Any, *, add_generation_prompt: bool
    ) -> str: ...


class ScopedRenderer:
    """A TemplateRenderer bound to one scope of a host: the splice reads `render_scope`, `render_memo` and
    `piece_cache` from it to reuse what earlier requests of the server rendered and tokenized."""

    def __init__(self, inner: TemplateRenderer, render_scope: str | None, host: SpliceHost) -> None:
        self.inner = inner
        self.render_scope = render_scope or ""
        self.render_memo = host.render_memo if render_scope is not None else None
        self.piece_cache = host.piece_cache
        self.tokenizer = getattr(inner, "tokenizer", None)
        """The batch decoder reads the tokenizer's fast backend from here (nemo_gym_tok.splice.batch_decoder)."""
        self.added_tokens = inner.added_tokens
        self.special_tokens = inner.special_tokens
        self.end_token_ids = inner.end_token_ids
        # Bound once: the splice calls these many times a request.
        self.render = inner.render
        self.render_with_tools = inner.render_with_tools
        self.encode = inner.encode
        self.decode = inner.decode


def scope_key(*parts: Any) -> str:
    """Everything a rendering depends on but the messages and the flags, as one string (a cache key)."""
    try:
        return json.dumps(parts, sort_keys=True, default=repr)
    except (TypeError, ValueError):  # keys of mixed types cannot be sorted: the representation still tells apart
        return repr(parts)


def profile_key(chat_template: Any, template_kwargs: Mapping[str, Any] | None) -> str:
    """The key of a template profile: the template and its arguments but the rendering flags."""
    kwargs = {key: value for key, value in (template_kwargs or {}).items() if key not in RENDERING_FLAGS}
    return scope_key(chat_template, kwargs)


class SpliceHost:
    """What one server keeps for its splices, shared by all its requests (and safe to share across threads)."""

    def __init__(self, *, terminator_override: str | None = None, max_scopes: int = MAX_SCOPES) -> None:
        self.terminator_override = terminator_override
        self.max_scopes = max_scopes
        self.render_memo = RenderMemo()
        """Neutral renderings and spliced prompts: the next turn of a conversation renders this one's again."""
        self.piece_cache: dict[str, list[int]] = {}
        """Ids of short template pieces (role headers): see nemo_gym_tok.splice.FixedTextMatcher."""
        self._profiles: OrderedDict[str, TemplateProfile] = OrderedDict()
        self._renderers: OrderedDict[str, ScopedRenderer] = OrderedDict()
        self._facts: dict[str, Any] = {}
        self._lock = threading.Lock()

    def scoped(self, inner: TemplateRenderer, scope: str | None) -> ScopedRenderer:
        """`inner` bound to `scope` (a renderer made for one request); None for a renderer whose scope cannot be
        named, whose renderings are then not memoized."""
        return ScopedRenderer(inner, scope, self)

    def renderer(self, scope: str, make: Callable[[], TemplateRenderer]) -> ScopedRenderer:
        """The kept renderer of `scope`, made once by `make` (a renderer whose making costs more than a turn)."""
        with self._lock:
            kept = self._renderers.get(scope)
            if kept is not None:
                self._renderers.move_to_end(scope)
                return kept
        made = self.scoped(make(), scope)
        with self._lock:
            self._keep(self._renderers, scope, made)
        return made

    def profile(self, key: str, renderer: Callable[[], ChatRenderer]) -> TemplateProfile:
        """The turn structure of the template and arguments `key` names (profile_key), detected once with
        `renderer()`; raises what detect_profile raises for a template the splice cannot serve."""
        with self._lock:
            kept = self._profiles.get(key)
            if kept is not None:
                self._profiles.move_to_end(key)
                return kept
        detected = detect_profile(renderer(), terminator_override=self.terminator_override)
        with self._lock:
            self._keep(self._profiles, key, detected)
        return detected

    def fact(self, name: str, learn: Callable[[], Made]) -> Made:
        """A fact of the server learned once (its tokenizer's added tokens, its end ids, an encoder)."""
        known = self._facts.get(name)
        if known is None:
            known = self._facts.setdefault(name, learn())
        return known

    def check_first_turn(
        self, template_ids: Sequence[int], source: PrefixSource, renderer: ChatRenderer
    ) -> dict[str, Any]:
        """A prefix sent before any assistant turn: the template's own ids must start with it. Its telemetry."""
        check_starts_with(template_ids, source.prefix, renderer.decode)
        return first_turn_telemetry()

    def splice(
        self,
        renderer: ScopedRenderer,
        profile: TemplateProfile,
        messages: Sequence[Any],
        source: PrefixSource,
        *,
        add_generation_prompt: bool,
        continue_final_message: bool,
        truncate_prompt_tokens: Any,
        template_text: str | None,
        defer_verify: bool = False,
        new_turn: bool = True,
    ) -> SplicedPrompt:
        """The request's spliced prompt (nemo_gym_tok.splice.splice_prompt); `truncate_prompt_tokens` as the request
        holds it (a negative or absent value truncates nothing)."""
        return splice_prompt(
            renderer,
            profile,
            messages,
            source,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            truncate_prompt_tokens=_truncation(truncate_prompt_tokens),
            template_text=template_text,
            defer_verify=defer_verify,
            new_turn=new_turn,
        )

    def splice_new_turn(
        self,
        renderer: ScopedRenderer,
        profile: TemplateProfile,
        messages: Sequence[Any],
        source: PrefixSource,
        *,
        add_generation_prompt: bool,
        continue_final_message: bool,
        truncate_prompt_tokens: Any,
        vocab_size: int | None = None,
        clock: StageClock | None = None,
    ) -> SplicedPrompt | None:
        """The request's spliced prompt at the cost of its new messages (nemo_gym_tok.splice.splice_new_turn), before
        anything renders the whole conversation; None where the full check (`splice`) must decide."""
        if not add_generation_prompt or continue_final_message or source.message_index < 0:
            return None
        return splice_new_turn(
            renderer,
            profile,
            messages,
            source,
            truncate_prompt_tokens=_truncation(truncate_prompt_tokens),
            vocab_size=vocab_size,
            clock=clock,
        )

    def _keep(self, entries: OrderedDict[str, Any], key: str, value: Any) -> None:
        entries[key] = value
        entries.move_to_end(key)
        while len(entries) > self.max_scopes:
            entries.popitem(last=False)


def _truncation(truncate_prompt_tokens: Any) -> int | None:
    """`truncate_prompt_tokens` as the request holds it, as the splice reads it: a negative or absent value truncates
    nothing."""
    return truncate_prompt_tokens if isinstance(truncate_prompt_tokens, int) and truncate_prompt_tokens >= 0 else None
