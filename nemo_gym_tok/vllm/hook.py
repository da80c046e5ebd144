"""The prefix-splice hook inside vLLM's API server: the one module that depends on vLLM internals.

It wraps six methods (nemo_gym_tok.vllm.routes wraps the other chat-rendering routes' own):
- `OnlineRenderer.preprocess_chat` (chat templating for `/v1/chat/completions` and `/tokenize`): reads the request's
  prefix (`required_prefix_token_ids` or the last bundled assistant message) and times preprocessing
  (`nemo_gym_tok_preprocess_seconds` on `/metrics`). On a Harmony model (GPT-OSS) only `/tokenize` comes here, and
  a request with a prefix is refused (it renders the Hugging Face template, not the Harmony prompt generation uses);
- `BaseRenderer.tokenize_prompts_async` (the tokenization step of vLLM's chat rendering): for a request with a
  prefix, the template's text is not tokenized; the engine gets the model's exact prefix ids followed by the ids of
  the template's text after it, once the structural check holds (see nemo_gym_tok.splice). vLLM then goes on as for
  any tokenized prompt (length checks, the request parser's prompt ids), with the spliced ids;
- `OnlineRenderer._make_request_with_harmony` (GPT-OSS chat completions, rendered by openai_harmony): the same
  splice, with vLLM's own Harmony rendering as the template (`_HarmonyRenderer`);
- `OnlineRenderer.warmup` (server start-up): detects the chat template's turn structure and logs what it found;
- `OpenAIServingChat.chat_completion_full_generator` (non-streaming chat responses): adds the top-level
  `prefix_splice` telemetry and, with `logprobs` requested, this call's bundle on each `choice.message`;
- `OpenAIServingChat.chat_completion_stream_generator` (streaming chat responses): the first chunk carries
  `prefix_splice`, and a request that asks for usage gets one extra chunk before `data: [DONE]` with the telemetry
  and, with `logprobs`, each choice's bundle on its `delta` (docs/hook.md, "Streaming").
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import importlib
import inspect
import json
import logging
import os
import re
import time
import weakref
from collections.abc import AsyncIterator, Iterator
from typing import Any

from nemo_gym_tok.constrained import CONSTRAINED_BY_KEY, FORCED_MASK_KEY, constrained_by, forced_mask
from nemo_gym_tok.splice import (
    NEW_SEGMENT_KEY,
    RenderMemo,
    PREFIX_KEY,
    PrefixSource,
    SpliceError,
    SplicedPrompt,
    SpliceResult,
    TemplateProfile,
    UnsupportedTemplateError,
    added_token_maps,
    check_starts_with,
    detect_profile,
    find_prefix_source,
    splice_prefix,
    splice_prompt,
    text_encoder,
)
from nemo_gym_tok.vllm import routes
from nemo_gym_tok.vllm.routes import ROUTE_METHODS

logger = logging.getLogger("nemo_gym_tok.vllm.hook")

ENABLE_ENV = "NEMO_GYM_TOK_PREFIX_SPLICE"
TERMINATOR_ENV = "NEMO_GYM_TOK_TURN_TERMINATOR"
ALLOW_UNTESTED_ENV = "NEMO_GYM_TOK_ALLOW_UNTESTED_VLLM"
SUPPORTED_VLLM = ((0, 29), (0, 34))
"""The vLLM releases the hook supports, as (major, minor): from the first (inclusive) to the second (exclusive), i.e.
0.29 to 0.33 (docs/vllm-versions.md). Inside the range the hook installs whenever `check_internals()` finds what it
wraps; outside it only with NEMO_GYM_TOK_ALLOW_UNTESTED_VLLM=1 (and the same check)."""

# module, class, method: what the hook wraps. A vLLM upgrade that moves any of these fails `check_internals()`.
PATCHED_METHODS = (
    ("vllm.renderers.online_renderer", "OnlineRenderer", "preprocess_chat"),
    ("vllm.renderers.online_renderer", "OnlineRenderer", "warmup"),
    ("vllm.entrypoints.openai.chat_completion.serving", "OpenAIServingChat", "chat_completion_full_generator"),
    ("vllm.renderers.online_renderer", "OnlineRenderer", "_make_request_with_harmony"),
    ("vllm.entrypoints.openai.chat_completion.serving", "OpenAIServingChat", "chat_completion_stream_generator"),
    ("vllm.renderers.base", "BaseRenderer", "tokenize_prompts_async"),
)
# Other internals the wrappers use.
# preprocess_chat's parameters the splice reads (by name, as vLLM's callers pass them).
PREPROCESS_CHAT_PARAMETERS = (
    "request", "messages", "default_template", "default_template_content_format", "default_template_kwargs", "tool_dicts",
)
# tokenize_prompts_async's parameters: the rendered text prompts and the tokenization parameters. A prompt that
# already holds `prompt_token_ids` is not tokenized again (the splice relies on that: `ngt vllm-compat` checks it).
TOKENIZE_PROMPTS_PARAMETERS = ("prompts", "params")
# _make_request_with_harmony's parameters, and what it returns: (Harmony messages, [{"prompt_token_ids": ...}]).
HARMONY_PARAMETERS = ("request", "should_include_tools")
USED_SYMBOLS = (
    ("vllm.exceptions", "VLLMValidationError"),
    ("vllm.renderers.params", "ChatParams"),
    ("vllm.renderers.params", "merge_kwargs"),
    ("vllm.entrypoints.openai.chat_completion.protocol", "ChatCompletionResponse"),
    ("vllm.entrypoints.openai.chat_completion.protocol", "ChatCompletionRequest"),
    ("vllm.entrypoints.openai.chat_completion.protocol", "ChatCompletionToolsParam"),
)
_MARKER = "__nemo_gym_tok_original__"

# Splice telemetry of in-flight requests, by id(request); each entry leaves with its request.
_telemetry: dict[int, dict[str, Any] | _TelemetryLater] = {}


class VLLMInternalsChanged(RuntimeError):
    """The vLLM internals the hook wraps are not where this version of the hook expects them."""


def check_internals() -> list[str]:
    """Names of the patched or used vLLM symbols that are missing (empty when all are in place). A route method whose
    route the installed vLLM does not serve (routes.not_served: a release that predates it, or an optional package
    its routes need that does not import here) is not missing: there is no such route to guard."""
    import vllm

    missing = []
    for module_name, class_name, method in (*PATCHED_METHODS, *ROUTE_METHODS):
        owner = _lookup(module_name, class_name)
        if owner is None or not callable(getattr(owner, method, None)):
            if not routes.not_served((module_name, class_name, method), vllm.__version__):
                missing.append(f"{module_name}.{class_name}.{method}")
    checked = (
        (PATCHED_METHODS[0], PREPROCESS_CHAT_PARAMETERS), (PATCHED_METHODS[3], HARMONY_PARAMETERS),
        (PATCHED_METHODS[5], TOKENIZE_PROMPTS_PARAMETERS),
    )
    for patched, expected in checked:
        method = getattr(_lookup(*patched[:2]), patched[2], None)
        if method is not None:
            parameters = inspect.signature(getattr(method, _MARKER, method)).parameters
            missing.extend(f"{'.'.join(patched)}({name}=...)" for name in expected if name not in parameters)
    for module_name, symbol in USED_SYMBOLS:
        if _lookup(module_name, symbol) is None:
            missing.append(f"{module_name}.{symbol}")
    return missing


def is_installed() -> bool:
    module_name, class_name, method = PATCHED_METHODS[0]
    owner = _lookup(module_name, class_name)
    return owner is not None and hasattr(getattr(owner, method), _MARKER)


def is_supported_vllm(version: str) -> bool:
    """Whether a vLLM version string (`0.32.0`, `0.33.1rc1`, `0.30.0+cpu`) lies in SUPPORTED_VLLM."""
    match = re.match(r"(\d+)\.(\d+)", version)
    if match is None:
        return False
    release = (int(match[1]), int(match[2]))
    return SUPPORTED_VLLM[0] <= release < SUPPORTED_VLLM[1]


def supported_vllm_text() -> str:
    """SUPPORTED_VLLM for people: `0.29 to 0.33`."""
    (low_major, low_minor), (high_major, high_minor) = SUPPORTED_VLLM
    # The upper bound is exclusive; within one major version the last supported minor is one below it.
    last = f"{high_major}.{high_minor - 1}" if high_minor > 0 else f"below {high_major}.0"
    return f"{low_major}.{low_minor} to {last}"


def install() -> None:
    """Wrap vLLM's chat templating and chat responses; idempotent (safe in every API-server process)."""
    import vllm

    if not is_supported_vllm(vllm.__version__):
        if os.environ.get(ALLOW_UNTESTED_ENV) != "1":
            raise VLLMInternalsChanged(
                f"nemo_gym_tok's prefix-splice hook supports vLLM {supported_vllm_text()}, found {vllm.__version__}; "
                f"set {ALLOW_UNTESTED_ENV}=1 to try anyway (it still installs only if every vLLM internal it wraps "
                "is in place)"
            )
        logger.warning(
            "nemo_gym_tok prefix-splice hook: vLLM %s is outside the supported range %s; trying because %s=1",
            vllm.__version__, supported_vllm_text(), ALLOW_UNTESTED_ENV,
        )
    # The authority inside the range too: a release that moved what the hook wraps is refused, naming it.
    missing = check_internals()
    if missing:
        raise VLLMInternalsChanged(
            f"vLLM {vllm.__version__} moved what the prefix-splice hook wraps: missing {', '.join(missing)}"
        )
    if is_installed():
        return
    renderer_cls = _lookup(*PATCHED_METHODS[0][:2])
    serving_cls = _lookup(*PATCHED_METHODS[2][:2])
    _wrap(_lookup(*PATCHED_METHODS[5][:2]), "tokenize_prompts_async", _tokenize_with_splice)
    _wrap(renderer_cls, "preprocess_chat", _preprocess_chat_with_splice)
    _wrap(renderer_cls, "warmup", _warmup_with_profile)
    _wrap(serving_cls, "chat_completion_full_generator", _full_generator_with_bundle)
    _wrap(serving_cls, "chat_completion_stream_generator", _stream_generator_with_bundle)
    _wrap(renderer_cls, "_make_request_with_harmony", _harmony_with_splice)
    routes.install(_wrap)  # the other routes that render chat messages: splice with the full check, or refuse
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


def _warmup_with_profile(original: Any) -> Any:
    import vllm

    def warmup(self: Any) -> None:
        original(self)
        try:
            if getattr(self, "use_harmony", False):
                profile = _harmony_profile(self)
            else:
                profile = _profile_for(self, _startup_request(), None, None, None)
        except SpliceError as exc:
            logger.warning(
                "nemo_gym_tok prefix-splice hook active (vLLM %s), but it cannot splice for this chat template: %s",
                vllm.__version__, exc,
            )
            return
        logger.info("nemo_gym_tok prefix-splice hook active (vLLM %s): %s", vllm.__version__, profile.describe())

    return warmup


def _startup_request() -> Any:
    """A request with no template arguments and no tools, built as vLLM builds a client's: the profile it detects is
    the one a request without chat_template_kwargs uses (the profile cache keys on the template arguments), so it must
    render every probe exactly as such a request would (add_generation_prompt included)."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    return ChatCompletionRequest(messages=[{"role": "user", "content": "Hello."}])


def _preprocess_chat_with_splice(original: Any) -> Any:
    async def preprocess_chat(self: Any, request: Any, messages: list[Any], *args: Any, **kwargs: Any) -> Any:
        from nemo_gym_tok.vllm import metrics

        started = time.perf_counter()
        path = "refused"
        try:
            with _as_400():
                source, new_segment = _read_prefix(self, request, messages)
                if source is not None and getattr(self, "use_harmony", False):
                    raise SpliceError(HARMONY_TOKENIZE_REFUSAL)
            if source is None or new_segment:
                # Read before vLLM runs: its token-reuse path pops the forwarded ids from the request.
                unspliced_path = "new_segment" if source is not None else "token_in" if _forwards_ids(request) else "template"
                answer = await original(self, request, messages, *args, **kwargs)
                if source is not None:
                    _remember(request, dict(_NEW_SEGMENT))
                path = unspliced_path
                return answer
            if source.message_index < 0:  # a first-turn prefix: the template's own ids must start with it
                conversation, engine_inputs = await original(self, request, messages, *args, **kwargs)
                with _as_400():
                    _check_first_turn(self, engine_inputs, source)
                _remember(request, {"applied": False, "template_differed": False, "replaced_tokens": 0})
                path = "template"
                return conversation, engine_inputs
            bound = _signature(original).bind(self, request, messages, *args, **kwargs)
            pending = _PendingSplice(self, request, messages, bound.arguments, source)
            reset = _pending_splice.set(pending)
            try:
                answer = await original(*bound.args, **bound.kwargs)
            finally:
                _pending_splice.reset(reset)
            if pending.result is None:
                with _as_400():
                    raise SpliceError(
                        "the prefix splice needs vLLM to render this request's messages as chat template text (a "
                        "request that forwards kv_transfer_params.prompt_token_ids, or a tokenizer that templates "
                        "to ids, takes another path): send the prefix without kv_transfer_params.prompt_token_ids"
                    )
            _remember(request, _TelemetryLater(pending.result))
            metrics.spliced()
            path = "spliced"
            return answer
        finally:
            metrics.preprocessed(path, time.perf_counter() - started)

    return preprocess_chat


# The splice a request being preprocessed waits for, until vLLM's tokenization step of that request claims it.
# A context variable: concurrent requests each see their own, and vLLM's tasks inherit it from preprocess_chat.
_pending_splice: contextvars.ContextVar[_PendingSplice | None] = contextvars.ContextVar(
    "nemo_gym_tok_pending_splice", default=None
)


class _PendingSplice:
    """One request's splice, computed when vLLM's chat rendering hands its template text to tokenization."""

    def __init__(
        self, online: Any, request: Any, messages: list[Any], arguments: dict[str, Any], source: PrefixSource
    ) -> None:
        self.online, self.request, self.messages, self.arguments, self.source = (
            online, request, messages, arguments, source
        )
        self.claimed = False
        self.result: SplicedPrompt | None = None

    def splice(self, prompts: Any) -> list[Any]:
        """The prompts vLLM is about to tokenize, with the spliced ids in place of tokenizing the template's text."""
        self.claimed = True
        prompt = prompts[0] if len(prompts) == 1 else None
        text = prompt.get("prompt") if isinstance(prompt, dict) else None
        if not isinstance(text, str) or "prompt_token_ids" in prompt or "prompt_embeds" in prompt:
            raise SpliceError("the prefix splice supports text-only chats rendered to one token prompt")
        self.result = _splice(self.online, self.request, self.messages, self.arguments, self.source, text)
        # The template's text no longer describes these ids; vLLM skips tokenizing a prompt that holds its ids.
        spliced = {key: value for key, value in prompt.items() if key != "prompt"}
        spliced["prompt_token_ids"] = self.result.prompt_token_ids
        return [spliced]


def _tokenize_with_splice(original: Any) -> Any:
    async def tokenize_prompts_async(self: Any, prompts: Any, params: Any, *args: Any, **kwargs: Any) -> Any:
        pending = _pending_splice.get()
        if pending is not None and not pending.claimed:
            with _as_400():
                prompts = pending.splice(prompts)
        return await original(self, prompts, params, *args, **kwargs)

    return tokenize_prompts_async


def _answered_whole(request: Any) -> bool:
    """A chat completion answered in one piece (not streamed): nothing generated leaves before the hook's response
    wrapper, so what the splice leaves to verify (SplicedPrompt.verify) can run while the engine generates and still
    turn the answer into a 400. Streams, /tokenize and every other route verify during the splice (nemo_gym_tok.vllm
    .routes: the render routes' answers never pass that wrapper)."""
    return routes.defers_verification(request)


def _forwards_ids(request: Any) -> bool:
    """The request hands vLLM its prompt ids (kv_transfer_params.prompt_token_ids: vLLM's token-reuse path)."""
    forwarded = getattr(request, "kv_transfer_params", None)
    return isinstance(forwarded, dict) and forwarded.get("prompt_token_ids") is not None


def _check_first_turn(online: Any, engine_inputs: list[Any], source: PrefixSource) -> None:
    if len(engine_inputs) != 1 or "prompt_token_ids" not in engine_inputs[0]:
        raise SpliceError("the prefix splice supports text-only chats rendered to one token prompt")
    check_starts_with(list(engine_inputs[0]["prompt_token_ids"]), source.prefix, online.renderer.get_tokenizer().decode)


_NEW_SEGMENT = {"applied": False, "template_differed": False, "replaced_tokens": 0, "new_segment": True}
HARMONY_TOKENIZE_REFUSAL = (
    "this model speaks Harmony (GPT-OSS): vLLM renders its chat completions with openai_harmony, but /tokenize "
    "renders the Hugging Face chat template (another system preamble and date, other tool-message headers), so "
    "/tokenize cannot give the prompt ids of a request with a token prefix. Take them from the chat completion "
    "itself: choice.message.prompt_token_ids (with logprobs: true) or the top-level prompt_token_ids (with "
    "return_token_ids: true)"
)


def _apply(request: Any, engine_inputs: list[Any], result: SpliceResult | None) -> None:
    """Give the engine the spliced ids (Harmony: rendered to ids already) and remember the telemetry."""
    if result is None:  # a first-turn prefix: checked, nothing spliced
        _remember(request, {"applied": False, "template_differed": False, "replaced_tokens": 0})
        return
    from nemo_gym_tok.vllm import metrics

    engine_inputs[0]["prompt_token_ids"] = result.prompt_token_ids
    engine_inputs[0].pop("prompt", None)  # the template's text no longer describes these ids
    _remember(request, result.telemetry())
    metrics.spliced()
    metrics.measured(result)


def _harmony_with_splice(original: Any) -> Any:
    """Wrap the (synchronous) Harmony render of GPT-OSS chat completions with the splice."""

    def _make_request_with_harmony(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        with _as_400():
            source, new_segment = _read_prefix(self, request, request.messages)
        harmony_messages, engine_inputs = original(self, request, *args, **kwargs)
        # No messages: vLLM took the kv_transfer_params token reuse path and rendered nothing; left as it is.
        if source is None or not harmony_messages:
            return harmony_messages, engine_inputs
        if new_segment:
            _remember(request, dict(_NEW_SEGMENT))
            return harmony_messages, engine_inputs
        with _as_400():
            include_tools = _signature(original).bind(self, request, *args, **kwargs).arguments.get(
                "should_include_tools", True
            )
            result = _splice_harmony(self, request, bool(include_tools), source, engine_inputs)
        _apply(request, engine_inputs, result)
        return harmony_messages, engine_inputs

    return _make_request_with_harmony


@contextlib.contextmanager
def _as_400() -> Iterator[None]:
    """A SpliceError inside becomes vLLM's own 400 (OpenAI error body, param required_prefix_token_ids), counted."""
    from vllm.exceptions import VLLMValidationError

    from nemo_gym_tok.vllm import metrics

    try:
        yield
    except SpliceError as exc:
        metrics.rejected()
        raise VLLMValidationError(str(exc), parameter=PREFIX_KEY) from None


def _read_prefix(online: Any, request: Any, messages: list[Any]) -> tuple[PrefixSource | None, bool]:
    """The request's prefix (validated ids) and whether it asks for a new token segment."""
    source = find_prefix_source(messages, getattr(request, PREFIX_KEY, None), online.model_config.get_vocab_size())
    return source, _new_segment_requested(request)


@functools.lru_cache(maxsize=4)
def _signature(function: Any) -> inspect.Signature:
    return inspect.signature(function)


def _new_segment_requested(request: Any) -> bool:
    value = getattr(request, NEW_SEGMENT_KEY, None)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise SpliceError(f"{NEW_SEGMENT_KEY} must be true or false, got {value!r}")
    return value


def _splice(
    online: Any, request: Any, messages: list[Any], arguments: dict[str, Any], source: PrefixSource, template_text: str
) -> SplicedPrompt:
    default_template = arguments.get("default_template")
    content_format = arguments.get("default_template_content_format")
    default_kwargs = arguments.get("default_template_kwargs")
    tool_dicts = arguments.get("tool_dicts")
    renderer = _RequestRenderer(online, request, default_template, content_format, default_kwargs, tool_dicts)
    profile = _profile_for(online, request, default_template, content_format, default_kwargs)
    truncate = getattr(request, "truncate_prompt_tokens", None)
    return splice_prompt(
        renderer, profile, [_plain_message(m) for m in messages], source,
        add_generation_prompt=bool(getattr(request, "add_generation_prompt", True)),
        continue_final_message=bool(getattr(request, "continue_final_message", False)),
        truncate_prompt_tokens=truncate if isinstance(truncate, int) and truncate >= 0 else None,
        template_text=template_text,
        # A stream's first byte (or /tokenize's answer) may leave before the response wrapper runs: those verify now.
        defer_verify=_answered_whole(request),
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
        """Neutral renderings shared by the server's requests: the next turn renders this turn's again (splice._memo)."""
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
        key: value for key, value in (params.chat_template_kwargs or {}).items()
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


def _splice_harmony(
    online: Any, request: Any, include_tools: bool, source: PrefixSource, engine_inputs: list[Any]
) -> SpliceResult | None:
    if len(engine_inputs) != 1 or "prompt_token_ids" not in engine_inputs[0]:
        raise SpliceError("the prefix splice supports text-only chats rendered to one token prompt")
    template_ids = list(engine_inputs[0]["prompt_token_ids"])
    renderer = _HarmonyRenderer(online, request, include_tools)
    if source.message_index < 0:
        check_starts_with(template_ids, source.prefix, renderer.decode)
        return None
    # Harmony always ends the prompt with `<|start|>assistant` (no add_generation_prompt, no continue_final_message)
    # and applies no truncate_prompt_tokens while rendering.
    return splice_prefix(
        renderer, _harmony_profile(online), [_plain_message(m) for m in request.messages], source,
        add_generation_prompt=True, template_text=renderer.decode(template_ids),
    )


class _HarmonyRenderer:
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
        self._make_request = getattr(wrapped, _MARKER, wrapped)  # vLLM's own render, not the hook's splice
        self.tokenizer = online.renderer.get_tokenizer()
        self.added_tokens, self.special_tokens, self.end_token_ids = _tokenizer_facts(online)
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
                last is not None and str(getattr(last.author.role, "value", last.author.role)) == "assistant"
                and last.channel == "final" and ids and ids[-1] == self._end and self._return is not None
            ):
                ids[-1] = self._return
        return self.decode(ids)


def _harmony_input(message: Any) -> dict[str, Any]:
    """A message as vLLM's request validation hands it to Harmony (the deprecated reasoning_content renamed)."""
    plain = dict(_plain_message(message))
    if "reasoning_content" in plain:
        reasoning = plain.pop("reasoning_content")
        if plain.get("reasoning") is None:
            plain["reasoning"] = reasoning
    return plain


def _harmony_profile(online: Any) -> TemplateProfile:
    """The turn structure of vLLM's Harmony rendering, detected once per server (it has no template arguments)."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    cache = _cache_of(online)
    profile = cache.get("harmony profile")
    if profile is None:
        request = ChatCompletionRequest(messages=[{"role": "user", "content": "Hello."}])
        profile = detect_profile(
            _HarmonyRenderer(online, request, False), terminator_override=os.environ.get(TERMINATOR_ENV) or None
        )
        cache["harmony profile"] = profile
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


class _TelemetryLater:
    """A splice's telemetry, finished on the event loop while the engine generates (SplicedPrompt.result).

    What is left of a splice once the engine has its prompt (measuring the turn the call adds, which tokenizes that
    turn's template text, and for a chat completion answered whole the verification of the fast path) does not
    change the prompt. The response wrappers start it when vLLM starts reading the engine's outputs: it runs as one
    callback a couple of loop turns later, once vLLM has sent the request to the engine (which runs in its own
    process), and it is awaited before anything goes out. Not a worker thread: rendering is pure Python, and a
    thread holding the GIL would stall the loop that serves every other request. A verification that fails turns
    the answer into a 400 (the splice says why, and a retry takes the full check). A request nobody answers with
    telemetry (/tokenize) verified during the splice and never measures."""

    def __init__(self, spliced: SplicedPrompt) -> None:
        self._spliced = spliced
        self._future: asyncio.Future[SpliceResult] | None = None

    def start(self) -> None:
        if self._future is None:
            loop = asyncio.get_running_loop()
            self._future = loop.create_future()
            # Two turns: the first lets vLLM's generate() reach the engine before the loop is busy here.
            loop.call_soon(lambda: loop.call_soon(self._finish))

    def _finish(self) -> None:
        assert self._future is not None
        if self._future.done():
            return
        try:
            self._spliced.verify()
        except SpliceError as exc:
            self._future.set_exception(exc)
            return
        except Exception as exc:  # noqa: BLE001 - unverified, the answer must not go out: refused, and logged
            logger.exception("nemo_gym_tok: verifying a spliced prompt failed")
            self._future.set_exception(SpliceError(f"the splice could not be verified ({type(exc).__name__}: {exc})"))
            return
        try:
            self._future.set_result(self._spliced.result())
        except Exception as exc:  # noqa: BLE001 - handed to whoever awaits the telemetry
            self._future.set_exception(exc)

    async def telemetry(self) -> dict[str, Any]:
        from vllm.exceptions import VLLMValidationError

        from nemo_gym_tok.vllm import metrics

        self.start()
        assert self._future is not None
        try:
            with _as_400():
                result = await self._future
        except VLLMValidationError:
            raise
        except Exception:  # noqa: BLE001 - the prompt is verified (_finish) and generated; only its report is missing
            logger.exception("nemo_gym_tok: measuring a spliced turn against the template failed")
            return {"applied": True, "template_differed": False, "replaced_tokens": 0}
        metrics.measured(result)
        return result.telemetry()


async def _resolved(telemetry: dict[str, Any] | _TelemetryLater | None) -> dict[str, Any] | None:
    return await telemetry.telemetry() if isinstance(telemetry, _TelemetryLater) else telemetry


def _remember(request: Any, telemetry: dict[str, Any] | _TelemetryLater) -> None:
    key = id(request)
    _telemetry[key] = telemetry
    weakref.finalize(request, _telemetry.pop, key, None)


def _full_generator_with_bundle(original: Any) -> Any:
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionResponse

    async def chat_completion_full_generator(
        self: Any, request: Any, result_generator: AsyncIterator[Any], *args: Any, **kwargs: Any
    ) -> Any:
        pending = _telemetry.pop(id(request), None)
        wants_bundle = bool(getattr(request, "logprobs", False))
        if pending is None and not wants_bundle:
            return await original(self, request, result_generator, *args, **kwargs)
        if isinstance(pending, _TelemetryLater):
            pending.start()
        outputs: list[Any] = []

        async def remembering_last() -> AsyncIterator[Any]:
            async for output in result_generator:
                outputs[:] = [output]
                yield output

        response = await original(self, request, remembering_last(), *args, **kwargs)
        telemetry = await _resolved(pending)
        if not isinstance(response, ChatCompletionResponse):
            return response
        if telemetry is not None:
            response.prefix_splice = telemetry
        if wants_bundle and outputs:
            _attach_bundles(response, outputs[0], request)
        return response

    return chat_completion_full_generator


def _attach_bundles(response: Any, final: Any, request: Any) -> None:
    """Each choice's bundle on its message, with what constrained the call: `request` is the one vLLM sampled
    with, after its tool parser moved any tool grammar into `structured_outputs` (nemo_gym_tok.constrained)."""
    prompt_ids = list(final.prompt_token_ids or [])
    by_index = {output.index: output for output in final.outputs}
    labels = constrained_by(request)
    for choice in response.choices:
        output = by_index.get(choice.index)
        if output is None or output.logprobs is None:
            continue
        generation_ids = list(output.token_ids)
        log_probs = [float(step[token].logprob) for token, step in zip(generation_ids, output.logprobs)]
        choice.message.prompt_token_ids = prompt_ids
        choice.message.generation_token_ids = generation_ids
        choice.message.generation_log_probs = log_probs
        setattr(choice.message, CONSTRAINED_BY_KEY, list(labels))
        setattr(choice.message, FORCED_MASK_KEY, forced_mask(labels, log_probs))


_SSE_DATA = "data: "
_SSE_DONE = "data: [DONE]\n\n"


def _stream_generator_with_bundle(original: Any) -> Any:
    """Wrap the streaming chat response (an async generator of SSE strings that vLLM returns without awaiting).

    The wrapper is a plain function returning a generator, so a request without a prefix and without a bundle to
    report gets vLLM's own generator, untouched. The splice itself ran in preprocess_chat, before vLLM returned the
    generator, so every refusal is a JSON 400 before the first byte of the stream.
    """

    def chat_completion_stream_generator(
        self: Any, request: Any, result_generator: AsyncIterator[Any], *args: Any, **kwargs: Any
    ) -> AsyncIterator[str]:
        telemetry = _telemetry.pop(id(request), None)
        if isinstance(telemetry, _TelemetryLater):
            telemetry.start()
        final_asked = _usage_requested(self, request)
        wants_bundle = final_asked and bool(getattr(request, "logprobs", False))
        if telemetry is None and not wants_bundle:
            return original(self, request, result_generator, *args, **kwargs)
        record = _StreamRecord(keep_ids=wants_bundle, constrained_by=constrained_by(request) if wants_bundle else [])
        source = record.watch(result_generator) if final_asked else result_generator
        chunks = original(self, request, source, *args, **kwargs)
        return _with_splice_chunks(chunks, telemetry, record if final_asked else None)

    return chat_completion_stream_generator


async def _with_splice_chunks(
    chunks: AsyncIterator[str], pending: dict[str, Any] | _TelemetryLater | None, record: _StreamRecord | None
) -> AsyncIterator[str]:
    """vLLM's stream with `prefix_splice` on its first chunk and, when `record` is given (the request asked for
    usage), the final chunk before `data: [DONE]`."""
    first, last, telemetry, resolved = True, None, None, pending is None
    async with contextlib.aclosing(chunks):  # closing this stream closes vLLM's generator too
        async for chunk in chunks:
            if not resolved:  # the measurement ran while the engine made the first token
                telemetry, resolved = await _resolved(pending), True
            if chunk == _SSE_DONE:
                # Only a stream that ran to its end gets the final chunk: vLLM reports a failure as an error chunk.
                final = _final_chunk(last, telemetry, record) if record is not None and record.complete else None
                if final is not None:
                    yield final
            else:
                if first and telemetry is not None:
                    chunk = _with_top_level(chunk, "prefix_splice", telemetry)
                first, last = False, chunk
            yield chunk


class _StreamRecord:
    """What a streamed request's engine outputs add up to. vLLM streams deltas (RequestOutputKind.DELTA): each
    output holds only the ids and log probs generated since the previous one."""

    def __init__(self, *, keep_ids: bool, constrained_by: list[str]) -> None:
        self.keep_ids = keep_ids
        self.constrained_by = constrained_by
        """What constrained the request's sampling (nemo_gym_tok.constrained), put on each bundle."""
        self.complete = False
        """The engine's outputs ran to their end (not cut by an error or a disconnect)."""
        self.prompt_token_ids: list[int] = []
        self.generations: dict[int, list[int]] = {}
        self.log_probs: dict[int, list[float]] = {}
        self.without_log_probs: set[int] = set()

    async def watch(self, outputs: AsyncIterator[Any]) -> AsyncIterator[Any]:
        async for output in outputs:
            if self.keep_ids:
                self._add(output)
            yield output
        self.complete = True

    def _add(self, output: Any) -> None:
        if output.prompt_token_ids is not None:
            self.prompt_token_ids = list(output.prompt_token_ids)
        for completion in output.outputs:
            new_ids = list(completion.token_ids)
            self.generations.setdefault(completion.index, []).extend(new_ids)
            if completion.logprobs is None:
                self.without_log_probs.add(completion.index)
                continue
            self.log_probs.setdefault(completion.index, []).extend(
                float(step[token].logprob) for token, step in zip(new_ids, completion.logprobs)
            )

    def choices(self) -> list[dict[str, Any]]:
        """One choice per completion with its bundle on `delta`, as `choice.message` carries it when not streaming."""
        if not self.keep_ids:
            return []
        return [
            {
                "index": index,
                "delta": {
                    "prompt_token_ids": self.prompt_token_ids,
                    "generation_token_ids": ids,
                    "generation_log_probs": self.log_probs.get(index, []),
                    CONSTRAINED_BY_KEY: list(self.constrained_by),
                    FORCED_MASK_KEY: forced_mask(self.constrained_by, self.log_probs.get(index, [])),
                },
                "logprobs": None,
                "finish_reason": None,
            }
            for index, ids in sorted(self.generations.items())
            if index not in self.without_log_probs
        ]


def _usage_requested(serving: Any, request: Any) -> bool:
    """Whether vLLM ends this stream with a usage chunk (`stream_options.include_usage`, or the server's
    --enable-force-include-usage): the request then also gets the hook's final chunk."""
    options = getattr(request, "stream_options", None)
    return bool(getattr(serving, "enable_force_include_usage", False) or getattr(options, "include_usage", False))


def _final_chunk(last: str | None, telemetry: dict[str, Any] | None, record: _StreamRecord) -> str | None:
    """The extra chunk: the stream's id, created and model, each choice's bundle on its delta, `prefix_splice`."""
    head = _sse_json(last)
    if head is None or "error" in head:
        return None
    chunk: dict[str, Any] = {
        "id": head.get("id"), "object": "chat.completion.chunk", "created": head.get("created"),
        "model": head.get("model"), "choices": record.choices(),
    }
    if telemetry is not None:
        chunk["prefix_splice"] = telemetry
    elif not chunk["choices"]:
        return None
    return f"{_SSE_DATA}{json.dumps(chunk, separators=(',', ':'), ensure_ascii=False)}\n\n"


def _with_top_level(chunk: str, key: str, value: Any) -> str:
    """An SSE chat chunk with one more top-level field; anything else (an error chunk) unchanged."""
    data = _sse_json(chunk)
    if data is None or "choices" not in data:
        return chunk
    data[key] = value
    return f"{_SSE_DATA}{json.dumps(data, separators=(',', ':'), ensure_ascii=False)}\n\n"


def _sse_json(chunk: str | None) -> dict[str, Any] | None:
    if chunk is None or not chunk.startswith(_SSE_DATA):
        return None
    try:
        data = json.loads(chunk[len(_SSE_DATA):])
    except ValueError:
        return None
    return data if isinstance(data, dict) else None
