"""The served model's tokenizer and chat template in the adapter process, with what its splices learn kept across
requests (template profiles, renderers per scope, the render memo), as the hook keeps them per vLLM server."""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nemo_gym_tok.common.jinja_sandbox import memoize_attribute_checks
from nemo_gym_tok.splice import HFChatRenderer, RenderMemo, TemplateProfile, detect_profile

MAX_SCOPES = 256
"""Renderers and profiles kept: callers choose template arguments and tools freely, so both caches are bounded."""


@dataclass
class ScopedRenderer(HFChatRenderer):
    """An HFChatRenderer for one scope (template, template arguments, tools) that carries the memo the splice reuses
    from turn to turn (nemo_gym_tok.splice: `render_memo`, `render_scope`, `piece_cache`)."""

    render_scope: str = ""
    render_memo: RenderMemo | None = None
    piece_cache: dict[str, list[int]] = field(default_factory=dict)


def scope_key(tools: Any, template_kwargs: Mapping[str, Any], chat_template: str | None) -> str:
    """Everything a rendering depends on but the messages and flags, as one string."""
    return json.dumps([chat_template, template_kwargs, tools], sort_keys=True, default=repr)


class LocalTemplate:
    """The served model's tokenizer and chat template in the adapter process."""

    def __init__(
        self,
        tokenizer: Any,
        *,
        chat_template: str | None,
        content_format: str,
        end_token_ids: Sequence[int],
        default_template_kwargs: Mapping[str, Any],
        terminator_override: str | None = None,
        vocab_size: int | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.content_format = content_format
        self.end_token_ids = tuple(end_token_ids)
        self.default_template_kwargs = dict(default_template_kwargs)
        self.vocab_size = max(vocab_size or 0, len(tokenizer))
        """The model's vocabulary (its embedding rows, which may outnumber the tokenizer's tokens: a model can
        generate the extra ids, and vLLM accepts them), as the hook checks ids against it."""
        self.render_memo = RenderMemo()
        """Shared by every scope (its keys hold the scope): a next turn finds this turn's renderings and prompt."""
        self._piece_cache: dict[str, list[int]] = {}
        self._terminator_override = terminator_override
        self._profiles: OrderedDict[str, TemplateProfile] = OrderedDict()
        self._renderers: OrderedDict[str, ScopedRenderer] = OrderedDict()
        self._lock = threading.Lock()

    @classmethod
    def load(
        cls,
        source: str,
        *,
        chat_template: str | None,
        content_format: str,
        default_template_kwargs: Mapping[str, Any],
        terminator_override: str | None = None,
        local_files_only: bool = False,
    ) -> LocalTemplate:
        """Load the tokenizer (directory or hub name; `local_files_only`: from the hub cache, without asking the hub)
        and the generation config's end ids; blocking."""
        from transformers import AutoConfig, AutoTokenizer, GenerationConfig

        memoize_attribute_checks()  # the local renderings: the same text, sooner (jinja_sandbox's docstring)
        tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=local_files_only)
        try:
            model_config = AutoConfig.from_pretrained(source, local_files_only=local_files_only)
            vocab_size = getattr(model_config.get_text_config(), "vocab_size", None)
        except (OSError, ValueError):  # a tokenizer-only directory: its own size is all there is to check against
            vocab_size = None
        try:
            configured = GenerationConfig.from_pretrained(source, local_files_only=local_files_only).eos_token_id
        except (OSError, ValueError):  # no generation config: the tokenizer's eos is the only end id
            configured = None
        ends = [
            value for value in (configured if isinstance(configured, list) else [configured]) if isinstance(value, int)
        ]
        return cls(
            tokenizer,
            chat_template=template_text(chat_template),
            content_format=content_format,
            end_token_ids=ends,
            default_template_kwargs=default_template_kwargs,
            terminator_override=terminator_override,
            vocab_size=vocab_size if isinstance(vocab_size, int) else None,
        )

    def renderer(
        self, tools: list[dict[str, Any]] | None, template_kwargs: Mapping[str, Any], chat_template: str | None
    ) -> ScopedRenderer:
        """The renderer of one scope, made once (its content-format probe and token maps cost more than a turn)."""
        key = scope_key(tools, template_kwargs, chat_template)
        with self._lock:
            renderer = self._renderers.get(key)
            if renderer is not None:
                self._renderers.move_to_end(key)
                return renderer
        renderer = ScopedRenderer(
            self.tokenizer,
            tools=tools,
            template_kwargs={**self.default_template_kwargs, **template_kwargs},
            chat_template=chat_template or self.chat_template,
            extra_end_token_ids=self.end_token_ids,
            content_format=self.content_format,
            render_scope=key,
            render_memo=self.render_memo,
            piece_cache=self._piece_cache,
        )
        with self._lock:
            _put(self._renderers, key, renderer)
        return renderer

    def profile(self, template_kwargs: Mapping[str, Any], chat_template: str | None) -> TemplateProfile:
        """The turn structure for one template and template-argument combination (detected without tools)."""
        key = scope_key(None, template_kwargs, chat_template)
        with self._lock:
            profile = self._profiles.get(key)
        if profile is None:
            profile = detect_profile(
                self.renderer(None, template_kwargs, chat_template), terminator_override=self._terminator_override
            )
            with self._lock:
                _put(self._profiles, key, profile)
        return profile


def template_text(chat_template: str | None) -> str | None:
    """A chat template given as a file path or as the template itself."""
    if chat_template and "\n" not in chat_template and "{" not in chat_template and Path(chat_template).is_file():
        return Path(chat_template).read_text()
    return chat_template


def _put(entries: OrderedDict[str, Any], key: str, value: Any) -> None:
    entries[key] = value
    entries.move_to_end(key)
    while len(entries) > MAX_SCOPES:
        entries.popitem(last=False)
