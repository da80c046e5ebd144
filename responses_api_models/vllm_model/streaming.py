"""Relays a streamed chat completion from vLLM with token capture: every refusal before the first byte, the bundle last.

Opening a stream (`open_chat_stream`) does everything that can refuse the request before the caller gets a byte:
vLLM's status (its 4xx answered as JSON, as without streaming), an error in place of the first chunk, and the
required-prefix check on the prompt ids vLLM sends in its first chunk (`return_token_ids`). The stream is then
relayed as Chat Completions chunks (`chat_sse`) or as Responses API events (`responses_sse`), while the chunks are
assembled into the completion the non-streaming route would have answered; the adapter's `finish` resolves the
bundle from it, and it goes out in one final chunk (chat) or on the last output item (Responses).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

import httpx
from fastapi.responses import StreamingResponse
from starlette.background import BackgroundTask

from nemo_gym_tok.common.remote_errors import error_message
from nemo_gym_tok.contract.constrained import CONSTRAINED_BY_KEY, FORCED_MASK_KEY
from nemo_gym_tok.servers.errors import ApiError
from nemo_gym_tok.servers.fast_json import dumps, loads
from nemo_gym_tok.types import BUNDLE_FIELDS, Response, bundle_of
from responses_api_models.vllm_model.token_capture import check_required_prefix
from responses_api_models.vllm_model.upstream import is_context_overflow

if TYPE_CHECKING:
    from responses_api_models.vllm_model.app import PreparedCall

SSE_MEDIA_TYPE = "text/event-stream"
FINAL_CHUNK_FIELDS = (*BUNDLE_FIELDS, "token_source", "prefix_splice", CONSTRAINED_BY_KEY, FORCED_MASK_KEY)
"""What the final chunk's `choices[0].delta` may carry: what `choice.message` carries without streaming."""
_DONE = "data: [DONE]\n\n"

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
    finish: Finish,
    overflow: Callable[[str], dict[str, Any]],
) -> ChatStream:
    """Send the prepared call to vLLM at `url` streamed, and read until the first chunk. Raises ApiError for what
    refuses the request (vLLM's 4xx, an error chunk first, a prompt that does not start with the required prefix),
    before the caller gets a byte.

    `post` sends the body (UpstreamUnavailable when vLLM is down, so the router can fail over); `prompt_ids` gets
    the prompt's ids where vLLM does not send them (/tokenize); `finish` is the adapter's finishing of a completion;
    `overflow` makes the answer to a history that no longer fits.
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
        telemetry = call.telemetry if call.telemetry is not None else first.get("prefix_splice")
        if call.required_prefix is not None:
            # vLLM sends the prompt ids in the first chunk (return_token_ids); the hook's telemetry is there too.
            prompt = first.get("prompt_token_ids")
            prompt = list(prompt) if prompt is not None else await prompt_ids()
            check_required_prefix(prompt, call.required_prefix, telemetry, upstream_url=url)
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
            data = loads(payload)  # the first chunk carries the prompt's ids, the hook's last one the bundle
        except ValueError:
            raise ApiError(502, f"vLLM streamed an event that is not JSON: {payload[:200]!r}") from None
        if isinstance(data, dict):
            yield data
    raise ApiError(502, "vLLM's stream ended before `data: [DONE]`")


class ChatAssembly:
    """The completion vLLM would have answered without streaming, put together from its chunks: text, reasoning and
    tool calls concatenated, token ids and log probs gathered, and any other delta field (the hook's bundle) kept."""

    def __init__(self) -> None:
        self.head: dict[str, Any] = {}
        self.extra: dict[str, Any] = {}
        self.choices: dict[int, dict[str, Any]] = {}
        self.tool_calls: dict[int, dict[int, dict[str, Any]]] = {}

    def add(self, chunk: dict[str, Any]) -> None:
        for key in ("id", "created", "model", "system_fingerprint"):
            if chunk.get(key) is not None:
                self.head.setdefault(key, chunk[key])
        for key in ("prompt_token_ids", "prefix_splice", "usage"):
            if chunk.get(key) is not None:
                self.extra[key] = chunk[key]
        for streamed in chunk.get("choices") or []:
            self._add_choice(streamed)

    def _add_choice(self, streamed: dict[str, Any]) -> None:
        index = streamed.get("index", 0)
        choice = self.choices.setdefault(
            index, {"index": index, "message": {"role": "assistant", "content": ""}, "finish_reason": None}
        )
        message = choice["message"]
        for key, value in (streamed.get("delta") or {}).items():
            if value is None or key == "role":
                continue
            if key in ("content", "reasoning", "reasoning_content"):
                message[key] = (message.get(key) or "") + value
            elif key == "tool_calls":
                for call in value:
                    self._add_tool_call(index, call)
            else:  # the hook's bundle and telemetry, the adapter's context_overflow, fields of newer vLLMs
                message[key] = value
        if streamed.get("token_ids") is not None:
            choice.setdefault("token_ids", []).extend(streamed["token_ids"])
        logprobs = streamed.get("logprobs")
        if isinstance(logprobs, dict) and logprobs.get("content") is not None:
            choice.setdefault("logprobs", {"content": []})["content"].extend(logprobs["content"])
        for key in ("finish_reason", "stop_reason"):
            if streamed.get(key) is not None:
                choice[key] = streamed[key]

    def _add_tool_call(self, choice_index: int, delta: dict[str, Any]) -> None:
        call = self.tool_calls.setdefault(choice_index, {}).setdefault(
            delta.get("index", 0), {"id": None, "type": "function", "function": {"name": "", "arguments": ""}}
        )
        if delta.get("id"):
            call["id"] = delta["id"]
        function = delta.get("function") or {}
        # Names arrive whole and arguments in pieces; both concatenate, as the OpenAI SDK accumulates deltas.
        for key in ("name", "arguments"):
            if function.get(key):
                call["function"][key] += function[key]

    def result(self) -> dict[str, Any]:
        choices = []
        for index, choice in sorted(self.choices.items()):
            calls = self.tool_calls.get(index)
            if calls:
                choice["message"]["tool_calls"] = [call for _, call in sorted(calls.items())]
            choices.append(choice)
        return {**self.head, "object": "chat.completion", **self.extra, "choices": choices}


async def _no_chunks() -> AsyncIterator[dict[str, Any]]:
    for chunk in ():
        yield chunk


async def _nothing_to_close() -> None:
    return None


def chunks_of(result: dict[str, Any]) -> list[dict[str, Any]]:
    """A whole chat completion as the chunks of its stream: the role, the message, the usage."""
    head = {key: result.get(key) for key in ("id", "created", "model")}
    head["object"] = "chat.completion.chunk"
    chunks = []
    for choice in result.get("choices") or []:
        index = choice.get("index", 0)
        rest = {key: value for key, value in choice.get("message", {}).items() if key != "role"}
        chunks.append({**head, "choices": [_chunk_choice(index, {"role": "assistant", "content": ""})]})
        chunks.append({**head, "choices": [_chunk_choice(index, rest, choice.get("finish_reason"))]})
    chunks.append({**head, "choices": [], "usage": result.get("usage")})
    return chunks


def _chunk_choice(index: int, delta: dict[str, Any], finish_reason: str | None = None) -> dict[str, Any]:
    return {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}


def is_hook_final_chunk(chunk: dict[str, Any]) -> bool:
    """The hook's extra chunk (a bundle on a delta, or its telemetry alone): read into the completion, not relayed;
    the adapter sends its own final chunk."""
    choices = chunk.get("choices") or []
    if any("generation_token_ids" in (choice.get("delta") or {}) for choice in choices):
        return True
    return not choices and "prefix_splice" in chunk and "usage" not in chunk


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
            choices.append(_chunk_choice(choice.get("index", 0), delta))
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


def _stream_error(chunk: dict[str, Any], url: str) -> ApiError:
    """vLLM's error chunk (`{"error": {...}}`) as an ApiError: its 4xx kept, anything else a 502."""
    error = chunk.get("error") if isinstance(chunk.get("error"), dict) else {}
    code = error.get("code")
    message = f"vLLM at {url} reported an error in its stream: {error.get('message') or chunk.get('error')}"
    if isinstance(code, int) and 400 <= code < 500:
        return ApiError(code, message, error_type="upstream_invalid_request")
    return ApiError(502, message)


def _sse(data: dict[str, Any]) -> str:
    return f"data: {dumps(data).decode()}\n\n"


def responses_sse(stream: ChatStream, *, to_response: Callable[[dict[str, Any]], Response]) -> StreamingResponse:
    """The Responses API stream for the caller: `response.created`, each output item's events as vLLM streams it,
    and `response.completed` (or `response.incomplete`, as the status is) with the whole Response, whose last
    output item carries the bundle as the non-streaming route's does. `to_response` is that route's conversion."""
    return StreamingResponse(
        _responses_events(stream, to_response), media_type=SSE_MEDIA_TYPE, background=BackgroundTask(stream.aclose)
    )


async def _responses_events(
    stream: ChatStream, to_response: Callable[[dict[str, Any]], Response]
) -> AsyncIterator[str]:
    events = ResponsesEvents(f"resp_{stream.head.get('id') or uuid.uuid4().hex}", str(stream.head.get("model") or ""))
    try:
        for event in events.start():
            yield event
        async for chunk in stream.chunks():
            if not is_hook_final_chunk(chunk):
                for event in events.add(chunk):
                    yield event
        result = await stream.completion()
        for event in events.finish(result, to_response(result)):
            yield event
    except ApiError as exc:
        yield events.error(exc)
    finally:
        await stream.aclose()


class ResponsesEvents:
    """The Responses API events for one streamed chat completion. Items open as their first delta arrives (reasoning,
    message text, each tool call as a function_call item) and close when the next opens; the last closes at the end
    with the bundle, as `chat_message_to_items` puts it on the last item."""

    def __init__(self, response_id: str, model: str) -> None:
        self.response_id = response_id
        self.model = model
        self.created_at = time.time()
        self.sequence = 0
        self.items: list[dict[str, Any]] = []
        self.open: str | None = None
        """The kind of the last item while it is open: reasoning, message or function_call."""
        self.text = ""
        self.calls: dict[int, int] = {}
        """Output index of each streamed tool call, by its chat index."""

    def start(self) -> list[str]:
        snapshot = Response(
            id=self.response_id, created_at=self.created_at, model=self.model, status="in_progress", output=[]
        ).model_dump(exclude_none=True)
        return [
            self._event("response.created", response=snapshot),
            self._event("response.in_progress", response=snapshot),
        ]

    def add(self, chunk: dict[str, Any]) -> list[str]:
        events: list[str] = []
        for choice in chunk.get("choices") or []:
            if choice.get("index", 0) != 0:  # a response has one output; n > 1 has no Responses equivalent
                continue
            delta = choice.get("delta") or {}
            reasoning = delta.get("reasoning") or delta.get("reasoning_content")
            if reasoning:
                events += self._reasoning(reasoning)
            if delta.get("content"):
                events += self._text(delta["content"])
            for call in delta.get("tool_calls") or []:
                events += self._tool_call(call)
        return events

    def finish(self, result: dict[str, Any], response: Response) -> list[str]:
        """Close the last item with the bundle, and complete the response with the streamed items."""
        choices = result.get("choices") or [{}]
        message = choices[0].get("message") or {}
        events: list[str] = []
        if not any(item["type"] in ("message", "function_call") for item in self.items):
            events += self._text("")  # a call with neither text nor tool calls answers an empty message, as unstreamed
        extra = bundle_of(message)
        if message.get("context_overflow"):
            extra["context_overflow"] = message["context_overflow"]
        events += self._close(extra)
        final = Response.model_validate(
            {
                **response.model_dump(exclude_none=True),
                "id": self.response_id,
                "created_at": self.created_at,
                "output": self.items,
            }
        ).model_dump(exclude_none=True)
        kind = "response.completed" if final.get("status") == "completed" else "response.incomplete"
        events.append(self._event(kind, response=final))
        return events

    def error(self, exc: ApiError) -> str:
        return self._event("error", code=exc.error_type, message=exc.message, param=exc.param)

    def _reasoning(self, text: str) -> list[str]:
        events: list[str] = []
        if self.open != "reasoning":
            events += self._close()
            item = {"type": "reasoning", "id": _new_id("rs"), "summary": []}
            events += self._added(item)
            events.append(
                self._event(
                    "response.reasoning_summary_part.added",
                    **self._where(),
                    summary_index=0,
                    part={"type": "summary_text", "text": ""},
                )
            )
        self.text += text
        events.append(
            self._event("response.reasoning_summary_text.delta", **self._where(), summary_index=0, delta=text)
        )
        return events

    def _text(self, text: str) -> list[str]:
        events: list[str] = []
        if self.open != "message":
            events += self._close()
            item = {
                "type": "message",
                "id": _new_id("msg"),
                "role": "assistant",
                "status": "in_progress",
                "content": [],
            }
            events += self._added(item)
            events.append(
                self._event("response.content_part.added", **self._where(), content_index=0, part=_output_text(""))
            )
        if text:
            self.text += text
            events.append(
                self._event("response.output_text.delta", **self._where(), content_index=0, delta=text, logprobs=[])
            )
        return events

    def _tool_call(self, delta: dict[str, Any]) -> list[str]:
        events: list[str] = []
        function = delta.get("function") or {}
        position = delta.get("index", 0)
        if position not in self.calls:
            events += self._close()
            item = {
                "type": "function_call",
                "id": _new_id("fc"),
                "call_id": delta.get("id") or _new_id("call"),
                "name": function.get("name") or "",
                "arguments": "",
                "status": "in_progress",
            }
            events += self._added(item)
            self.calls[position] = len(self.items) - 1
        elif function.get("name"):  # a name after the call opened: vLLM sends it whole with the first delta
            self.items[self.calls[position]]["name"] += function["name"]
        if function.get("arguments"):
            output_index = self.calls[position]
            self.items[output_index]["arguments"] += function["arguments"]
            events.append(
                self._event(
                    "response.function_call_arguments.delta",
                    item_id=self.items[output_index]["id"],
                    output_index=output_index,
                    delta=function["arguments"],
                )
            )
        return events

    def _added(self, item: dict[str, Any]) -> list[str]:
        self.items.append(item)
        self.open, self.text = item["type"], ""
        return [self._event("response.output_item.added", output_index=len(self.items) - 1, item=dict(item))]

    def _close(self, extra: dict[str, Any] | None = None) -> list[str]:
        """Close the open item (`extra`, the bundle, goes on it): its done events, then `output_item.done`."""
        if self.open is None:
            return []
        item, where, events = self.items[-1], self._where(), []
        if self.open == "reasoning":
            part = {"type": "summary_text", "text": self.text}
            events.append(self._event("response.reasoning_summary_text.done", **where, summary_index=0, text=self.text))
            events.append(self._event("response.reasoning_summary_part.done", **where, summary_index=0, part=part))
            item["summary"] = [part]
        elif self.open == "message":
            events.append(
                self._event("response.output_text.done", **where, content_index=0, text=self.text, logprobs=[])
            )
            events.append(
                self._event("response.content_part.done", **where, content_index=0, part=_output_text(self.text))
            )
            item.update(status="completed", content=[_output_text(self.text)])
        else:
            events.append(
                self._event(
                    "response.function_call_arguments.done", **where, name=item["name"], arguments=item["arguments"]
                )
            )
            item["status"] = "completed"
        item.update(extra or {})
        events.append(self._event("response.output_item.done", output_index=where["output_index"], item=dict(item)))
        self.open = None
        return events

    def _where(self) -> dict[str, Any]:
        return {"item_id": self.items[-1]["id"], "output_index": len(self.items) - 1}

    def _event(self, kind: str, **fields: Any) -> str:
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {dumps(data).decode()}\n\n"


def _output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": []}


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"
