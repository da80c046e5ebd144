"""Reads the message out of another server's error answer (no server imports: the collector uses it too)."""

from __future__ import annotations

import json

import httpx

from nemo_gym_tok.common.exact_json import loads_exact

_MAX_BODY_CHARS = 2000


def error_param(response: httpx.Response) -> str | None:
    """OpenAI-style `error.param` (the request field at fault), when the answer names one."""
    return _error_field(response, "param")


def error_type(response: httpx.Response) -> str | None:
    """OpenAI-style `error.type` (what kind of refusal), when the answer names one."""
    return _error_field(response, "type")


def _error_field(response: httpx.Response, name: str) -> str | None:
    try:
        body = loads_exact(response.content)
    except ValueError:
        return None
    error = body.get("error") if isinstance(body, dict) else None
    value = error.get(name) if isinstance(error, dict) else None
    return value if isinstance(value, str) and value else None


def error_message(response: httpx.Response) -> str:
    """OpenAI-style `error.message`, FastAPI's `detail`, or the start of the raw body."""
    try:
        body = loads_exact(response.content)
    except ValueError:
        body = None
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])
        if isinstance(error, str):
            return error
        if "detail" in body:
            detail = body["detail"]
            return detail if isinstance(detail, str) else json.dumps(detail)
    text = response.text.strip()
    if len(text) > _MAX_BODY_CHARS:
        text = text[:_MAX_BODY_CHARS] + "..."
    return text or "(empty body)"
