"""The simple agent's calls to the other gym servers: their failures and refusals as the agent's own API errors."""

from __future__ import annotations

from typing import Any

import httpx

from nemo_gym_tok.common.exact_json import loads_exact
from nemo_gym_tok.common.remote_errors import error_message, error_param
from nemo_gym_tok.servers.api_errors import ApiError
from nemo_gym_tok.servers.client import SESSION_HEADER, ServerClient
from responses_api_agents.simple_agent.rows import RowParam

ROW_REFUSALS = (400, 413, 422)
"""Statuses of another server that may be the row's fault (then `row_param` names its field)."""


class Peers:
    """The model server and the environment, reached by instance name through the agent's client."""

    def __init__(self, servers: ServerClient) -> None:
        self.servers = servers

    async def post(
        self,
        server: str,
        path: str,
        body: Any,
        session: str | None,
        headers: dict[str, str] | None = None,
    ) -> httpx.Response:
        """POST to `server`: the episode named by the `x-session-id` header (`session`) and/or by `headers`."""
        headers = {**(headers or {}), **({SESSION_HEADER: session} if session is not None else {})}
        try:
            return await self.servers.post(server, path, json=body, headers=headers)
        except httpx.TransportError as exc:
            raise ApiError(502, f"{server} is unreachable ({type(exc).__name__}: {exc})") from None
        except LookupError as exc:
            raise ApiError(500, str(exc)) from None

    async def call(
        self,
        server: str,
        path: str,
        body: dict[str, Any],
        session: str,
        row_param: RowParam | None = None,
    ) -> Any:
        """`server`'s JSON answer; with `row_param`, a 4xx refusal is the row's fault and becomes a 400 (413) naming
        the row field `row_param` maps the server's `error.param` to, else any error is a 502."""
        return checked_json(server, await self.post(server, path, body, session), row_param)


def checked_json(server: str, answer: httpx.Response, row_param: RowParam | None = None) -> Any:
    """The JSON of a successful answer, else the ApiError that blames the row (`row_param`) or the gym (502)."""
    if answer.status_code >= 400:
        if row_param is not None and answer.status_code in ROW_REFUSALS:
            param = row_param(error_param(answer))
            if param is not None:
                # The environment or the model refused what the row says: the caller's mistake, named by field.
                status = 413 if answer.status_code == 413 else 400
                named = f" ({param})" if param else ""
                raise ApiError(status, f"{server} refused the row{named}: {error_message(answer)}", param=param or None)
        # Our own request to another server failed: the rollout cannot go on; say which server and why.
        raise ApiError(502, f"{server} answered HTTP {answer.status_code}: {error_message(answer)}")
    return answer_json(server, answer)


def answer_json(server: str, answer: httpx.Response) -> Any:
    """The answer's JSON, whatever its status; a 502 naming `server` when its body is not JSON."""
    try:
        return loads_exact(answer.content)
    except ValueError:
        raise ApiError(502, f"{server} answered HTTP {answer.status_code} with a body that is not JSON") from None
