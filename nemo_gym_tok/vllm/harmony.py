"""The splice on GPT-OSS chat completions, which vLLM renders with openai_harmony instead of a chat template."""

from __future__ import annotations

from typing import Any

from nemo_gym_tok.splice import (
    PrefixSource,
    SpliceError,
    SpliceResult,
    TemplateProfile,
    UnsupportedTemplateError,
)
from nemo_gym_tok.splice_host import new_segment_telemetry
from nemo_gym_tok.vllm.chat_rendering import host_of, plain_message, tokenizer_facts
from nemo_gym_tok.vllm.internals import WRAPPED_MARKER
from nemo_gym_tok.vllm.request_prefix import as_400, read_request, signature_of
from nemo_gym_tok.vllm.telemetry import remember

HARMONY_TOKENIZE_REFUSAL = (
    "this model speaks Harmony (GPT-OSS): vLLM renders its chat completions with openai_harmony, but /tokenize "
    "renders the Hugging Face chat template (another system preamble and date, other tool-message headers), so "
    "/tokenize cannot give the prompt ids of a request with a token prefix. Take them from the chat completion "
    "itself: choice.message.prompt_token_ids (with logprobs: true) or the top-level prompt_token_ids (with "
    "return_token_ids: true)"
)


def _apply(request: Any, engine_inputs: list[Any], result: SpliceResult | dict[str, Any]) -> None:
    """Give the engine the spliced ids (Harmony: rendered to ids already) and remember the telemetry."""
    if isinstance(result, dict):  # a first-turn prefix: checked, nothing spliced; its telemetry
        remember(request, result)
        return
    from nemo_gym_tok.vllm import metrics

    engine_inputs[0]["prompt_token_ids"] = result.prompt_token_ids
    engine_inputs[0].pop("prompt", None)  # the template's text no longer describes these ids
    remember(request, result.telemetry())
    metrics.spliced()
    metrics.measured(result)


def harmony_with_splice(original: Any) -> Any:
    """Wrap the (synchronous) Harmony render of GPT-OSS chat completions with the splice."""

    def _make_request_with_harmony(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        with as_400():
            asked = read_request(self, request, request.messages)
        harmony_messages, engine_inputs = original(self, request, *args, **kwargs)
        # No messages: vLLM took the kv_transfer_params token reuse path and rendered nothing; left as it is.
        if asked.source is None or not harmony_messages:
            return harmony_messages, engine_inputs
        if asked.new_segment:
            remember(request, new_segment_telemetry())
            return harmony_messages, engine_inputs
        with as_400():
            include_tools = (
                signature_of(original).bind(self, request, *args, **kwargs).arguments.get("should_include_tools", True)
            )
            result = _splice_harmony(self, request, bool(include_tools), asked.source, engine_inputs)
        _apply(request, engine_inputs, result)
        return harmony_messages, engine_inputs

    return _make_request_with_harmony


def _splice_harmony(
    online: Any, request: Any, include_tools: bool, source: PrefixSource, engine_inputs: list[Any]
) -> SpliceResult | dict[str, Any]:
    if len(engine_inputs) != 1 or "prompt_token_ids" not in engine_inputs[0]:
        raise SpliceError("the prefix splice supports text-only chats rendered to one token prompt")
    template_ids = list(engine_inputs[0]["prompt_token_ids"])
    host = host_of(online)
    renderer = HarmonyRenderer(online, request, include_tools)
    if source.message_index < 0:
        return host.check_first_turn(template_ids, source, renderer)
    # Harmony always ends the prompt with `<|start|>assistant` (no add_generation_prompt, no continue_final_message)
    # and applies no truncate_prompt_tokens while rendering. Its renderings are not memoized: everything on the
    # request but its messages reaches Harmony's rendering, which no scope key names.
    return host.splice(
        host.scoped(renderer, None),
        harmony_profile(online),
        [plain_message(m) for m in request.messages],
        source,
        add_generation_prompt=True,
        continue_final_message=False,
        truncate_prompt_tokens=None,
        template_text=renderer.decode(template_ids),
    ).result()


class HarmonyRenderer:
    """ChatRenderer over vLLM's own Harmony rendering (GPT-OSS), with one request's tools and reasoning effort.

    The template text is the tokenizer's decoding of the ids vLLM's `_make_request_with_harmony` renders (called
    unwrapped, on a copy of the request holding the messages to render), so the splice's text-level algorithm
    applies. Without a generation prompt the trailing `<|start|>assistant` is left out, and a last assistant
    message on the final channel closes with `<|return|>` as the Hugging Face gpt-oss template renders it (how a
    sampled turn ends), instead of the `<|end|>` Harmony gives it in history.
    """

    def __init__(self, online: Any, request: Any, include_tools: bool) -> None:
        self._online = online
        self._request = request
        self._include_tools = include_tools
        wrapped = type(online)._make_request_with_harmony
        self._make_request = getattr(wrapped, WRAPPED_MARKER, wrapped)  # vLLM's own render, not the hook's splice
        self.tokenizer = online.renderer.get_tokenizer()
        self.added_tokens, self.special_tokens, self.end_token_ids = tokenizer_facts(online)
        self._generation_prompt = self.encode("<|start|>assistant")
        self._end, self._return = self.added_tokens.get("<|end|>"), self.added_tokens.get("<|return|>")

    def render(self, messages: Any, *, add_generation_prompt: bool, continue_final_message: bool = False) -> str:
        if continue_final_message:
            raise UnsupportedTemplateError("Harmony (GPT-OSS) prompts cannot continue a final message")
        tools = self._request.tools if self._include_tools else None
        return self._render(messages, tools, self._include_tools, add_generation_prompt)

    def render_with_tools(self, messages: Any, tools: Any, *, add_generation_prompt: bool) -> str:
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionToolsParam

        validated = [ChatCompletionToolsParam.model_validate(tool) for tool in tools] if tools else None
        return self._render(messages, validated, validated is not None, add_generation_prompt)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: Any) -> str:
        return self.tokenizer.decode(list(ids))

    def _render(self, messages: Any, tools: Any, include_tools: bool, add_generation_prompt: bool) -> str:
        copy = self._request.model_copy(update={"messages": [_harmony_input(m) for m in messages], "tools": tools})
        harmony_messages, engine_inputs = self._make_request(self._online, copy, include_tools)
        ids = list(engine_inputs[0]["prompt_token_ids"])
        if not add_generation_prompt:
            cut = len(ids) - len(self._generation_prompt)
            if ids[cut:] != self._generation_prompt:
                raise UnsupportedTemplateError("vLLM's Harmony prompt does not end with <|start|>assistant")
            ids = ids[:cut]
            last = harmony_messages[-1] if harmony_messages else None
            if (
                last is not None
                and str(getattr(last.author.role, "value", last.author.role)) == "assistant"
                and last.channel == "final"
                and ids
                and ids[-1] == self._end
                and self._return is not None
            ):
                ids[-1] = self._return
        return self.decode(ids)


def _harmony_input(message: Any) -> dict[str, Any]:
    """A message as vLLM's request validation hands it to Harmony (the deprecated reasoning_content renamed)."""
    plain = dict(plain_message(message))
    if "reasoning_content" in plain:
        reasoning = plain.pop("reasoning_content")
        if plain.get("reasoning") is None:
            plain["reasoning"] = reasoning
    return plain


def harmony_profile(online: Any) -> TemplateProfile:
    """The turn structure of vLLM's Harmony rendering, detected once per server (it has no template arguments)."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    def renderer() -> HarmonyRenderer:
        return HarmonyRenderer(online, ChatCompletionRequest(messages=[{"role": "user", "content": "Hello."}]), False)

    return host_of(online).profile("harmony", renderer)
