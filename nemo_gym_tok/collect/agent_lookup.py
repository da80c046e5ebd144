"""Finds an agent's URL through the head server that `ngt run` started."""

from __future__ import annotations

import httpx

from nemo_gym_tok.collect.collect_errors import HeadError
from nemo_gym_tok.common.exact_json import loads_exact
from nemo_gym_tok.common.remote_errors import error_message
from nemo_gym_tok.servers.client import AUTH_TOKEN_ENV, auth_headers

DEFAULT_HEAD_URL = "http://127.0.0.1:11500"  # launcher.DEFAULT_HEAD_PORT; not imported to keep `ngt collect` light
HEAD_URL_ENV = "NGT_HEAD_URL"


def resolve_agent_url(head_url: str, agent: str, *, timeout: float = 10.0, auth_token: str | None = None) -> str:
    """The agent's base URL from the head server's `GET /servers` (sent with the gym's bearer token, if any)."""
    head_url = head_url.rstrip("/")
    try:
        response = httpx.get(f"{head_url}/servers", timeout=timeout, headers=auth_headers(auth_token))
    except httpx.HTTPError as exc:
        raise HeadError(
            f"cannot reach the head server at {head_url} ({type(exc).__name__}: {exc}); start the servers with "
            f"`ngt run -c ...`, or point --head-url / ${HEAD_URL_ENV} at the running head"
        ) from None
    if response.status_code == 401:
        raise HeadError(
            f"head server at {head_url} requires the gym's auth_token: set ${AUTH_TOKEN_ENV} to it"
            + (" (the token sent was refused)" if auth_token else "")
        )
    if response.status_code != 200:
        raise HeadError(
            f"head server at {head_url} answered GET /servers with HTTP {response.status_code}: "
            f"{error_message(response)}"
        )
    try:
        servers = loads_exact(response.content)
    except ValueError:
        servers = None
    if not isinstance(servers, dict):
        raise HeadError(
            f"head server at {head_url} answered GET /servers with something other than a JSON object "
            "of {name: url}; is --head-url really the head server?"
        )
    if agent not in servers:
        known = ", ".join(sorted(servers)) or "none"
        raise HeadError(f"no server named {agent!r} on the head server at {head_url} (known: {known})")
    return str(servers[agent]).rstrip("/")
