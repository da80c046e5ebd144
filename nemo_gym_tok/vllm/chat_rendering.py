"""The splice's view of vLLM's chat template rendering: one request's renderer, and what a server learns once
(template profiles, tokenizer facts)."""

from __future__ import annotations

import json
import os
from typing import Any

from nemo_gym_tok.splice import (
    TERMINATOR_ENV as TERMINATOR_ENV,
)
from nemo_gym_tok.splice import (
    RenderMemo,
    TemplateProfile,
    UnsupportedTemplateError,
    added_token_maps,
    detect_profile,
    text_encoder,
)


class _RequestRenderer:
    """ChatRenderer over vLLM's own renderer, with one request's template, template arguments and tools."""

    def __init__(
        self, online: Any, request: Any, default_template: Any, content_format: Any, default_kwargs: Any, tools: Any
    ) -> None:
        self._online = online
        self._request = request
        self.template, self.content_format = _template_and_format(online, default_template, content_format)
        self._kwargs = default_kwargs if default_kwargs is not None else online.default_chat_template_kwargs
        self._tools = tools
        self.tokenizer = online.renderer.get_tokenizer()
        self.encode = _cache_of(online).setdefault("encode", text_encoder(self.tokenizer))
        self.added_tokens, self.special_tokens, self.end_token_ids = _tokenizer_facts(online)
        self.piece_cache: dict[str, list[int]] = _cache_of(online).setdefault("pieces", {})
        """Ids of short template pieces (role headers), shared by the server's requests: see splice._fixed_text."""
        self.render_memo: RenderMemo = _cache_of(online).setdefault("renders", RenderMemo())
        """Neutral renderings shared by the server's requests: the next turn renders this one's again (splice._memo)."""
        # Everything a rendering depends on but the messages and flags: the request's own template arguments
        # (chat_template_kwargs, reasoning effort, ...) as vLLM's chat params hold them, the defaults and the tools.
        params = request.build_chat_params(self.template, self.content_format)
        self.render_scope = repr((params, self._kwargs, _tools_key(tools)))

    def render(self, messages: Any, *, add_generation_prompt: bool, continue_final_message: bool = False) -> str:
        return self._render(messages, self._tools, add_generation_prompt, continue_final_message)

    def render_with_tools(self, messages: Any, tools: Any, *, add_generation_prompt: bool) -> str:
        return self._render(messages, tools, add_generation_prompt, False)

    def decode(self, ids: Any) -> str:
        return self.tokenizer.decode(list(ids))

    def _render(self, messages: Any, tools: Any, add_generation_prompt: bool, continue_final_message: bool) -> str:
        from vllm.renderers.params import merge_kwargs

        request = self._request.model_copy(
            update={"add_generation_prompt": add_generation_prompt, "continue_final_message": continue_final_message}
        )
        params = request.build_chat_params(self.template, self.content_format).with_defaults(
            merge_kwargs(self._kwargs, {"tools": tools, "tokenize": False})
        )
        _, prompt = self._online.renderer.render_messages(list(messages), params)
        text = prompt.get("prompt") if isinstance(prompt, dict) else None
        if not isinstance(text, str):
            raise UnsupportedTemplateError("this model's renderer does not produce prompt text, which the splice needs")
        return text


def _tools_key(tools: Any) -> str:
    try:
        return json.dumps(tools, sort_keys=True, default=repr)
    except (TypeError, ValueError):
        return repr(tools)


def _cache_of(online: Any) -> dict[Any, Any]:
    """What the hook learned about one API-server renderer (template profiles, tokenizer facts), kept on the object
    itself so it lives and dies with it."""
    cache = online.__dict__.get(_CACHE_ATTRIBUTE)
    if cache is None:
        cache = online.__dict__[_CACHE_ATTRIBUTE] = {}
    return cache


_CACHE_ATTRIBUTE = "_nemo_gym_tok_cache"
_MAX_PROFILES = 256
"""Profiles kept per server: one per template-argument combination, and callers could vary those freely."""


def _profile_for(
    online: Any, request: Any, default_template: Any, content_format: Any, default_kwargs: Any
) -> TemplateProfile:
    """The template profile for this request's template and template arguments, detected once per combination."""
    params = request.build_chat_params(*_template_and_format(online, default_template, content_format))
    template_kwargs = {
        key: value
        for key, value in (params.chat_template_kwargs or {}).items()
        if key not in ("add_generation_prompt", "continue_final_message", "tools")
    }
    key = (params.chat_template, repr(sorted(template_kwargs.items(), key=lambda item: item[0])))
    profiles = _cache_of(online).setdefault("profiles", {})
    profile = profiles.get(key)
    if profile is None:
        renderer = _RequestRenderer(online, request, default_template, content_format, default_kwargs, None)
        profile = detect_profile(renderer, terminator_override=os.environ.get(TERMINATOR_ENV) or None)
        if len(profiles) >= _MAX_PROFILES:
            profiles.clear()
        profiles[key] = profile
    return profile


def _template_and_format(online: Any, default_template: Any, content_format: Any) -> tuple[Any, Any]:
    """The chat template and content format a request renders with: its caller's defaults, else the server's."""
    return (
        default_template if default_template is not None else online.chat_template,
        content_format if content_format is not None else online.chat_template_content_format,
    )


def _tokenizer_facts(online: Any) -> tuple[dict[str, int], dict[str, int], frozenset[int]]:
    """The served tokenizer's added and special tokens by text, and the ids generation stops on. Read once per server:
    the end ids come from the generation config on disk, not to be read again on every spliced request."""
    cache = _cache_of(online)
    facts = cache.get("tokenizer facts")
    if facts is None:
        tokenizer = online.renderer.get_tokenizer()
        added, special = added_token_maps(tokenizer)
        facts = cache["tokenizer facts"] = (added, special, _end_token_ids(online.model_config, tokenizer))
    return facts


def _end_token_ids(model_config: Any, tokenizer: Any) -> frozenset[int]:
    """The ids generation stops on: the generation config's eos ids and the tokenizer's eos."""
    ends: set[int] = set()
    try:
        configured = (model_config.try_get_generation_config() or {}).get("eos_token_id")
    except Exception:  # noqa: BLE001 - a model without a readable generation config still has the tokenizer's eos
        configured = None
    for value in configured if isinstance(configured, list) else [configured]:
        if isinstance(value, int):
            ends.add(value)
    if tokenizer.eos_token_id is not None:
        ends.add(int(tokenizer.eos_token_id))
    return frozenset(ends)


def _plain_message(message: Any) -> Any:
    if isinstance(message, dict):
        return message
    return message.model_dump(exclude_none=True) if hasattr(message, "model_dump") else dict(message)
