"""Reads a request body as a JSON object, or answers the client with a 400 that says what is wrong."""

from __future__ import annotations

import json
from typing import Any

from fastapi import Request

from nemo_gym_tok.servers.errors import ApiError


async def json_object(request: Request) -> dict[str, Any]:
    raw = await request.body()
    try:
        body = json.loads(raw) if raw else {}
    except ValueError as exc:
        raise ApiError(400, f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise ApiError(400, f"request body must be a JSON object, got {type(body).__name__}")
    return body
