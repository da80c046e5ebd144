"""Opens vLLM's chat stream for one call: every refusal before the first byte, then its chunks read and assembled.

Opening a stream (`open_chat_stream`) does everything that can refuse the request before the caller gets a byte:
vLLM's status (its 4xx answered as JSON, as without streaming), an error in place of the first chunk, and the
required-prefix check on the prompt ids vLLM sends in its first chunk (`return_token_ids`). The stream is then
relayed as Chat Completions chunks (chat_events.py) or as Responses API events (responses_events.py), while the
chunks are assembled into the completion the non-streaming route would have answered (chat_assembly.py); the
adapter's `finish` resolves the bundle from it, and it goes out in one final chunk (chat) or on the last output item
(Responses).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx

from nemo_gym_tok.common.exact_json import loads_exact
from nemo_gym_tok.common.remote_errors import error_message
from nemo_gym_tok.servers.api_errors import ApiError
from responses_api_models.vllm_model.calls import PreparedCall
from responses_api_models.vllm_model.chat_assembly import ChatAssembly, chunks_of
from responses_api_models.vllm_model.token_capture import check_required_prefix
from responses_api_models.vllm_model.upstream import is_context_overflow

SSE_MEDIA_TYPE = "text/event-stream"

Finish = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]


def stream_request_body(call: PreparedCall) -> dict[str, Any]:
    """The prepared body, streamed. vLLM's usage chunk is always asked for: the Responses API reports usage, and the
    hook sends its final chunk (the bundle) only with it. Per-chunk usage only as the caller asked."""
    body = {**call.body, "stream": True}
    options = call.caller_body.get("stream_options")
    if options is None or isinstance(options, dict):  # anything else is vLLM's to refuse, unchanged
        asked = dict(options or {})
        if not asked.get("include_usage"):
            asked.pop("continuous_usage_stats", None)
        body["stream_options"] = {**asked, "include_usage": True}
    return body


class ChatStream:
    """vLLM's streamed answer to one call, opened and past every check. `chunks()` yields vLLM's chunks (parsed) and
    assembles them; `completion()` then gives the whole completion as the non-streaming route answers it."""

    def __init__(
        self,
        chunks: AsyncIterator[dict[str, Any]],
        *,
        read: list[dict[str, Any]],
        telemetry: dict[str, Any] | None,
        finish: Finish | None,
        close: Callable[[], Awaitable[None]],
        url: str,
    ) -> None:
        self._chunks = chunks
        self._read = read
        self._finish = finish
        self._close = close
        self._url = url
        self.telemetry = telemetry
        """The call's `prefix_splice` as known before the first byte (the adapter's splice, or the hook's first
        chunk), with `spliced_by`."""
        self.assembly = ChatAssembly()
        self.head = {key: read[0].get(key) for key in ("id", "created", "model")} if read else {}

    @classmethod
    def of_result(cls, result: dict[str, Any]) -> ChatStream:
        """A stream of a completion the adapter made up (a context overflow, answered like `max_tokens`): nothing to
        finish, no bundle, as without streaming."""

        return cls(_no_chunks(), read=chunks_of(result), telemetry=None, finish=None, close=_nothing_to_close, url="")

    async def chunks(self) -> AsyncIterator[dict[str, Any]]:
        """vLLM's chunks, up to `[DONE]`. An error chunk, a broken connection or a stream cut short raise ApiError."""
        for chunk in self._read:
            self.assembly.add(chunk)
            yield chunk
        try:
            async for chunk in self._chunks:
                if "error" in chunk:
                    raise _stream_error(chunk, self._url)
                self.assembly.add(chunk)
                yield chunk
        except httpx.HTTPError as exc:
            raise ApiError(502, f"the stream from vLLM at {self._url} broke: {type(exc).__name__}: {exc}") from None

    async def completion(self) -> dict[str, Any]:
        """The assembled completion, finished by the adapter (bundle resolved and checked, telemetry added, what the
        caller did not ask for removed). Raises ApiError where `finish` does (sources that disagree)."""
        result = self.assembly.result()
        return await self._finish(result) if self._finish is not None else result

    async def aclose(self) -> None:
        await self._close()


async def open_chat_stream(
    call: PreparedCall,
    url: str,
    *,
    post: Callable[[dict[str, Any]], Awaitable[httpx.Response]],
    prompt_ids: Callable[[], Awaitable[list[int]]],
    server: str,
    finish: Finish,
    overflow: Callable[[str], dict[str, Any]],
) -> ChatStream:
    """Send the prepared call to vLLM at `url` streamed, and read until the first chunk. Raises ApiError for what
    refuses the request (vLLM's 4xx, an error chunk first, a prompt that does not start with the required prefix),
    before the caller gets a byte.

    `post` sends the body; `prompt_ids` gets the prompt's ids where vLLM does not send them (/tokenize); `server`
    names who serves the call in a refusal (behind_router.server_label); `finish` is the adapter's finishing of a
    completion; `overflow` makes the answer to a history that no longer fits.
    """
    response = await post(stream_request_body(call))
    try:
        if response.status_code >= 400:
            await response.aread()
            if is_context_overflow(response):
                await response.aclose()
                return ChatStream.of_result(overflow(error_message(response)))
            raise ApiError(response.status_code, error_message(response), error_type="upstream_invalid_request")
        chunks = sse_json(response)
        first = await anext(chunks, None)
        if first is None:
            raise ApiError(502, f"vLLM at {url} ended the stream before its first chunk")
        if "error" in first:
            raise _stream_error(first, url)
        if call.measurement is not None:
            await call.measurement.ready()
        telemetry = call.telemetry if call.telemetry is not None else first.get("prefix_splice")
        if call.required_prefix is not None:
            # vLLM sends the prompt ids in the first chunk (return_token_ids); the hook's telemetry is there too.
            prompt = first.get("prompt_token_ids")
            prompt = list(prompt) if prompt is not None else await prompt_ids()
            check_required_prefix(prompt, call.required_prefix, telemetry, server=server)
    except BaseException:
        await response.aclose()
        raise
    if isinstance(telemetry, dict):
        telemetry = {**telemetry, "spliced_by": "adapter" if call.telemetry is not None else "hook"}
    return ChatStream(chunks, read=[first], telemetry=telemetry, finish=finish, close=response.aclose, url=url)


async def sse_json(response: httpx.Response) -> AsyncIterator[dict[str, Any]]:
    """The JSON objects of a server-sent-event body's `data:` events, up to `data: [DONE]` (comments and
    keep-alives skipped). A body that ends without `[DONE]` was cut short: ApiError 502."""
    lines: list[str] = []
    async for line in response.aiter_lines():
        if line.startswith("data:"):
            lines.append(line[5:].removeprefix(" "))
            continue
        if line or not lines:  # another field, a comment, or a blank line with no data before it
            continue
        payload, lines = "\n".join(lines), []
        if payload == "[DONE]":
            return
        try:
            data = loads_exact(payload)  # the first chunk carries the prompt's ids, the hook's last one the bundle
        except ValueError:
            raise ApiError(502, f"vLLM streamed an event that is not JSON: {payload[:200]!r}") from None
        if isinstance(data, dict):
            yield data
    raise ApiError(502, "vLLM's stream ended before `data: [DONE]`")


async def _no_chunks() -> AsyncIterator[dict[str, Any]]:
    for chunk in ():
        yield chunk


async def _nothing_to_close() -> None:
    return None


def is_hook_final_chunk(chunk: dict[str, Any]) -> bool:
    """The hook's extra chunk (a bundle on a delta, or its telemetry alone): read into the completion, not relayed;
    the adapter sends its own final chunk."""
    choices = chunk.get("choices") or []
    if any("generation_token_ids" in (choice.get("delta") or {}) for choice in choices):
        return True
    return not choices and "prefix_splice" in chunk and "usage" not in chunk


def _stream_error(chunk: dict[str, Any], url: str) -> ApiError:
    """vLLM's error chunk (`{"error": {...}}`) as an ApiError: its 4xx kept, anything else a 502."""
    error = chunk.get("error") if isinstance(chunk.get("error"), dict) else {}
    code = error.get("code")
    message = f"vLLM at {url} reported an error in its stream: {error.get('message') or chunk.get('error')}"
    if isinstance(code, int) and 400 <= code < 500:
        return ApiError(code, message, error_type="upstream_invalid_request")
    return ApiError(502, message)
