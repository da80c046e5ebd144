"""vLLM's routes beside /v1/chat/completions that render chat messages: where the hook splices, and where it refuses.

The splice itself happens in `OnlineRenderer.preprocess_chat` (nemo_gym_tok.vllm.hook), which many routes reach.
This module decides what the routes need beyond it:
- where the splice may leave part of its proof (SplicedPrompt.verify) for later: only inside
  `OpenAIServingChat.create_chat_completion` for an unstreamed request, whose answer the hook's chat response
  wrapper holds until the proof is done. Every other route that reaches the splice (the scale-out render routes,
  /v1/chat/completions/batch, /tokenize) gets the full check before vLLM goes on: what they answer, or hand the
  engine, was never through that wrapper;
- which routes refuse a request that carries token ids for the splice (ROUTES): the Anthropic, Cohere and Responses
  APIs and the pooling routes, whose request models drop the bundle or whose rendering never reaches the splice. A
  request there carrying `required_prefix_token_ids`, `start_token_segment` or a message bundle is answered 400,
  naming the route and what to send instead, rather than rendered from its text as if no ids had been sent.
"""

from __future__ import annotations

import contextvars
import functools
import importlib
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from nemo_gym_tok.common.exact_json import loads_exact
from nemo_gym_tok.splice import NEW_SEGMENT_KEY, PREFIX_KEY
from nemo_gym_tok.types.tokens import BUNDLE_FIELDS

CHAT_MODULE = "vllm.entrypoints.openai.chat_completion.serving"
ANTHROPIC_MODULE = "vllm.entrypoints.anthropic.serving"
RESPONSES_MODULE = "vllm.entrypoints.openai.responses.serving"
RENDER_MODULE = "vllm.entrypoints.scale_out.render.serving"
POOLING_MODULE = "vllm.entrypoints.pooling.base.serving"
COHERE_MODULE = "vllm.entrypoints.cohere.api_router"
COHERE_PATHS = ("/cohere/v2/chat", "/cohere/v2/chat/render")

_TOKEN_KEYS = (PREFIX_KEY, NEW_SEGMENT_KEY, *BUNDLE_FIELDS)
POOLING_LABEL = "this pooling route"
"""How a refusal names the pooling routes (one guard on their shared base class serves them all)."""


@dataclass(frozen=True)
class Route:
    """One vLLM route that renders chat messages, and what the hook does with a request carrying token ids there."""

    paths: tuple[str, ...]
    policy: str
    """"splice" (the full check before anything leaves), or "refuse" (400 naming the route)."""
    instead: str = ""
    """What to send instead (for a refusing route)."""


ROUTES = (
    Route(("/v1/chat/completions",), "splice"),
    Route(("/tokenize",), "splice"),
    Route(("/v1/chat/completions/render",), "splice"),
    Route(("/v1/chat/completions/batch",), "splice"),
    Route(
        ("/v1/messages", "/v1/messages/count_tokens", "/v1/messages/render"),
        "refuse",
        "the Anthropic Messages request model drops token ids; send the conversation, with its bundles, to "
        "/v1/chat/completions (or /v1/chat/completions/render, served with --enable-scale-out from vLLM 0.30 on, "
        "for the prompt ids alone)",
    ),
    Route(
        ("/v1/responses", "/v1/responses/render"),
        "refuse",
        "the Responses API does not splice (its input items are converted to chat messages without their ids); "
        "send the conversation, with its bundles, to /v1/chat/completions (or /v1/chat/completions/render)",
    ),
    Route(
        (
            "/pooling",
            "/classify",
            "/v1/embeddings",
            "/v2/embed",
            "/score",
            "/v1/score",
            "/rerank",
            "/v1/rerank",
            "/v2/rerank",
        ),
        "refuse",
        "the pooling routes render messages without the splice; send the prompt's token ids as the input instead "
        "(e.g. the prompt_token_ids + generation_token_ids of the turn to score)",
    ),
    Route(
        COHERE_PATHS,
        "refuse",
        "the Cohere v2 chat request model drops token ids (its messages are rebuilt from their text for vLLM's "
        "chat completion); send the conversation, with its bundles, to /v1/chat/completions (or "
        "/v1/chat/completions/render for the prompt ids alone)",
    ),
)

# (module, class, method) the route guards wrap, with the wrapper factory (install() below).
ROUTE_METHODS = (
    (CHAT_MODULE, "OpenAIServingChat", "create_chat_completion"),
    (ANTHROPIC_MODULE, "AnthropicServingMessages", "create_messages"),
    (ANTHROPIC_MODULE, "AnthropicServingMessages", "count_tokens"),
    (RENDER_MODULE, "ServingRender", "render_messages_request"),
    (RESPONSES_MODULE, "OpenAIServingResponses", "create_responses"),
    (RENDER_MODULE, "ServingRender", "render_responses_request"),
    (POOLING_MODULE, "PoolingBaseServing", "__call__"),
    # Both Cohere routes: neither handler method sees the raw request of /cohere/v2/chat/render, the middleware vLLM
    # puts in front of them (with the routes, only when VLLM_ENABLE_COHERE_API=1) sees both.
    (COHERE_MODULE, "CohereErrorEnvelopeMiddleware", "dispatch"),
)
# The first vLLM release, as (major, minor), that has a route method; unnamed ones are in every supported release.
# A release before it never had the route, so there is nothing to guard; absent from a later release, the method
# moved, and the hook refuses to install (check_internals) as for any other.
ROUTE_SINCE: dict[tuple[str, str, str], tuple[int, int]] = {
    (RENDER_MODULE, "ServingRender", "render_responses_request"): (0, 30),  # /v1/responses/render
}
# The package a route method's class exists with: vLLM defines it (and serves its routes) only when that package
# imports, so where it does not there is no route to guard.
ROUTE_NEEDS: dict[tuple[str, str, str], str] = {
    (COHERE_MODULE, "CohereErrorEnvelopeMiddleware", "dispatch"): "cohere",
}


def vllm_release(version: str) -> tuple[int, int] | None:
    """(major, minor) of a vLLM version string (`0.29.0`, `0.33.1rc1`, `0.30.0+cpu`), or None if it names none."""
    match = re.match(r"(\d+)\.(\d+)", version)
    return (int(match[1]), int(match[2])) if match else None


def absent_by_design(route_method: tuple[str, str, str], version: str) -> bool:
    """Whether `version` predates the route method (ROUTE_SINCE): its absence there is expected, not a move."""
    since, release = ROUTE_SINCE.get(route_method), vllm_release(version)
    return since is not None and release is not None and release < since


def not_served(route_method: tuple[str, str, str], version: str) -> bool:
    """Whether the installed vLLM (`version`) serves no route behind `route_method`, so its absence is no move: the
    release predates it (ROUTE_SINCE), or the optional package its routes need does not import here (ROUTE_NEEDS)."""
    if absent_by_design(route_method, version):
        return True
    needed = ROUTE_NEEDS.get(route_method)
    if needed is None:
        return False
    try:
        importlib.import_module(needed)
    except ImportError:
        return True
    return False


# Set while OpenAIServingChat.create_chat_completion runs: its unstreamed answer goes through the hook's chat
# response wrapper, which awaits the splice's verification before anything leaves.
_answered_by_chat_wrapper: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "nemo_gym_tok_answered_by_chat_wrapper", default=False
)


def defers_verification(request: Any) -> bool:
    """Whether the splice of `request` may finish its proof while the engine generates: an unstreamed chat completion
    answered by create_chat_completion (whose response the hook's wrapper holds until the proof is done)."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    return _answered_by_chat_wrapper.get() and isinstance(request, ChatCompletionRequest) and not request.stream


def install(wrap: Any) -> None:
    """Wrap the route methods (ROUTE_METHODS) with `wrap(owner, name, make_wrapper)`, as the hook wraps its own; a
    method whose route the installed vLLM does not serve (not_served) is left out, since there is nothing to guard."""
    import vllm

    makers = {
        "create_chat_completion": _chat_completion_marking_wrapper,
        "create_messages": functools.partial(_refusing_raw, route="/v1/messages"),
        "count_tokens": functools.partial(_refusing_raw, route="/v1/messages/count_tokens"),
        "render_messages_request": functools.partial(_refusing_raw, route="/v1/messages/render"),
        "create_responses": functools.partial(_refusing_request, route="/v1/responses"),
        "render_responses_request": functools.partial(_refusing_request, route="/v1/responses/render"),
        "__call__": functools.partial(_refusing_request, route=POOLING_LABEL),
        "dispatch": _refusing_cohere,
    }
    for module_name, class_name, method in ROUTE_METHODS:
        owner = getattr(importlib.import_module(module_name), class_name, None)
        if not hasattr(owner, method) and not_served((module_name, class_name, method), vllm.__version__):
            continue
        wrap(owner, method, makers[method])


def _chat_completion_marking_wrapper(original: Any) -> Any:
    async def create_chat_completion(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        reset = _answered_by_chat_wrapper.set(True)
        try:
            return await original(self, request, *args, **kwargs)
        finally:
            _answered_by_chat_wrapper.reset(reset)

    return create_chat_completion


def _refusing_raw(original: Any, *, route: str) -> Any:
    """For a route whose request model drops unknown fields (Anthropic): the refusal reads the request's raw body."""

    async def guarded(self: Any, request: Any, raw_request: Any = None, *args: Any, **kwargs: Any) -> Any:
        body = await _raw_body(raw_request)
        if body is not None:
            _refuse_if_carried(route, _keys_in_body(body))
        return await original(self, request, raw_request, *args, **kwargs)

    return guarded


def _refusing_request(original: Any, *, route: str) -> Any:
    """For a route whose request model keeps unknown fields (Responses, pooling): the refusal reads the request."""

    async def guarded(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        _refuse_if_carried(route, _keys_in_request(request))
        return await original(self, request, *args, **kwargs)

    return guarded


def _refusing_cohere(original: Any) -> Any:
    """For the Cohere routes: their request model drops top-level token ids, and /cohere/v2/chat/render hands no
    handler method its raw request, so the refusal is answered by vLLM's Cohere middleware, from the raw body, before
    either route runs; in Cohere's error shape ({message, id}), as that middleware answers every other error there."""

    async def dispatch(self: Any, request: Any, call_next: Any) -> Any:
        path = request.url.path.rstrip("/")
        if request.method == "POST" and path in COHERE_PATHS:
            body = await _raw_body(request)  # Starlette keeps it for the route (its middleware caches the body)
            keys = _keys_in_body(body) if body is not None else set()
            if keys:
                from fastapi.responses import JSONResponse

                from nemo_gym_tok.vllm import metrics

                metrics.rejected()
                request_id = request.headers.get("X-Request-Id")
                content = {"message": refusal_text(path, keys), **({"id": request_id} if request_id else {})}
                return JSONResponse(status_code=400, content=content)
        return await original(self, request, call_next)

    return dispatch


def refusal_text(route: str, keys: Iterable[str]) -> str:
    """The 400's message: the route, what the request carries, and what to send instead."""
    found = ", ".join(sorted(set(keys)))
    path = "/pooling" if route == POOLING_LABEL else route
    instead = next((known.instead for known in ROUTES if path in known.paths), "")
    return (
        f"{route} does not splice token ids (the request carries {found}): vLLM would render its messages from "
        f"their text, and the ids would be lost. {instead[:1].upper()}{instead[1:]}"
    )


def _refuse_if_carried(route: str, keys: set[str]) -> None:
    if not keys:
        return
    from vllm.exceptions import VLLMValidationError

    from nemo_gym_tok.vllm import metrics

    metrics.rejected()
    parameter = PREFIX_KEY if PREFIX_KEY in keys else sorted(keys)[0]
    raise VLLMValidationError(refusal_text(route, keys), parameter=parameter)


async def _raw_body(raw_request: Any) -> bytes | None:
    """The request's body as FastAPI read it (cached on the request), or None without a raw request."""
    body = getattr(raw_request, "body", None)
    if body is None:
        return None
    try:
        return await body()
    except RuntimeError:  # the stream was consumed without being kept; nothing to read
        return None


def _keys_in_body(body: bytes) -> set[str]:
    """The token keys (_TOKEN_KEYS) at the top of a JSON body or on its messages; a cheap byte test first."""
    if not any(f'"{key}"'.encode() in body for key in _TOKEN_KEYS):
        return set()
    try:
        data = loads_exact(body)
    except ValueError:
        return set()
    return _keys_in_mapping(data)


def _keys_in_request(request: Any) -> set[str]:
    extra = getattr(request, "model_extra", None) or {}
    found = {key for key in (PREFIX_KEY, NEW_SEGMENT_KEY) if extra.get(key) is not None}
    for field in ("messages", "input"):
        found |= _keys_in_items(getattr(request, field, None))
    return found


def _keys_in_mapping(data: Any) -> set[str]:
    if not isinstance(data, dict):
        return set()
    found = {key for key in (PREFIX_KEY, NEW_SEGMENT_KEY) if data.get(key) is not None}
    for field in ("messages", "input"):
        found |= _keys_in_items(data.get(field))
    return found


def _keys_in_items(items: Any) -> set[str]:
    """Bundle keys on a list of messages or input items (dicts, or models keeping extra fields)."""
    if not isinstance(items, list):
        return set()
    found: set[str] = set()
    for item in items:
        if isinstance(item, list):  # a batch of conversations
            found |= _keys_in_items(item)
            continue
        fields = (
            item
            if isinstance(item, dict)
            else {**(getattr(item, "model_extra", None) or {}), **getattr(item, "__dict__", {})}
        )
        found |= {key for key in BUNDLE_FIELDS if fields.get(key) is not None}
    return found
