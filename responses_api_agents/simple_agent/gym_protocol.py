"""This project's environment protocol (`environment_protocol: ngt`), one episode's side of it.

The episode is named by the `x-session-id` header on every call; a tool call reaches only a name the row offers and
the environment lists on GET /tools, and the model reads the tool's `{"output": ...}` unwrapped; a turn without tool
calls goes to POST /step, which may add a user turn or end the episode; /verify gets the row plus the episode as one
Responses object without token fields.
"""

from __future__ import annotations

import json
from typing import Any

import httpx

from nemo_gym_tok.common.exact_json import loads_exact
from nemo_gym_tok.common.remote_errors import error_message
from nemo_gym_tok.servers.api_errors import ApiError
from nemo_gym_tok.servers.base import RESERVED_PATHS
from responses_api_agents.simple_agent.episode import PlayedEpisode
from responses_api_agents.simple_agent.episode_items import content_parts, function_call_output
from responses_api_agents.simple_agent.peers import Peers, checked_json
from responses_api_agents.simple_agent.rows import same_field, verify_row_field

DeclaredTools = dict[str, frozenset[str] | None]
"""Environment name -> the tool names its GET /tools lists (None: it serves no /tools)."""


class GymEnvironment:
    """One episode on an environment built on this project's ResourcesServer (or one that answers as it does)."""

    def __init__(self, peers: Peers, env: str, session: str, offered: set[str], declared: DeclaredTools) -> None:
        self.peers, self.env, self.session = peers, env, session
        self.offered = offered
        """The function tools the row offers the model."""
        self.declared = declared
        """The agent's cache of what each environment's GET /tools lists, shared by its episodes."""

    async def seed(self, row: dict[str, Any]) -> None:
        await self.peers.call(self.env, "/seed_session", row, self.session, row_param=same_field)

    def ends_before_tools(self, response: dict[str, Any]) -> bool:
        output = response.get("output") or []
        calls = any(item.get("type") == "function_call" for item in output)
        return not calls and any(item.get("context_overflow") for item in output)  # the history no longer fits

    async def tool_output(self, call: dict[str, Any]) -> dict[str, Any]:
        """The tool's answer; the model's own mistakes become text it can read."""
        # Only tools the row offers AND the environment declares reach its endpoints: a row offering a tool named
        # "seed_session" must not let the model restart the episode.
        if call.get("name") not in self.offered or not await self._declares_tool(call["name"]):
            return function_call_output(call, f"error: there is no tool named {call.get('name')!r}")
        try:
            arguments = loads_exact(call.get("arguments") or "{}")
        except ValueError as exc:
            return function_call_output(call, f"error: the arguments are not valid JSON ({exc})")
        if not isinstance(arguments, dict):
            return function_call_output(call, "error: the arguments must be a JSON object")
        answer = await self.peers.post(self.env, f"/{call['name']}", arguments, self.session)
        if answer.status_code in (400, 404, 422):
            return function_call_output(call, f"error: {error_message(answer)}")
        payload = checked_json(self.env, answer)
        result = payload.get("output", payload) if isinstance(payload, dict) else payload
        if isinstance(result, str):
            return function_call_output(call, result)
        return function_call_output(call, content_parts(result) or json.dumps(result))

    async def after_text_turn(self, items: list[dict[str, Any]]) -> tuple[dict[str, Any] | None, bool]:
        # Environments judge text and tool calls: token ids are none of their business, and most of the bytes.
        step = await self.peers.call(self.env, "/step", {"output": items}, self.session)
        user_message = step.get("user_message")
        user_turn = None if user_message is None else {"type": "message", "role": "user", "content": str(user_message)}
        return user_turn, bool(step.get("done", True))

    async def verify(self, row: dict[str, Any], played: PlayedEpisode) -> dict[str, Any]:
        body = {**row, "response": played.summary}
        return await self.peers.call(self.env, "/verify", body, self.session, row_param=verify_row_field)

    async def close(self) -> None:
        """Nothing to send: this protocol has no route that closes a session."""

    async def _declares_tool(self, name: str) -> bool:
        """Whether the environment lists `name` on GET /tools (read once per environment). One that does not serve
        /tools (not built on ResourcesServer) gets every name but its reserved endpoints."""
        if self.env not in self.declared:
            try:
                answer = await self.peers.servers.get(self.env, "/tools")
            except httpx.TransportError as exc:
                raise ApiError(502, f"{self.env} is unreachable ({type(exc).__name__}: {exc})") from None
            declared: frozenset[str] | None = None
            if answer.status_code not in (404, 405):
                payload = checked_json(self.env, answer)
                names = payload.get("tools") if isinstance(payload, dict) else None
                if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
                    raise ApiError(502, f"{self.env} answered GET /tools without a list of tool names")
                declared = frozenset(names)
            self.declared[self.env] = declared
        declared = self.declared[self.env]
        return name not in RESERVED_PATHS if declared is None else name in declared
