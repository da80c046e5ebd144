"""The hook's additions to vLLM's chat responses: `prefix_splice` telemetry and token bundles, whole and streamed."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

from nemo_gym_tok.common.exact_json import loads_exact
from nemo_gym_tok.contract.constrained import CONSTRAINED_BY_KEY, FORCED_MASK_KEY, constrained_by, forced_mask
from nemo_gym_tok.vllm.images import image_run_fields
from nemo_gym_tok.vllm.internals import weight_version_fields
from nemo_gym_tok.vllm.replica_identity import served_by_fields
from nemo_gym_tok.vllm.telemetry import TelemetryLater, in_flight, resolve_telemetry


def full_generator_with_bundle(original: Any) -> Any:
    """Wrap the whole (non-streaming) chat response: add `prefix_splice` and, with logprobs, each choice's bundle."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionResponse

    async def chat_completion_full_generator(
        self: Any, request: Any, result_generator: AsyncIterator[Any], *args: Any, **kwargs: Any
    ) -> Any:
        pending = in_flight.pop(id(request), None)
        wants_bundle = bool(getattr(request, "logprobs", False))
        if pending is None and not wants_bundle:
            return await original(self, request, result_generator, *args, **kwargs)
        if isinstance(pending, TelemetryLater):
            pending.start()
        outputs: list[Any] = []

        async def remembering_last() -> AsyncIterator[Any]:
            async for output in result_generator:
                outputs[:] = [output]
                yield output

        response = await original(self, request, remembering_last(), *args, **kwargs)
        telemetry = await resolve_telemetry(pending)
        if not isinstance(response, ChatCompletionResponse):
            return response
        if telemetry is not None:
            response.prefix_splice = telemetry
        if wants_bundle and outputs:
            attach_bundles(response, outputs[0], request)
        return response

    return chat_completion_full_generator


def attach_bundles(response: Any, final: Any, request: Any) -> None:
    """Each choice's bundle on its message, with what constrained the call (`request` is the one vLLM sampled
    with, after its tool parser moved any tool grammar into `structured_outputs`: nemo_gym_tok.contract.constrained)
    and the weight version(s) that sampled it (vLLM 0.32 on; nothing said before: unknown), and which replica served
    it with what tokenizer and template (replica_identity.py)."""
    prompt_ids = list(final.prompt_token_ids or [])
    by_index = {output.index: output for output in final.outputs}
    labels = constrained_by(request)
    images = image_run_fields(request)
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
        fields = {**weight_version_fields(output, len(generation_ids)), **served_by_fields(), **images}
        for key, value in fields.items():
            setattr(choice.message, key, value)


_SSE_DATA = "data: "
_SSE_DONE = "data: [DONE]\n\n"


def stream_generator_with_bundle(original: Any) -> Any:
    """Wrap the streaming chat response (an async generator of SSE strings that vLLM returns without awaiting).

    The wrapper is a plain function returning a generator, so a request without a prefix and without a bundle to
    report gets vLLM's own generator, untouched. The splice itself ran in preprocess_chat, before vLLM returned the
    generator, so every refusal is a JSON 400 before the first byte of the stream.
    """

    def chat_completion_stream_generator(
        self: Any, request: Any, result_generator: AsyncIterator[Any], *args: Any, **kwargs: Any
    ) -> AsyncIterator[str]:
        telemetry = in_flight.pop(id(request), None)
        if isinstance(telemetry, TelemetryLater):
            telemetry.start()
        final_asked = _usage_requested(self, request)
        wants_bundle = final_asked and bool(getattr(request, "logprobs", False))
        if telemetry is None and not wants_bundle:
            return original(self, request, result_generator, *args, **kwargs)
        record = StreamRecord(keep_ids=wants_bundle, constrained_by=constrained_by(request) if wants_bundle else [])
        source = record.watch(result_generator) if final_asked else result_generator
        chunks = original(self, request, source, *args, **kwargs)
        return _with_splice_chunks(chunks, telemetry, record if final_asked else None)

    return chat_completion_stream_generator


async def _with_splice_chunks(
    chunks: AsyncIterator[str], pending: dict[str, Any] | TelemetryLater | None, record: StreamRecord | None
) -> AsyncIterator[str]:
    """vLLM's stream with `prefix_splice` on its first chunk and, when `record` is given (the request asked for
    usage), the final chunk before `data: [DONE]`."""
    first, last, telemetry, resolved = True, None, None, pending is None
    async with contextlib.aclosing(chunks):  # closing this stream closes vLLM's generator too
        async for chunk in chunks:
            if not resolved:  # the measurement ran while the engine made the first token
                telemetry, resolved = await resolve_telemetry(pending), True
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


class StreamRecord:
    """What a streamed request's engine outputs add up to. vLLM streams deltas (RequestOutputKind.DELTA): each
    output holds only the ids and log probs generated since the previous one."""

    def __init__(self, *, keep_ids: bool, constrained_by: list[str]) -> None:
        self.keep_ids = keep_ids
        self.constrained_by = constrained_by
        """What constrained the request's sampling (nemo_gym_tok.contract.constrained), put on each bundle."""
        self.complete = False
        """The engine's outputs ran to their end (not cut by an error or a disconnect)."""
        self.prompt_token_ids: list[int] = []
        self.generations: dict[int, list[int]] = {}
        self.log_probs: dict[int, list[float]] = {}
        self.without_log_probs: set[int] = set()
        self.final_outputs: dict[int, Any] = {}
        """Each completion's last output: vLLM sets its `weight_versions` on that one only."""

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
            self.final_outputs[completion.index] = completion
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
                    **weight_version_fields(self.final_outputs.get(index), len(ids)),
                    **served_by_fields(),
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


def _final_chunk(last: str | None, telemetry: dict[str, Any] | None, record: StreamRecord) -> str | None:
    """The extra chunk: the stream's id, created and model, each choice's bundle on its delta, `prefix_splice`."""
    head = _sse_json(last)
    if head is None or "error" in head:
        return None
    chunk: dict[str, Any] = {
        "id": head.get("id"),
        "object": "chat.completion.chunk",
        "created": head.get("created"),
        "model": head.get("model"),
        "choices": record.choices(),
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
        data = loads_exact(chunk[len(_SSE_DATA) :])
    except ValueError:
        return None
    return data if isinstance(data, dict) else None
