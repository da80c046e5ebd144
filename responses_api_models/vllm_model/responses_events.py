"""Relays vLLM's stream to the caller as Responses API events, the bundle on the last output item."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi.responses import StreamingResponse
from starlette.background import BackgroundTask

from nemo_gym_tok.common.exact_json import dumps
from nemo_gym_tok.servers.api_errors import ApiError
from nemo_gym_tok.types import Response, bundle_of
from responses_api_models.vllm_model.streaming import SSE_MEDIA_TYPE, ChatStream, is_hook_final_chunk

Settle = Callable[[dict[str, Any]], dict[str, Any]]


def responses_sse(
    stream: ChatStream, *, to_response: Callable[[dict[str, Any]], Response], settle: Settle | None = None
) -> StreamingResponse:
    """The Responses API stream for the caller: `response.created`, each output item's events as vLLM streams it,
    and `response.completed` (or `response.incomplete`, as the status is) with the whole Response, whose last
    output item carries the bundle as the non-streaming route's does. `to_response` is that route's conversion;
    `settle` its last step on the whole response (the adapter keeps it for `previous_response_id`)."""
    return StreamingResponse(
        _responses_events(stream, to_response, settle),
        media_type=SSE_MEDIA_TYPE,
        background=BackgroundTask(stream.aclose),
    )


async def _responses_events(
    stream: ChatStream, to_response: Callable[[dict[str, Any]], Response], settle: Settle | None
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
        for event in events.finish(result, to_response(result), settle):
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

    def finish(self, result: dict[str, Any], response: Response, settle: Settle | None = None) -> list[str]:
        """Close the last item with the bundle, and complete the response with the streamed items (`settle`d)."""
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
        if settle is not None:
            final = settle(final)
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
