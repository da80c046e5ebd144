"""Relays vLLM's stream to the caller as Chat Completions chunks: as asked, then one final chunk with the bundle."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import StreamingResponse
from starlette.background import BackgroundTask

from nemo_gym_tok.common.exact_json import dumps
from nemo_gym_tok.contract.constrained import CONSTRAINED_BY_KEY, FORCED_MASK_KEY
from nemo_gym_tok.servers.api_errors import ApiError
from nemo_gym_tok.types import BUNDLE_FIELDS
from nemo_gym_tok.types.tokens import WEIGHT_VERSION_KEY, WEIGHT_VERSION_SPANS_KEY
from responses_api_models.vllm_model.calls import PreparedCall
from responses_api_models.vllm_model.chat_assembly import chunk_choice
from responses_api_models.vllm_model.streaming import SSE_MEDIA_TYPE, ChatStream, is_hook_final_chunk

FINAL_CHUNK_FIELDS = (
    *BUNDLE_FIELDS,
    "token_source",
    "prefix_splice",
    CONSTRAINED_BY_KEY,
    FORCED_MASK_KEY,
    WEIGHT_VERSION_KEY,
    WEIGHT_VERSION_SPANS_KEY,
)
"""What the final chunk's `choices[0].delta` may carry: what `choice.message` carries without streaming."""
_DONE = "data: [DONE]\n\n"


def chat_sse(stream: ChatStream, call: PreparedCall) -> StreamingResponse:
    """The Chat Completions stream for the caller: vLLM's chunks as asked (see `_as_asked`), `prefix_splice` on the
    first, and one final chunk with the bundle and telemetry when the caller asked for usage or token information."""
    return StreamingResponse(
        _chat_events(stream, call), media_type=SSE_MEDIA_TYPE, background=BackgroundTask(stream.aclose)
    )


async def _chat_events(stream: ChatStream, call: PreparedCall) -> AsyncIterator[str]:
    asked = call.caller_body
    usage_asked = _usage_asked(asked)
    first = True
    try:
        async for chunk in stream.chunks():
            if is_hook_final_chunk(chunk):
                continue
            shown = _as_asked(chunk, asked, usage_asked)
            if shown is None:
                continue
            if first and stream.telemetry is not None:
                shown["prefix_splice"] = stream.telemetry
            first = False
            yield _sse(shown)
        result = await stream.completion()
        if call.capture or usage_asked:
            final = final_chunk(result, with_bundle=call.capture)
            if final is not None:
                yield _sse(final)
    except ApiError as exc:
        # After the first byte an error can only be told in the stream: the OpenAI SDK raises it as an APIError.
        yield _sse(exc.body())
    finally:
        await stream.aclose()
    yield _DONE


def final_chunk(result: dict[str, Any], *, with_bundle: bool) -> dict[str, Any] | None:
    """The adapter's final chunk: each choice's bundle, `token_source` and `prefix_splice` on its delta (where
    `choice.message` has them without streaming), and the top-level `prefix_splice`. None when it has nothing."""
    choices = []
    for choice in (result.get("choices") or []) if with_bundle else []:
        message = choice.get("message") or {}
        delta = {key: message[key] for key in FINAL_CHUNK_FIELDS if message.get(key) is not None}
        if delta:
            choices.append(chunk_choice(choice.get("index", 0), delta))
    if not choices and result.get("prefix_splice") is None:
        return None
    chunk: dict[str, Any] = {key: result.get(key) for key in ("id", "created", "model")}
    chunk.update(object="chat.completion.chunk", choices=choices)
    if result.get("prefix_splice") is not None:
        chunk["prefix_splice"] = result["prefix_splice"]
    return chunk


def _usage_asked(caller_body: dict[str, Any]) -> bool:
    options = caller_body.get("stream_options")
    return isinstance(options, dict) and bool(options.get("include_usage"))


def _as_asked(chunk: dict[str, Any], asked: dict[str, Any], usage_asked: bool) -> dict[str, Any] | None:
    """A vLLM chunk without what the adapter asked vLLM for only for itself (prompt and generation ids, log probs,
    usage); None when nothing is left (vLLM sends a chunk per token when ids or log probs are asked)."""
    shown = {key: value for key, value in chunk.items() if key != "prefix_splice"}
    if not asked.get("return_token_ids"):
        shown.pop("prompt_token_ids", None)
    if not usage_asked:
        shown.pop("usage", None)
    choices = []
    for choice in chunk.get("choices") or []:
        choice = dict(choice)
        if not asked.get("return_token_ids"):
            choice.pop("token_ids", None)
        if not asked.get("logprobs"):
            choice["logprobs"] = None
        carries = any(choice.get(key) for key in ("delta", "logprobs", "token_ids"))
        if carries or choice.get("finish_reason") is not None:
            choices.append(choice)
    if not choices and not any(key in shown for key in ("usage", "prompt_token_ids")):
        return None
    shown["choices"] = choices
    return shown


def _sse(data: dict[str, Any]) -> str:
    return f"data: {dumps(data).decode()}\n\n"
