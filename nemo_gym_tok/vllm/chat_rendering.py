"""The hook's TemplateRenderer: one request's chat template rendered by vLLM's own renderer, and the splice host
each vLLM API-server renderer keeps (template profiles, tokenizer facts, the render memo)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from nemo_gym_tok.splice import TERMINATOR_ENV as TERMINATOR_ENV
from nemo_gym_tok.splice import (
    TemplateProfile,
    UnsupportedTemplateError,
    added_token_maps,
    text_encoder,
    with_own_tool_calls,
)
from nemo_gym_tok.splice_host import ScopedRenderer, SpliceHost, profile_key, scope_key

HOST_ATTRIBUTE = "_nemo_gym_tok_splice_host"
"""Where an OnlineRenderer keeps its SpliceHost: on the object itself, so the host lives and dies with it."""


def host_of(online: Any) -> SpliceHost:
    """The splice host of one vLLM API-server renderer, made on first use."""
    host = online.__dict__.get(HOST_ATTRIBUTE)
    if host is None:
        host = online.__dict__[HOST_ATTRIBUTE] = SpliceHost(terminator_override=os.environ.get(TERMINATOR_ENV) or None)
    return host


class RequestRenderer:
    """TemplateRenderer over vLLM's own renderer, with one request's template, template arguments and tools."""

    def __init__(
        self, online: Any, request: Any, default_template: Any, content_format: Any, default_kwargs: Any, tools: Any
    ) -> None:
        self._online = online
        self._request = request
        self.template, self.content_format = template_and_format(online, default_template, content_format)
        self._kwargs = default_kwargs if default_kwargs is not None else online.default_chat_template_kwargs
        self._tools = tools
        self.tokenizer = online.renderer.get_tokenizer()
        host = host_of(online)
        self.encode = host.fact("encode", lambda: text_encoder(self.tokenizer))
        self.added_tokens, self.special_tokens, self.end_token_ids = tokenizer_facts(online)

    def scope(self) -> str:
        """Everything a rendering depends on but the messages and flags: the request's own template arguments
        (chat_template_kwargs, reasoning effort, ...) as vLLM's chat params hold them, the defaults and the tools."""
        params = self._request.build_chat_params(self.template, self.content_format)
        return scope_key(params, self._kwargs, self._tools)

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


def scoped_renderer(
    online: Any, request: Any, default_template: Any, content_format: Any, default_kwargs: Any, tools: Any
) -> ScopedRenderer:
    """One request's renderer, bound to its scope of the server's splice host."""
    renderer = RequestRenderer(online, request, default_template, content_format, default_kwargs, tools)
    return host_of(online).scoped(renderer, renderer.scope())


def profile_for(
    online: Any, request: Any, default_template: Any, content_format: Any, default_kwargs: Any
) -> TemplateProfile:
    """The template profile for this request's template and template arguments, detected once per combination."""
    params = request.build_chat_params(*template_and_format(online, default_template, content_format))
    return host_of(online).profile(
        profile_key(params.chat_template, params.chat_template_kwargs),
        lambda: scoped_renderer(online, request, default_template, content_format, default_kwargs, None),
    )


def template_and_format(online: Any, default_template: Any, content_format: Any) -> tuple[Any, Any]:
    """The chat template and content format a request renders with: its caller's defaults, else the server's."""
    return (
        default_template if default_template is not None else online.chat_template,
        content_format if content_format is not None else online.chat_template_content_format,
    )


def tokenizer_facts(online: Any) -> tuple[dict[str, int], dict[str, int], frozenset[int]]:
    """The served tokenizer's added and special tokens by text, and the ids generation stops on. Read once per server:
    the end ids come from the generation config on disk, not to be read again on every spliced request."""

    def learn() -> tuple[dict[str, int], dict[str, int], frozenset[int]]:
        tokenizer = online.renderer.get_tokenizer()
        added, special = added_token_maps(tokenizer)
        return added, special, end_token_ids(online.model_config, tokenizer)

    return host_of(online).fact("tokenizer facts", learn)


def end_token_ids(model_config: Any, tokenizer: Any) -> frozenset[int]:
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


def plain_message(message: Any) -> Any:
    """A chat message as the splice reads it: a plain dict, whose tool calls are its own. vLLM's rendering turns each
    tool call's `arguments` into a dict in place (its chat_utils' message post-processing); the splice's key of a
    conversation (the render memo's) must read every request's messages as the client sent them, whichever of
    vLLM's renderings ran first."""
    if not isinstance(message, dict):
        if hasattr(message, "model_dump"):
            return message.model_dump(exclude_none=True)
        return dict(message) if isinstance(message, Mapping) else message
    return with_own_tool_calls(message)
