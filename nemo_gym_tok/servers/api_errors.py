"""OpenAI-style HTTP errors: raise `ApiError` anywhere in a handler; the client gets its status and message."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

logger = logging.getLogger("nemo_gym_tok.servers")


class ApiError(Exception):
    """An error answer: `status` and a message that says what to fix (4xx) or what failed upstream (5xx)."""

    def __init__(self, status: int, message: str, *, param: str | None = None, error_type: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.error_type = error_type or ("invalid_request_error" if status < 500 else "upstream_error")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.error_type, "param": self.param, "code": self.status}}


def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(status_code=status, content=ApiError(status, message, param=param).body())


async def api_error_handler(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ApiError)
    return JSONResponse(status_code=exc.status, content=exc.body())


async def http_error_handler(request: Request, exc: Exception) -> JSONResponse:
    """Starlette's own errors (404 no such route, 405 wrong method) in the same shape as every other error."""
    assert isinstance(exc, StarletteHTTPException)
    message = f"{exc.detail}: {request.method} {request.url.path}" if exc.status_code in (404, 405) else str(exc.detail)
    return JSONResponse(
        status_code=exc.status_code,
        content=ApiError(exc.status_code, message).body(),
        headers=getattr(exc, "headers", None),
    )


class UnexpectedErrorMiddleware:
    """Outermost guard: an exception no handler mapped becomes a JSON 500 in the OpenAI shape and one log line.

    Starlette's handler for `Exception` answers but then re-raises, so the server logs a traceback for it; this
    middleware ends the exception here instead. The client never sees a traceback; the log line names the route
    and the exception so the bug can be found."""

    def __init__(self, app: ASGIApp, server_name: str = "") -> None:
        self.app = app
        self.server_name = server_name

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as exc:  # noqa: BLE001 - the point is to catch what nothing else did
            where = f"{self.server_name} {scope.get('method', '')} {scope.get('path', '')}".strip()
            logger.error("unexpected error in %s: %s: %s", where, type(exc).__name__, _one_line(str(exc)))
            if started:
                return  # the status line is gone already; the client sees the body end early
            body = ApiError(
                500,
                f"internal error in {where} ({type(exc).__name__}); the server log has the details",
                error_type="server_error",
            ).body()
            await JSONResponse(status_code=500, content=body)(scope, receive, send)


def _one_line(text: str, limit: int = 300) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[:limit] + "..."


def validation_message(errors: list[dict[str, Any]], skip: tuple[str, ...] = ("body",)) -> tuple[str, str | None]:
    """One line from a pydantic error list: `messages[1].content: what is wrong`, and that field's path.

    For a union field (e.g. `input: str | list[...]`) pydantic reports one error per branch; a plain type mismatch
    is the least useful of them, so an error from the branch the value really matched is preferred.
    """
    if not errors:
        return "invalid request", None
    # Among equals, the deepest location: the branch that got furthest into the value (a list, for a list value).
    first = min(errors, key=lambda error: (str(error.get("type", "")).endswith("_type"), -len(error.get("loc", ()))))
    location = field_path(part for part in first.get("loc", ()) if part not in skip and not _is_union_tag(part))
    message = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    return (f"{location}: {message}" if location else message), (location or None)


def field_path(parts: Iterable[str | int]) -> str:
    """A field path the way every gym error writes it: names dotted, list positions bracketed (`messages[1].content`).

    pydantic's `loc` holds positions as ints; the splice's own errors already say `required_prefix_token_ids[9]`,
    so both kinds of error name a field the same way.
    """
    text = ""
    for part in parts:
        if isinstance(part, int) and not isinstance(part, bool):
            text += f"[{part}]"
        else:
            text += f".{part}" if text else str(part)
    return text


def _is_union_tag(part: Any) -> bool:
    # pydantic names union branches in `loc` by their type: "str", "list[ResponseItem]", "function-after[...]".
    return isinstance(part, str) and (part in ("str", "int", "float", "bool", "list", "dict") or "[" in part)
