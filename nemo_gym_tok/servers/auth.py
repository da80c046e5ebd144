"""The gym's optional bearer token: where it comes from, the check every server runs, the header every client sends."""

from __future__ import annotations

import hmac
import json
import os
from collections.abc import Mapping
from typing import Any

from starlette.types import ASGIApp, Receive, Scope, Send

from nemo_gym_tok.config import ConfigError, GymConfig
from nemo_gym_tok.servers.api_errors import ApiError
from nemo_gym_tok.servers.client import AUTH_TOKEN_ENV, auth_headers

__all__ = ["AUTH_TOKEN_ENV", "AUTH_TOKEN_KEY", "BearerTokenMiddleware", "auth_headers", "auth_token_of", "check_token"]

AUTH_TOKEN_KEY = "auth_token"
"""Top-level config key: when set, every gym server requires `Authorization: Bearer <token>` on every route but
`/health`, and the gym's own clients send it."""
OPEN_PATHS = frozenset({"/health"})
"""Paths answered without the token: the readiness and liveness probe, which tells nothing about the gym."""


def check_token(token: Any, where: str = AUTH_TOKEN_KEY) -> str:
    """`token` if usable in an HTTP header (non-empty printable ASCII without whitespace), else ValueError."""
    if isinstance(token, int) and not isinstance(token, bool):
        token = str(token)  # `--set auth_token=1234` parses as YAML: an int
    if not isinstance(token, str):
        raise ValueError(f"{where} must be a string, got {type(token).__name__}")
    if not token:
        raise ValueError(f"{where} is empty; remove it to run without a token")
    if not all("!" <= char <= "~" for char in token):
        raise ValueError(f"{where} must be printable ASCII without spaces (it is sent in an HTTP header)")
    return token


def auth_token_of(config: GymConfig, environ: Mapping[str, str] = os.environ) -> str | None:
    """The gym's token: top-level `auth_token` of the config, else $NGT_AUTH_TOKEN, else None (no auth).
    Raises ConfigError naming the file for a token that cannot be sent in a header."""
    if AUTH_TOKEN_KEY in config.values and config.values[AUTH_TOKEN_KEY] is not None:
        try:
            return check_token(config.values[AUTH_TOKEN_KEY])
        except ValueError as exc:
            raise ConfigError(
                config.sources.get((AUTH_TOKEN_KEY,)), AUTH_TOKEN_KEY, str(exc).removeprefix(f"{AUTH_TOKEN_KEY} ")
            ) from None
    return env_auth_token(environ)


def env_auth_token(environ: Mapping[str, str] = os.environ) -> str | None:
    """$NGT_AUTH_TOKEN checked, or None when unset or empty."""
    token = environ.get(AUTH_TOKEN_ENV)
    return check_token(token, f"${AUTH_TOKEN_ENV}") if token else None


class BearerTokenMiddleware:
    """ASGI middleware: every HTTP request but those to OPEN_PATHS needs `Authorization: Bearer <token>`; others get
    401 with an OpenAI-shaped error. Wraps the whole app, so /docs, /openapi.json and unknown paths are covered."""

    def __init__(self, app: ASGIApp, token: str) -> None:
        self.app = app
        self._expected = check_token(token).encode("ascii")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket") or scope.get("path") in OPEN_PATHS or self._authorized(scope):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":  # no route uses one; refuse the handshake without a body
            await send({"type": "websocket.close", "code": 1008})
            return
        body = json.dumps(
            ApiError(
                401,
                "missing or wrong bearer token: send `Authorization: Bearer <token>` with the gym's auth_token",
                error_type="authentication_error",
            ).body()
        ).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 401,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"www-authenticate", b"Bearer"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})

    def _authorized(self, scope: Scope) -> bool:
        given = b""
        for name, value in scope.get("headers", ()):
            if name.lower() == b"authorization":
                given = value
                break
        scheme, _, credentials = given.partition(b" ")
        # hmac.compare_digest: the time taken does not tell how much of a guessed token was right.
        matches = hmac.compare_digest(credentials.strip(), self._expected)
        return scheme.lower() == b"bearer" and matches
