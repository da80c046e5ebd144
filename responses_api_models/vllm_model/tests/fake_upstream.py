"""A recording stand-in for vLLM or vllm-router: unit tests of error paths the real servers cannot be made to take."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse


def chat_completion(model: str, message: dict[str, Any], finish_reason: str = "stop") -> dict[str, Any]:
    """A minimal vLLM chat completion answer with one choice."""
    return {
        "id": "x",
        "object": "chat.completion",
        "created": 0,
        "model": model,
        "choices": [{"index": 0, "message": message, "finish_reason": finish_reason}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
    }


@dataclass
class FakeUpstream:
    name: str
    status: int = 200
    healthy: bool = True
    """What GET /health answers: 200 when true, 503 otherwise (the router's probe)."""
    fail_times: int | None = None
    """Answer `status` to this many chat calls only, then 200 (None: always)."""
    requests: list[dict[str, Any]] = field(default_factory=list)
    sessions: list[str | None] = field(default_factory=list)
    """The x-session-id header of each chat call."""
    health_checks: int = 0
    router_workers: list[str] | None = None
    """Answer GET /list_workers as vllm-router does, with these workers (None: 404, as vLLM)."""
    error_text: str | None = None
    """Fail with this text body, as vllm-router does for a worker it could not reach (None: vLLM's JSON error)."""

    def app(self) -> FastAPI:
        app = FastAPI()

        @app.post("/v1/chat/completions")
        async def chat(request: Request) -> JSONResponse:
            body = await request.json()
            self.requests.append(body)
            self.sessions.append(request.headers.get("x-session-id"))
            failing = self.fail_times is None or len(self.requests) <= self.fail_times
            if self.status != 200 and failing:
                if self.error_text is not None:
                    return PlainTextResponse(self.error_text, status_code=self.status)
                return JSONResponse({"error": {"message": f"{self.name} is broken"}}, status_code=self.status)
            return JSONResponse(chat_completion(body["model"], {"role": "assistant", "content": f"from {self.name}"}))

        @app.get("/list_workers")
        async def list_workers() -> JSONResponse:
            if self.router_workers is None:
                return JSONResponse({"detail": "Not Found"}, status_code=404)
            return JSONResponse({"urls": self.router_workers})

        @app.get("/health")
        async def health() -> JSONResponse:
            self.health_checks += 1
            return JSONResponse({}, status_code=200 if self.healthy else 503)

        return app
