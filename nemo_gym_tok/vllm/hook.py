"""The prefix-splice hook inside vLLM's API server: installs its wrappers, and splices at vLLM's tokenization step.

Everything that depends on vLLM internals lives in this package (nemo_gym_tok.vllm); `install()` (what the plugin
calls) wraps six methods (nemo_gym_tok.vllm.routes wraps the other chat-rendering routes' own):
- `OnlineRenderer.preprocess_chat` (chat templating for `/v1/chat/completions` and `/tokenize`): reads the request's
  prefix (`required_prefix_token_ids` or the last bundled assistant message) and times preprocessing
  (`nemo_gym_tok_preprocess_seconds` on `/metrics`). On a Harmony model (GPT-OSS) only `/tokenize` comes here, and
  a request with a prefix is refused (it renders the Hugging Face template, not the Harmony prompt generation uses);
- `BaseRenderer.tokenize_prompts_async` (the tokenization step of vLLM's chat rendering): for a request with a
  prefix, the template's text is not tokenized; the engine gets the model's exact prefix ids followed by the ids of
  the template's text after it, once the structural check holds (see nemo_gym_tok.splice). vLLM then goes on as for
  any tokenized prompt (length checks, the request parser's prompt ids), with the spliced ids;
- `OnlineRenderer._make_request_with_harmony` (GPT-OSS chat completions, rendered by openai_harmony): the same
  splice, with vLLM's own Harmony rendering as the template (nemo_gym_tok.vllm.harmony);
- `OnlineRenderer.warmup` (server start-up): detects the chat template's turn structure and logs what it found;
- `OpenAIServingChat.chat_completion_full_generator` (non-streaming chat responses): adds the top-level
  `prefix_splice` telemetry and, with `logprobs` requested, this call's bundle on each `choice.message`;
- `OpenAIServingChat.chat_completion_stream_generator` (streaming chat responses): the first chunk carries
  `prefix_splice`, and a request that asks for usage gets one extra chunk before `data: [DONE]` with the telemetry
  and, with `logprobs`, each choice's bundle on its `delta` (docs/hook.md, "Streaming"); both wrappers live in
  nemo_gym_tok.vllm.chat_responses, the telemetry they report in nemo_gym_tok.vllm.telemetry.
What the hook wraps, and the check that the installed vLLM has it, is nemo_gym_tok.vllm.internals; how it renders a
request's chat template for the splice, nemo_gym_tok.vllm.chat_rendering.
"""

from __future__ import annotations

import contextvars
import importlib
import logging
import os
import time
from typing import Any

from nemo_gym_tok.common.jinja_sandbox import memoize_attribute_checks
from nemo_gym_tok.splice import PrefixSource, SplicedPrompt, SpliceError, StageClock
from nemo_gym_tok.splice_host import new_segment_telemetry
from nemo_gym_tok.vllm import replica_identity, routes
from nemo_gym_tok.vllm.chat_rendering import host_of, plain_message, profile_for, scoped_renderer
from nemo_gym_tok.vllm.chat_responses import full_generator_with_bundle, stream_generator_with_bundle
from nemo_gym_tok.vllm.harmony import HARMONY_TOKENIZE_REFUSAL, harmony_profile, harmony_with_splice
from nemo_gym_tok.vllm.images import (
    ImageSplice,
    ban_placeholders,
    carries_images,
    image_markers,
    remember_image_runs,
)
from nemo_gym_tok.vllm.internals import (
    ALLOW_UNTESTED_ENV,
    PATCHED_METHODS,
    TOKEN_REUSE,
    VLLMInternalsChanged,
    check_internals,
    is_installed,
    is_supported_vllm,
    lookup,
    reuses_forwarded_ids,
    supported_vllm_text,
    wrap,
)
from nemo_gym_tok.vllm.request_prefix import as_400, check_vocabulary, read_request, signature_of
from nemo_gym_tok.vllm.telemetry import TelemetryLater, remember

logger = logging.getLogger("nemo_gym_tok.vllm.hook")

ENABLE_ENV = "NEMO_GYM_TOK_PREFIX_SPLICE"


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
            vllm.__version__,
            supported_vllm_text(),
            ALLOW_UNTESTED_ENV,
        )
    # The authority inside the range too: a release that moved what the hook wraps is refused, naming it.
    missing = check_internals()
    if missing:
        raise VLLMInternalsChanged(
            f"vLLM {vllm.__version__} moved what the prefix-splice hook wraps: missing {', '.join(missing)}"
        )
    if is_installed():
        return
    renderer_cls = lookup(*PATCHED_METHODS[0][:2])
    serving_cls = lookup(*PATCHED_METHODS[2][:2])
    wrap(lookup(*PATCHED_METHODS[5][:2]), "tokenize_prompts_async", tokenize_with_splice)
    wrap(renderer_cls, "preprocess_chat", preprocess_chat_with_splice)
    wrap(renderer_cls, "warmup", warmup_with_profile)
    wrap(serving_cls, "chat_completion_full_generator", full_generator_with_bundle)
    wrap(serving_cls, "chat_completion_stream_generator", stream_generator_with_bundle)
    wrap(renderer_cls, "_make_request_with_harmony", harmony_with_splice)
    if reuses_forwarded_ids():
        wrap(importlib.import_module(TOKEN_REUSE[0]), TOKEN_REUSE[1], reuse_spliced_ids)
    routes.install(wrap)  # the other routes that render chat messages: splice with the full check, or refuse
    memoize_attribute_checks()  # vLLM renders chat templates in transformers' sandbox: the same text, sooner
    logger.info("nemo_gym_tok prefix-splice hook installed (vLLM %s)", vllm.__version__)


def warmup_with_profile(original: Any) -> Any:
    """Wrap vLLM's renderer warm-up: learn the replica's identity and detect the template's turn structure."""
    import vllm

    def warmup(self: Any) -> None:
        original(self)
        replica_identity.learn(self)
        try:
            if getattr(self, "use_harmony", False):
                profile = harmony_profile(self)
            else:
                profile = profile_for(self, _startup_request(), None, None, None)
        except SpliceError as exc:
            logger.warning(
                "nemo_gym_tok prefix-splice hook active (vLLM %s), but it cannot splice for this chat template: %s",
                vllm.__version__,
                exc,
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


def preprocess_chat_with_splice(original: Any) -> Any:
    """Wrap vLLM's chat preprocessing: read the request's prefix and arm the splice its tokenization step runs."""

    async def preprocess_chat(self: Any, request: Any, messages: list[Any], *args: Any, **kwargs: Any) -> Any:
        from nemo_gym_tok.vllm import metrics

        started = time.perf_counter()
        path = "refused"
        markers = image_markers(self)
        if markers is not None:
            ban_placeholders(request, markers)
        clock = metrics.stage_clock()
        try:
            with as_400():
                # The vocabulary is checked below: prompt ids proven to be a prompt spliced here need no check.
                asked = read_request(self, request, messages, vocabulary=False)
                source = asked.source
                if source is not None and getattr(self, "use_harmony", False):
                    raise SpliceError(HARMONY_TOKENIZE_REFUSAL)
                next_turn = source is not None and source.message_index >= 0 and not asked.new_segment
                if not (next_turn and markers is None):
                    check_vocabulary(self, source)
            clock("prefix read")
            if source is None or asked.new_segment:
                # Read before vLLM runs: its token-reuse path pops the forwarded ids from the request.
                unspliced_path = (
                    "new_segment" if source is not None else "token_in" if _forwards_ids(request) else "template"
                )
                answer = await original(self, request, messages, *args, **kwargs)
                clock("vLLM preprocessing")
                if markers is not None:
                    remember_image_runs(request, _engine_inputs(answer))
                if source is not None:
                    remember(request, new_segment_telemetry())
                path = unspliced_path
                return answer
            if source.message_index < 0:  # a first-turn prefix: the template's own ids must start with it
                conversation, engine_inputs = await original(self, request, messages, *args, **kwargs)
                if markers is not None:
                    remember_image_runs(request, engine_inputs)
                with as_400():
                    remember(request, _check_first_turn(self, engine_inputs, source))
                path = "template"
                return conversation, engine_inputs
            bound = signature_of(original).bind(self, request, messages, *args, **kwargs)
            messages = [plain_message(m) for m in messages]  # as sent: vLLM's rendering edits tool calls in place
            if markers is None:
                with as_400():
                    ready = _splice_new_turn(self, request, messages, bound.arguments, source, clock)
                    if ready is None:
                        check_vocabulary(self, source)
                if ready is not None:
                    answer = await _preprocess_spliced(original, bound, request, ready)
                    clock("vLLM preprocessing")
                    remember(request, TelemetryLater(ready))
                    metrics.spliced(new_turn=True)
                    path = "spliced"
                    return answer
            pending = _PendingSplice(self, request, messages, bound.arguments, source)
            reset = _pending_splice.set(pending)
            try:
                answer = await original(*bound.args, **bound.kwargs)
            finally:
                _pending_splice.reset(reset)
            if pending.images is not None:
                with as_400():
                    pending.images.check(_engine_inputs(answer))
            if markers is not None:
                remember_image_runs(request, _engine_inputs(answer))
            if pending.result is None:
                with as_400():
                    raise SpliceError(
                        "the prefix splice needs vLLM to render this request's messages as chat template text (a "
                        "request that forwards kv_transfer_params.prompt_token_ids, or a tokenizer that templates "
                        "to ids, takes another path): send the prefix without kv_transfer_params.prompt_token_ids"
                    )
            remember(request, TelemetryLater(pending.result))
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
            online,
            request,
            messages,
            arguments,
            source,
        )
        self.claimed = False
        self.result: SplicedPrompt | None = None
        self.images: ImageSplice | None = None
        """Set for a vision model's history with images: spliced in the template's space, proven once expanded."""

    def splice(self, prompts: Any) -> list[Any]:
        """The prompts vLLM is about to tokenize, with the spliced ids in place of tokenizing the template's text."""
        self.claimed = True
        prompt = prompts[0] if len(prompts) == 1 else None
        text = prompt.get("prompt") if isinstance(prompt, dict) else None
        if not isinstance(text, str) or "prompt_token_ids" in prompt or "prompt_embeds" in prompt:
            raise SpliceError("the prefix splice supports chats rendered to one token prompt")
        self.images = ImageSplice.of(self.online, self.source, carries_images(prompt), self.messages)
        source = self.source if self.images is None else self.images.source
        self.result = _splice(self.online, self.request, self.messages, self.arguments, source, text)
        # The template's text no longer describes these ids; vLLM skips tokenizing a prompt that holds its ids.
        spliced = {key: value for key, value in prompt.items() if key != "prompt"}
        spliced["prompt_token_ids"] = self.result.prompt_token_ids
        return [spliced]


async def _preprocess_spliced(original: Any, bound: Any, request: Any, ready: SplicedPrompt) -> Any:
    """vLLM's preprocessing of a request whose spliced ids are ready, handed through vLLM's token-reuse step (nothing
    rendered or tokenized; internals.TOKEN_REUSE, wrapped by `reuse_spliced_ids`)."""
    reset = _ready_ids.set((request, ready.prompt_token_ids))
    try:
        return await original(*bound.args, **bound.kwargs)
    finally:
        _ready_ids.reset(reset)


def _splice_new_turn(
    online: Any,
    request: Any,
    messages: list[Any],
    arguments: dict[str, Any],
    source: PrefixSource,
    clock: StageClock,
) -> SplicedPrompt | None:
    """The request's spliced prompt at the cost of its new messages (nemo_gym_tok.splice.splice_new_turn), or None
    where it takes the full check: a request vLLM must render anyway (echo), one that forwards ids of its own, or a
    vLLM without the token-reuse step that would skip its rendering."""
    if (
        getattr(request, "echo", False)
        or getattr(request, "kv_transfer_params", None) is not None
        or not reuses_forwarded_ids()
    ):
        return None
    renderer, profile = _renderer_and_profile(online, request, arguments)
    clock("template scope")
    return host_of(online).splice_new_turn(
        renderer,
        profile,
        messages,
        source,
        add_generation_prompt=bool(getattr(request, "add_generation_prompt", True)),
        continue_final_message=bool(getattr(request, "continue_final_message", False)),
        truncate_prompt_tokens=getattr(request, "truncate_prompt_tokens", None),
        vocab_size=online.model_config.get_vocab_size(),
        clock=clock,
    )


# The spliced ids of the request being preprocessed, for vLLM's token-reuse step to hand the engine.
_ready_ids: contextvars.ContextVar[tuple[Any, list[int]] | None] = contextvars.ContextVar(
    "nemo_gym_tok_ready_ids", default=None
)


def reuse_spliced_ids(original: Any) -> Any:
    """Wrap vLLM's token-reuse step (internals.TOKEN_REUSE): the request whose spliced ids are ready gets them as its
    prompt, nothing rendered or tokenized; every other request is vLLM's as before. The ids are not checked again:
    the prompt part is a prompt this server spliced (its digest proved it), the generation was checked against the
    vocabulary, and the tail is the tokenizer's own (vLLM's check is a Python loop over every id)."""

    def reused_prompt_token_ids(request: Any, *args: Any, **kwargs: Any) -> Any:
        ready = _ready_ids.get()
        if ready is not None and ready[0] is request:
            return ready[1]
        return original(request, *args, **kwargs)

    return reused_prompt_token_ids


def tokenize_with_splice(original: Any) -> Any:
    """Wrap vLLM's tokenization step: a request with an armed splice gets the spliced ids instead of its text's."""

    async def tokenize_prompts_async(self: Any, prompts: Any, params: Any, *args: Any, **kwargs: Any) -> Any:
        pending = _pending_splice.get()
        if pending is not None and not pending.claimed:
            with as_400():
                prompts = pending.splice(prompts)
        return await original(self, prompts, params, *args, **kwargs)

    return tokenize_prompts_async


def answered_whole(request: Any) -> bool:
    """A chat completion answered in one piece (not streamed): nothing generated leaves before the hook's response
    wrapper, so what the splice leaves to verify (SplicedPrompt.verify) can run while the engine generates and still
    turn the answer into a 400. Streams, /tokenize and every other route verify during the splice (nemo_gym_tok.vllm
    .routes: the render routes' answers never pass that wrapper)."""
    return routes.defers_verification(request)


def _engine_inputs(answer: Any) -> Any:
    """The engine inputs of what vLLM's preprocess_chat returned ((conversation, engine inputs)); None otherwise."""
    return answer[1] if isinstance(answer, tuple) and len(answer) == 2 else None


def _forwards_ids(request: Any) -> bool:
    """The request hands vLLM its prompt ids (kv_transfer_params.prompt_token_ids: vLLM's token-reuse path)."""
    forwarded = getattr(request, "kv_transfer_params", None)
    return isinstance(forwarded, dict) and forwarded.get("prompt_token_ids") is not None


def _check_first_turn(online: Any, engine_inputs: list[Any], source: PrefixSource) -> dict[str, Any]:
    if len(engine_inputs) != 1 or "prompt_token_ids" not in engine_inputs[0]:
        raise SpliceError("the prefix splice supports text-only chats rendered to one token prompt")
    return host_of(online).check_first_turn(
        list(engine_inputs[0]["prompt_token_ids"]), source, online.renderer.get_tokenizer()
    )


def _renderer_and_profile(online: Any, request: Any, arguments: dict[str, Any]) -> tuple[Any, Any]:
    """The request's renderer (its template, arguments and tools, over vLLM's own renderer) and template profile."""
    default_template = arguments.get("default_template")
    content_format = arguments.get("default_template_content_format")
    default_kwargs = arguments.get("default_template_kwargs")
    tool_dicts = arguments.get("tool_dicts")
    renderer = scoped_renderer(online, request, default_template, content_format, default_kwargs, tool_dicts)
    return renderer, profile_for(online, request, default_template, content_format, default_kwargs)


def _splice(
    online: Any, request: Any, messages: list[Any], arguments: dict[str, Any], source: PrefixSource, template_text: str
) -> SplicedPrompt:
    renderer, profile = _renderer_and_profile(online, request, arguments)
    return host_of(online).splice(
        renderer,
        profile,
        [plain_message(m) for m in messages],
        source,
        add_generation_prompt=bool(getattr(request, "add_generation_prompt", True)),
        continue_final_message=bool(getattr(request, "continue_final_message", False)),
        truncate_prompt_tokens=getattr(request, "truncate_prompt_tokens", None),
        template_text=template_text,
        # A stream's first byte (or /tokenize's answer) may leave before the response wrapper runs: those verify now.
        defer_verify=answered_whole(request),
        new_turn=False,  # tried before vLLM rendered (_splice_new_turn)
    )
