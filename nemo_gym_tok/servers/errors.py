"""OpenAI-style HTTP errors: raise `ApiError` anywhere in a handler; the client gets its status and message."""

from __future__ import annotations

from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse


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


def validation_message(errors: list[dict[str, Any]], skip: tuple[str, ...] = ("body",)) -> tuple[str, str | None]:
    """One line from a pydantic error list: `dotted.field: what is wrong`, and the dotted field.

    For a union field (e.g. `input: str | list[...]`) pydantic reports one error per branch; a plain type mismatch
    is the least useful of them, so an error from the branch the value really matched is preferred.
    """
    if not errors:
        return "invalid request", None
    first = min(errors, key=lambda error: str(error.get("type", "")).endswith("_type"))
    location = ".".join(str(part) for part in first.get("loc", ()) if part not in skip and not _is_union_tag(part))
    message = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    return (f"{location}: {message}" if location else message), (location or None)


def _is_union_tag(part: Any) -> bool:
    # pydantic names union branches in `loc` by their type: "str", "list[ResponseItem]", "function-after[...]".
    return isinstance(part, str) and (part in ("str", "int", "float", "bool", "list", "dict") or "[" in part)
