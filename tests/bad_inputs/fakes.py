"""Stand-ins for vLLM and for a broken model server, so the suite needs no real model."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse

from responses_api_models.vllm_model.tests.fake_upstream import chat_completion


@dataclass
class ScriptedChat:
    """vLLM's chat completions, scripted: calls `tool_name` (when set) on the first turn of a conversation, and
    answers `answer` otherwise. Records every body it gets."""

    tool_name: str | None = None
    answer: str = "50"
    requests: list[dict[str, Any]] = field(default_factory=list)

    def app(self) -> FastAPI:
        app = FastAPI()

        @app.post("/v1/chat/completions")
        async def chat(request: Request) -> JSONResponse:
            body = await request.json()
            self.requests.append(body)
            messages = body["messages"]
            first_turn = not any(message["role"] in ("assistant", "tool") for message in messages)
            if self.tool_name and first_turn:
                call = {"id": "call_1", "type": "function", "function": {"name": self.tool_name, "arguments": "{}"}}
                message, finish = {"role": "assistant", "content": None, "tool_calls": [call]}, "tool_calls"
            else:
                message, finish = {"role": "assistant", "content": self.answer}, "stop"
            return JSONResponse(chat_completion(body["model"], message, finish))

        @app.get("/health")
        async def health() -> dict[str, str]:
            return {}

        return app


def plain_text_500_model() -> FastAPI:
    """A model server that fails the way the adapter used to on an unexpected input: HTTP 500, plain text body."""
    app = FastAPI()

    @app.post("/v1/responses")
    async def responses() -> PlainTextResponse:
        return PlainTextResponse("Internal Server Error", status_code=500)

    return app
