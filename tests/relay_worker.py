"""A worker added to a router by hand that answers every call through a real replica: the stand-in the router tests
add through `/add_worker` (a real replica's answers, with what it was sent recorded or its answer rewritten)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import Response

Rewrite = Callable[[str, dict[str, Any], Request], None]
"""Changes a 200 JSON answer in place, given the path it answered."""


def relay_worker(
    replica_url: str, *, seen: list[dict[str, Any]] | None = None, rewrite: Rewrite | None = None
) -> FastAPI:
    """Healthy, every call relayed to `replica_url` with its Authorization and Content-Type. `seen` gets each request's
    path and Authorization header first; `rewrite` changes each 200 JSON answer before it goes back."""
    app = FastAPI()

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.api_route("/{path:path}", methods=["GET", "POST"])
    async def relay(path: str, request: Request) -> Response:
        if seen is not None:
            seen.append({"path": f"/{path}", "authorization": request.headers.get("authorization")})
        headers = {name: value for name, value in request.headers.items() if name in ("authorization", "content-type")}
        async with httpx.AsyncClient(timeout=300) as http:
            answer = await http.request(
                request.method, f"{replica_url}/{path}", content=await request.body(), headers=headers
            )
        content = answer.content
        if rewrite is not None and answer.status_code == 200:
            payload = answer.json()
            rewrite(path, payload, request)
            content = json.dumps(payload).encode()
        return Response(content, status_code=answer.status_code, media_type="application/json")

    return app
