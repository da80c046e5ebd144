"""NeMo Gym's resources-server protocol (`environment_protocol: nemo_gym`), one episode's side of it.

NeMo Gym (0.7.0) resources servers keep a rollout's state under a signed session cookie that `/seed_session` sets and
tool answers may update; a tool route takes the raw arguments and the whole body text it answers (whatever the
status) is what the model reads; `/verify` takes the row plus `response`, a Responses object that NeMo Gym's
`NeMoGymResponse` validates (its output items may carry token bundles), and answers the request echoed plus `reward`
and diagnostics; there is no step route. Servers that hold resources per /run-seeded session release them on
`POST /close_session` with an empty body; others refuse that body (422) or do not serve the route (404).
"""

from __future__ import annotations

import json
import re
from http.cookies import CookieError, SimpleCookie
from typing import Any

import httpx

from nemo_gym_tok.common.exact_json import loads_exact
from nemo_gym_tok.common.remote_errors import error_message
from nemo_gym_tok.servers.api_errors import ApiError
from responses_api_agents.simple_agent.episode import PlayedEpisode
from responses_api_agents.simple_agent.episode_items import function_call_output
from responses_api_agents.simple_agent.peers import Peers, checked_json
from responses_api_agents.simple_agent.rows import RowParam, same_field, verify_row_field

NEMO_GYM = "nemo_gym"
"""The `environment_protocol` value that selects this protocol."""
COOKIE_HEADER = "cookie"
CLOSE_SESSION_PATH = "/close_session"
# Endpoints of a NeMo Gym resources server that a tool call must never reach: the episode's own life cycle.
LIFECYCLE_ROUTES = frozenset(
    {
        "seed_session",
        "verify",
        "close_session",
        "aggregate_metrics",
        "reverify_mode",
        "mcp",
        "health",
        "docs",
        "redoc",
        "openapi.json",
    }
)
_TOOL_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")
# Status codes of /close_session that mean "nothing to release for a /run-seeded session" (route absent, or it
# closes only sessions seeded with a resources_session_id).
CLOSE_NOT_APPLICABLE = frozenset({404, 405, 422})


def closes_cookie_sessions(openapi: Any) -> bool:
    """Whether a server's OpenAPI document (None: unknown) serves POST /close_session with an optional body, the way
    NeMo Gym's servers that hold per-session resources close a /run-seeded session. The base class's route requires
    a typed body (sessions an Environment Server seeded): nothing to close there, and a 422 logged per rollout."""
    if not isinstance(openapi, dict):
        return True  # no schema to read: try, and take 404/405/422 for "nothing to close"
    route = ((openapi.get("paths") or {}).get(CLOSE_SESSION_PATH) or {}).get("post")
    if not isinstance(route, dict):
        return False
    return not (route.get("requestBody") or {}).get("required", False)


class NemoGymEnvironment:
    """One episode on a NeMo Gym resources server: its session is the cookie /seed_session sets."""

    def __init__(self, peers: Peers, env: str, closes_sessions: dict[str, bool]) -> None:
        self.peers, self.env = peers, env
        self.jar = CookieJar()
        self.closes_sessions = closes_sessions
        """The agent's cache, shared by its episodes: environment name -> whether its /close_session takes the
        empty body that closes a cookie session."""

    async def seed(self, row: dict[str, Any]) -> None:
        await self._call("/seed_session", row, same_field)

    def ends_before_tools(self, response: dict[str, Any]) -> bool:
        return ends_episode(response)

    async def tool_output(self, call: dict[str, Any]) -> dict[str, Any]:
        """The environment's whole answer body, as NeMo Gym's agent gives it, or the agent's own JSON error for
        arguments that are not JSON and names that are no tool route."""
        try:
            arguments = loads_exact(call.get("arguments") or "")
        except (ValueError, TypeError) as exc:
            return function_call_output(call, invalid_arguments_text(exc))
        route = tool_route(call.get("name"))
        if route is None:
            return function_call_output(call, refused_tool_text(call.get("name")))
        answer = await self.peers.post(self.env, route, arguments, None, self.jar.headers())
        self.jar.update(answer)
        return function_call_output(call, tool_output_text(answer))

    async def after_text_turn(self, items: list[dict[str, Any]]) -> tuple[dict[str, Any] | None, bool]:
        """Never reached (a turn without function calls ends the episode, `ends_episode`): no step route here."""
        return None, True

    async def verify(self, row: dict[str, Any], played: PlayedEpisode) -> dict[str, Any]:
        body = {**row, "response": verify_response(played.responses, played.transcript)}
        return verdict_fields(await self._call("/verify", body, verify_row_field), row)

    async def close(self) -> None:
        """Release the episode's session on the environment (empty body: the session is the cookie's)."""
        if not self.jar.headers() or not await self._closes_cookie_sessions():
            return  # seeding failed before the server named a session, or the server keeps nothing to release
        answer = await self.peers.post(self.env, CLOSE_SESSION_PATH, {}, None, self.jar.headers())
        if answer.status_code >= 400 and answer.status_code not in CLOSE_NOT_APPLICABLE:
            raise ApiError(
                502, f"{self.env} could not close the session: HTTP {answer.status_code}: {error_message(answer)}"
            )

    async def _call(self, path: str, body: dict[str, Any], row_param: RowParam) -> Any:
        answer = await self.peers.post(self.env, path, body, None, self.jar.headers())
        self.jar.update(answer)
        return checked_json(self.env, answer, row_param)

    async def _closes_cookie_sessions(self) -> bool:
        """Whether the environment releases a /run-seeded session on POST /close_session (read once from its
        OpenAPI)."""
        if self.env not in self.closes_sessions:
            try:
                answer = await self.peers.servers.get(self.env, "/openapi.json")
                schema = loads_exact(answer.content) if answer.status_code == 200 else None
            except (httpx.TransportError, ValueError):
                schema = None
            self.closes_sessions[self.env] = closes_cookie_sessions(schema)
        return self.closes_sessions[self.env]


class CookieJar:
    """One episode's cookies for one server: what its answers set, sent back on every later call."""

    def __init__(self) -> None:
        self._cookies: dict[str, str] = {}

    def update(self, answer: httpx.Response) -> None:
        """Take the cookies `answer` sets (several Set-Cookie headers allowed); an expired one is dropped."""
        for header in answer.headers.get_list("set-cookie"):
            parsed = SimpleCookie()
            try:
                parsed.load(header)
            except CookieError:
                continue  # a cookie the standard parser cannot read is one no server of ours set
            for name, morsel in parsed.items():
                if morsel["max-age"] in ("0", "-1") or morsel.value == "":
                    self._cookies.pop(name, None)
                else:
                    self._cookies[name] = morsel.value

    def headers(self) -> dict[str, str]:
        """The Cookie header for the next request (empty before the server set any)."""
        if not self._cookies:
            return {}
        return {COOKIE_HEADER: "; ".join(f"{name}={value}" for name, value in self._cookies.items())}


def tool_route(name: Any) -> str | None:
    """The path a tool call named `name` is posted to, or None when it names no tool route (a life-cycle endpoint,
    or not a plain route name): NeMo Gym's agent posts any name, so the server answers unknown ones itself (404)."""
    if not isinstance(name, str) or not _TOOL_NAME.match(name) or name in LIFECYCLE_ROUTES:
        return None
    return f"/{name}"


def refused_tool_text(name: Any) -> str:
    """What the model reads for a call that names a life-cycle endpoint or no route at all, shaped as a JSON error."""
    return json.dumps({"error": f"there is no tool named {name!r}"})


def invalid_arguments_text(exc: Exception) -> str:
    """What the model reads when its arguments are not JSON: the text NeMo Gym's simple agent gives (a JSON object
    with the parser's error repr), so the next prompt is the same under either agent."""
    return json.dumps({"error": f"Invalid tool call arguments: {exc!r}"})


def tool_output_text(answer: httpx.Response) -> str:
    """A tool's answer as the model reads it: the whole body text, whatever the status (an environment's error is a
    tool result the model may act on)."""
    return answer.content.decode("utf-8", errors="replace")


def ends_episode(response: dict[str, Any]) -> bool:
    """Whether a model call ends the rollout as NeMo Gym's simple agent ends it: the answer is incomplete (cut by
    max_output_tokens, or the context overflowed) or it calls no function."""
    output = response.get("output") or []
    if response.get("incomplete_details") or any(item.get("context_overflow") for item in output):
        return True
    return not any(item.get("type") == "function_call" for item in output)


def verify_response(responses: list[dict[str, Any]], items: list[dict[str, Any]]) -> dict[str, Any]:
    """The `response` /verify gets: the last model answer with the whole episode as its output (each call's token
    bundle where the model server put it) and the usage summed over the calls. A last answer that is neither cut nor
    a tool call nor an assistant message (reasoning only, or empty) is marked incomplete, as NeMo Gym marks it."""
    last = responses[-1]
    usage = _summed([r.get("usage") or {} for r in responses])
    status = last.get("status", "completed")
    last_output = last.get("output") or []
    said_something = any(item.get("type") in ("function_call", "message") for item in last_output)
    if not last.get("incomplete_details") and not said_something:
        status = "incomplete"
    return {**last, "output": items, "usage": usage, "status": status}


def verdict_fields(verdict: Any, row: dict[str, Any]) -> dict[str, Any]:
    """What a NeMo Gym /verify answer adds to the rollout record: `reward` and the verifier's fields. Its echo of the
    request (the row's fields, re-serialized, and `response`) is dropped: the record keeps the row as it came and the
    episode with its packed bundles."""
    if not isinstance(verdict, dict):
        return {}
    return {k: v for k, v in verdict.items() if k != "response" and k not in row}


def _summed(usages: list[dict[str, Any]]) -> dict[str, Any]:
    """Token counts added up, nested details included (input_tokens_details.cached_tokens and the like)."""
    total: dict[str, Any] = {}
    for usage in usages:
        for key, value in usage.items():
            if isinstance(value, bool):
                continue
            if isinstance(value, (int, float)):
                total[key] = total.get(key, 0) + value
            elif isinstance(value, dict):
                total[key] = _summed([total.get(key) or {}, value])
    return total
