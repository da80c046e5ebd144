"""What the splice needs from a chat template and its tokenizer, and an implementation over a transformers tokenizer."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol


class ChatRenderer(Protocol):
    """A chat template with its tokenizer, as the server that generates renders and tokenizes prompts.

    `render` returns the template's text for `messages` (plain dicts in the OpenAI chat shape) with the request's
    template arguments (tools, chat_template_kwargs) already bound; `encode` tokenizes template text the way the
    server tokenizes a chat prompt (added tokens recognised, nothing prepended).
    """

    added_tokens: Mapping[str, int]
    """Every added token (special or not) by its text: tokenizers split text at these before BPE."""
    special_tokens: Mapping[str, int]
    """The added tokens marked special (role markers, terminators): the anchors of a template's structure."""
    end_token_ids: frozenset[int]
    """Ids on which generation stops for this model (generation config's eos ids and the tokenizer's eos)."""

    def render(
        self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool, continue_final_message: bool = False
    ) -> str: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


@dataclass
class HFChatRenderer:
    """ChatRenderer over a transformers tokenizer and its chat template (tests, the template sweep, the adapter)."""

    tokenizer: Any
    tools: list[dict[str, Any]] | None = None
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    chat_template: str | None = None
    extra_end_token_ids: Sequence[int] = ()
    added_tokens: Mapping[str, int] = field(init=False)
    special_tokens: Mapping[str, int] = field(init=False)
    end_token_ids: frozenset[int] = field(init=False)

    def __post_init__(self) -> None:
        added = self.tokenizer.added_tokens_decoder.items()
        self.added_tokens = {token.content: token_id for token_id, token in added}
        self.special_tokens = {token.content: token_id for token_id, token in added if token.special}
        ends = set(self.extra_end_token_ids)
        if self.tokenizer.eos_token_id is not None:
            ends.add(int(self.tokenizer.eos_token_id))
        self.end_token_ids = frozenset(ends)

    def render(
        self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool, continue_final_message: bool = False
    ) -> str:
        return self.tokenizer.apply_chat_template(
            [dict(m) for m in messages],
            tools=self.tools,
            chat_template=self.chat_template,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tokenize=False,
            **self.template_kwargs,
        )

    def render_with_tools(
        self, messages: Sequence[Mapping[str, Any]], tools: list[dict[str, Any]], *, add_generation_prompt: bool
    ) -> str:
        """Render with other tools than the bound ones (template probes)."""
        return HFChatRenderer(self.tokenizer, tools, self.template_kwargs, self.chat_template).render(
            messages, add_generation_prompt=add_generation_prompt
        )

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)
