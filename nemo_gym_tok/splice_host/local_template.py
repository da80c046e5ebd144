"""The served model's tokenizer and chat template loaded in this process: the adapter's TemplateRenderer, per scope."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from nemo_gym_tok.common.jinja_sandbox import memoize_attribute_checks
from nemo_gym_tok.splice import HFChatRenderer, TemplateProfile
from nemo_gym_tok.splice_host.host import ScopedRenderer, SpliceHost, profile_key, scope_key


class LocalTemplate:
    """A local copy of what a vLLM server renders with: its renderers by scope and its splice state (a SpliceHost)."""

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
        self.host = SpliceHost(terminator_override=terminator_override)

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
        """The renderer of one scope (its content-format probe and token maps cost more than a turn: made once)."""
        return self.host.renderer(
            scope_key(chat_template, template_kwargs, tools),
            lambda: HFChatRenderer(
                self.tokenizer,
                tools=tools,
                template_kwargs={**self.default_template_kwargs, **template_kwargs},
                chat_template=chat_template or self.chat_template,
                extra_end_token_ids=self.end_token_ids,
                content_format=self.content_format,
            ),
        )

    def profile(self, template_kwargs: Mapping[str, Any], chat_template: str | None) -> TemplateProfile:
        """The turn structure for one template and template-argument combination (detected without tools)."""
        return self.host.profile(
            profile_key(chat_template, template_kwargs), lambda: self.renderer(None, template_kwargs, chat_template)
        )


def template_text(chat_template: str | None) -> str | None:
    """A chat template given as a file path or as the template itself."""
    if chat_template and "\n" not in chat_template and "{" not in chat_template and Path(chat_template).is_file():
        return Path(chat_template).read_text()
    return chat_template
