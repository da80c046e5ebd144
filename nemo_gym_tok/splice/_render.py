"""What the splice needs from a chat template and its tokenizer, and an implementation over a transformers tokenizer."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from nemo_gym_tok.common.exact_json import loads_exact


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
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool,
        continue_final_message: bool = False,
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
    content_format: str = "auto"
    """How message text reaches the template: "string", "openai" (a list of text parts, for templates that loop over
    content parts) or "auto" (whichever shows a probe message's text, as vLLM's content-format detection decides)."""
    added_tokens: Mapping[str, int] = field(init=False)
    special_tokens: Mapping[str, int] = field(init=False)
    end_token_ids: frozenset[int] = field(init=False)

    def __post_init__(self) -> None:
        self.added_tokens, self.special_tokens = added_token_maps(self.tokenizer)
        ends = set(self.extra_end_token_ids)
        if self.tokenizer.eos_token_id is not None:
            ends.add(int(self.tokenizer.eos_token_id))
        self.end_token_ids = frozenset(ends)
        if self.content_format == "auto":
            self.content_format = self._detect_content_format()
        self._encode = text_encoder(self.tokenizer)

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool,
        continue_final_message: bool = False,
    ) -> str:
        return self.tokenizer.apply_chat_template(
            template_messages(messages, as_parts=self.content_format == "openai"),
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

    def _detect_content_format(self) -> str:
        probe = [{"role": "user", "content": "ngtprobe7q"}]
        for content_format in ("string", "openai"):
            try:
                text = self.tokenizer.apply_chat_template(
                    template_messages(probe, as_parts=content_format == "openai"),
                    chat_template=self.chat_template,
                    add_generation_prompt=True,
                    tokenize=False,
                    **self.template_kwargs,
                )
            except Exception:  # noqa: BLE001 - a template that cannot take this format
                continue
            if "ngtprobe7q" in text:
                return content_format
        return "string"

    def encode(self, text: str) -> list[int]:
        return self._encode(text)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)


def text_encoder(tokenizer: Any) -> Callable[[str], list[int]]:
    """`tokenizer.encode(text, add_special_tokens=False)`, straight from the Rust backend where that is all it does.

    A transformers fast tokenizer spends most of a short text's encode in Python (argument handling, a batch of one,
    the backend's thread pool); its backend's single `encode` gives the same ids. Only where the tokenizer splits
    special tokens as text (`split_special_tokens`) or has no such backend does the transformers call stay.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if (
        backend is not None
        and hasattr(backend, "encode")
        and not getattr(tokenizer, "split_special_tokens", False)
        and not getattr(backend, "encode_special_tokens", False)
    ):
        return lambda text: backend.encode(text, add_special_tokens=False).ids
    return lambda text: list(tokenizer.encode(text, add_special_tokens=False))


def batch_decoder(renderer: Any) -> Callable[[list[list[int]]], list[str]]:
    """Decode many id runs at once, each exactly (special tokens kept, no clean-up of spaces).

    A renderer may bring its own `decode_batch`; over a transformers fast tokenizer the Rust backend decodes the
    whole batch in one call, which costs far less than tokenizing the same text; otherwise one `decode` per run.
    """
    own = getattr(renderer, "decode_batch", None)
    if own is not None:
        return own
    backend = getattr(getattr(renderer, "tokenizer", None), "backend_tokenizer", None)
    if backend is not None and hasattr(backend, "decode_batch"):
        return lambda runs: backend.decode_batch(runs, skip_special_tokens=False)
    return lambda runs: [renderer.decode(run) for run in runs]


def added_token_maps(tokenizer: Any) -> tuple[dict[str, int], dict[str, int]]:
    """A transformers tokenizer's added tokens by text: all of them, and those marked special."""
    added = tokenizer.added_tokens_decoder.items()
    return (
        {token.content: token_id for token_id, token in added},
        {token.content: token_id for token_id, token in added if token.special},
    )


def template_messages(messages: Sequence[Mapping[str, Any]], *, as_parts: bool = False) -> list[dict[str, Any]]:
    """Messages as vLLM hands them to a chat template: tool-call arguments as objects (JSON text parsed; anything
    that is not an object becomes {}), an empty tool_calls list dropped, and text content as a list of text parts for
    templates that loop over parts (`as_parts`)."""
    prepared = []
    for message in messages:
        message = dict(message)
        if as_parts and isinstance(message.get("content"), str):
            message["content"] = [{"type": "text", "text": message["content"]}]
        calls = message.get("tool_calls")
        if message.get("role") == "assistant" and isinstance(calls, list):
            if not calls:
                message.pop("tool_calls")
            else:
                message["tool_calls"] = [_with_object_arguments(call) for call in calls]
        prepared.append(message)
    return prepared


def _with_object_arguments(call: Any) -> Any:
    if not isinstance(call, Mapping) or not isinstance(call.get("function"), Mapping):
        return call
    function = dict(call["function"])
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = loads_exact(arguments) if arguments else {}
        except ValueError:
            arguments = {}
    function["arguments"] = arguments if isinstance(arguments, Mapping) else {}
    return {**call, "function": function}
