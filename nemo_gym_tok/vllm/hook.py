"""The prefix-splice hook inside vLLM's API server: the one module that depends on vLLM internals.

It wraps two methods:
- `OnlineRenderer.preprocess_chat` (chat templating for `/v1/chat/completions` and `/tokenize`): when the request
  carries `required_prefix_token_ids` or a bundled assistant message, the engine gets the model's exact prefix
  ids followed by the template's tail (see nemo_gym_tok.splice);
- `OpenAIServingChat.chat_completion_full_generator` (non-streaming chat responses): adds the top-level
  `prefix_splice` telemetry and, with `logprobs` requested, this call's bundle on each `choice.message`.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
import weakref
from collections.abc import AsyncIterator
from typing import Any

from nemo_gym_tok.splice import (
    PREFIX_KEY,
    PrefixSource,
    SpliceError,
    SpliceResult,
    check_starts_with,
    find_prefix_source,
    splice_prefix,
)

logger = logging.getLogger("nemo_gym_tok.vllm.hook")

ENABLE_ENV = "NEMO_GYM_TOK_PREFIX_SPLICE"
TERMINATOR_ENV = "NEMO_GYM_TOK_TURN_TERMINATOR"
ALLOW_UNTESTED_ENV = "NEMO_GYM_TOK_ALLOW_UNTESTED_VLLM"
TESTED_VLLM_VERSIONS = ("0.32.",)
"""vLLM releases whose internals this module was tested against (version prefixes)."""

# module, class, method: what the hook wraps. A vLLM upgrade that moves any of these fails `check_internals()`.
PATCHED_METHODS = (
    ("vllm.renderers.online_renderer", "OnlineRenderer", "preprocess_chat"),
    ("vllm.entrypoints.openai.chat_completion.serving", "OpenAIServingChat", "chat_completion_full_generator"),
)
# Other internals the wrappers use.
USED_SYMBOLS = (
    ("vllm.exceptions", "VLLMValidationError"),
    ("vllm.entrypoints.openai.chat_completion.protocol", "ChatCompletionResponse"),
)
_MARKER = "__nemo_gym_tok_original__"

# Splice telemetry of in-flight requests, by id(request); each entry leaves with its request.
_telemetry: dict[int, dict[str, Any]] = {}


class VLLMInternalsChanged(RuntimeError):
    """The vLLM internals the hook wraps are not where this version of the hook expects them."""


def check_internals() -> list[str]:
    """Names of the patched or used vLLM symbols that are missing (empty when all are in place)."""
    missing = []
    for module_name, class_name, method in PATCHED_METHODS:
        owner = _lookup(module_name, class_name)
        if owner is None or not callable(getattr(owner, method, None)):
            missing.append(f"{module_name}.{class_name}.{method}")
    for module_name, symbol in USED_SYMBOLS:
        if _lookup(module_name, symbol) is None:
            missing.append(f"{module_name}.{symbol}")
    return missing


def is_installed() -> bool:
    module_name, class_name, method = PATCHED_METHODS[0]
    owner = _lookup(module_name, class_name)
    return owner is not None and hasattr(getattr(owner, method), _MARKER)


def install() -> None:
    """Wrap vLLM's chat templating and chat responses; idempotent (safe in every API-server process)."""
    import vllm

    if not vllm.__version__.startswith(TESTED_VLLM_VERSIONS) and os.environ.get(ALLOW_UNTESTED_ENV) != "1":
        raise VLLMInternalsChanged(
            f"nemo_gym_tok's prefix-splice hook is tested on vLLM {', '.join(v + 'x' for v in TESTED_VLLM_VERSIONS)}, "
            f"found {vllm.__version__}; set {ALLOW_UNTESTED_ENV}=1 to try anyway"
        )
    missing = check_internals()
    if missing:
        raise VLLMInternalsChanged(
            f"vLLM {vllm.__version__} moved what the prefix-splice hook wraps: missing {', '.join(missing)}"
        )
    if is_installed():
        return
    renderer_cls = _lookup(*PATCHED_METHODS[0][:2])
    serving_cls = _lookup(*PATCHED_METHODS[1][:2])
    _wrap(renderer_cls, "preprocess_chat", _preprocess_chat_with_splice)
    _wrap(serving_cls, "chat_completion_full_generator", _full_generator_with_bundle)
    logger.info("nemo_gym_tok prefix-splice hook installed (vLLM %s)", vllm.__version__)


def _wrap(owner: type, name: str, make_wrapper: Any) -> None:
    original = getattr(owner, name)
    wrapper = functools.wraps(original)(make_wrapper(original))
    setattr(wrapper, _MARKER, original)
    setattr(owner, name, wrapper)


def _lookup(module_name: str, name: str) -> Any:
    try:
        return getattr(importlib.import_module(module_name), name, None)
    except ImportError:
        return None


def _preprocess_chat_with_splice(original: Any) -> Any:
    from vllm.exceptions import VLLMValidationError

    from nemo_gym_tok.vllm import metrics

    async def preprocess_chat(self: Any, request: Any, messages: list[Any], *args: Any, **kwargs: Any) -> Any:
        try:
            vocab_size = self.model_config.get_vocab_size()
            source = find_prefix_source(messages, getattr(request, PREFIX_KEY, None), vocab_size)
        except SpliceError as exc:
            metrics.rejected()
            raise VLLMValidationError(str(exc), parameter=PREFIX_KEY) from None
        conversation, engine_inputs = await original(self, request, messages, *args, **kwargs)
        if source is None:
            return conversation, engine_inputs
        tokenizer = self.renderer.get_tokenizer()
        try:
            result = await _splice(self, original, request, messages, args, kwargs, source, engine_inputs, tokenizer)
        except SpliceError as exc:
            metrics.rejected()
            raise VLLMValidationError(str(exc), parameter=PREFIX_KEY) from None
        if result is None:  # a first-turn prefix: checked, nothing spliced
            _remember(request, {"applied": False, "template_differed": False, "replaced_tokens": 0})
            return conversation, engine_inputs
        engine_inputs[0]["prompt_token_ids"] = result.prompt_token_ids
        engine_inputs[0].pop("prompt", None)  # the template's text no longer describes these ids
        _remember(request, result.telemetry())
        metrics.spliced(result)
        return conversation, engine_inputs

    return preprocess_chat


async def _splice(
    renderer: Any, original: Any, request: Any, messages: list[Any], args: tuple[Any, ...], kwargs: dict[str, Any],
    source: PrefixSource, engine_inputs: list[Any], tokenizer: Any,
) -> SpliceResult | None:
    if len(engine_inputs) != 1 or "prompt_token_ids" not in engine_inputs[0]:
        raise SpliceError("the prefix splice supports text-only chats rendered to one token prompt")
    if source.message_index < 0:
        check_starts_with(engine_inputs[0]["prompt_token_ids"], source.prefix, tokenizer.decode)
        return None
    # The template's ids for the history up to and including the prefix's assistant message: no generation prompt.
    history_request = request.model_copy(update={"add_generation_prompt": False, "continue_final_message": False})
    history_kwargs = {**kwargs, "parser": None, "skip_mm_cache": True}
    history_args = args[:4]  # default template, its content format, default kwargs, tool dicts
    _, (history_input,) = await original(
        renderer, history_request, messages[: source.message_index + 1], *history_args, **history_kwargs
    )
    return splice_prefix(
        terminator_id=_terminator_id(tokenizer),
        model_prefix=source.prefix,
        template_history=history_input["prompt_token_ids"],
        template_full=engine_inputs[0]["prompt_token_ids"],
        decode=tokenizer.decode,
    )


def _terminator_id(tokenizer: Any) -> int:
    """The template's turn terminator: $NEMO_GYM_TOK_TURN_TERMINATOR (a token string), else the tokenizer's EOS."""
    configured = os.environ.get(TERMINATOR_ENV)
    if configured:
        token_id = tokenizer.convert_tokens_to_ids(configured)
        if not isinstance(token_id, int) or token_id == getattr(tokenizer, "unk_token_id", None):
            raise SpliceError(f"{TERMINATOR_ENV}={configured!r} is not a token of this tokenizer")
        return token_id
    if tokenizer.eos_token_id is None:
        raise SpliceError(f"the tokenizer has no EOS token; set {TERMINATOR_ENV} to the template's turn terminator")
    return int(tokenizer.eos_token_id)


def _remember(request: Any, telemetry: dict[str, Any]) -> None:
    key = id(request)
    _telemetry[key] = telemetry
    weakref.finalize(request, _telemetry.pop, key, None)


def _full_generator_with_bundle(original: Any) -> Any:
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionResponse

    async def chat_completion_full_generator(
        self: Any, request: Any, result_generator: AsyncIterator[Any], *args: Any, **kwargs: Any
    ) -> Any:
        telemetry = _telemetry.pop(id(request), None)
        wants_bundle = bool(getattr(request, "logprobs", False))
        if telemetry is None and not wants_bundle:
            return await original(self, request, result_generator, *args, **kwargs)
        outputs: list[Any] = []

        async def remembering_last() -> AsyncIterator[Any]:
            async for output in result_generator:
                outputs[:] = [output]
                yield output

        response = await original(self, request, remembering_last(), *args, **kwargs)
        if not isinstance(response, ChatCompletionResponse):
            return response
        if telemetry is not None:
            response.prefix_splice = telemetry
        if wants_bundle and outputs:
            _attach_bundles(response, outputs[0])
        return response

    return chat_completion_full_generator


def _attach_bundles(response: Any, final: Any) -> None:
    prompt_ids = list(final.prompt_token_ids or [])
    by_index = {output.index: output for output in final.outputs}
    for choice in response.choices:
        output = by_index.get(choice.index)
        if output is None or output.logprobs is None:
            continue
        generation_ids = list(output.token_ids)
        choice.message.prompt_token_ids = prompt_ids
        choice.message.generation_token_ids = generation_ids
        choice.message.generation_log_probs = [
            float(step[token].logprob) for token, step in zip(generation_ids, output.logprobs)
        ]
