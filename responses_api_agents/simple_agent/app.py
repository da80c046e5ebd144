"""The simple agent's server: its config, `/run` (one episode) and `/v1/responses` (one turn of its model)."""

from __future__ import annotations

import uuid
from typing import Any, ClassVar, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from fastapi.responses import Response as HTTPResponse

from nemo_gym_tok.servers.base import Agent, BaseServerConfig
from nemo_gym_tok.servers.bodies import json_object
from nemo_gym_tok.servers.client import SESSION_HEADER
from nemo_gym_tok.servers.openapi import AgentRunRequest, json_body
from nemo_gym_tok.types.responses import ResponsesRequest
from responses_api_agents.simple_agent.episode import EnvironmentProtocol, KeptResponse, ModelCalls, play_episode
from responses_api_agents.simple_agent.gym_protocol import DeclaredTools, GymEnvironment
from responses_api_agents.simple_agent.nemo_gym_protocol import NEMO_GYM, NemoGymEnvironment
from responses_api_agents.simple_agent.peers import Peers, answer_json
from responses_api_agents.simple_agent.rows import episode_request, offered_tool_names


class SimpleAgentConfig(BaseServerConfig):
    """The simple agent's fields, beside those every server has."""

    model_server: str
    """Instance name of the model adapter (e.g. a vllm_model)."""
    resources_server: str
    """Instance name of the environment."""
    max_steps: int = 8
    """Model calls per episode at most."""
    request_overrides: dict[str, Any] = {}
    """Responses fields set on every model call, over the row's (e.g. temperature: 1.0)."""
    send_token_bundles: bool = True
    """Send the latest call's token bundle back with the history (the hook takes the next prompt's prefix from it,
    which keeps the episode token-exact). False strips every bundle: stock re-tokenization, for ablations."""
    chain_responses: bool = True
    """After an answer the model server says it kept (`store: true`, as this project's adapter does), send the next
    call as `previous_response_id` and the new items only: the request no longer grows with the history. A server
    that no longer holds it gets the whole history again; one that does not echo the id fails the episode (it may
    have ignored it). The episode's last kept response is deleted at its end. Off with `send_token_bundles: false`
    (the kept history holds the bundle)."""
    environment_protocol: Literal["ngt", "nemo_gym"] = "ngt"
    """How the agent talks to `resources_server`. `ngt` (this project's environments): the episode is named by the
    `x-session-id` header, tools are the names GET /tools lists, a tool's answer is unwrapped from `{"output": ...}`,
    a turn without tool calls goes to POST /step (which may add a user turn), /verify gets the row + `response`.
    `nemo_gym` (a NeMo Gym 0.7.0 resources server, e.g. one of the 145 it ships): the episode is the session cookie
    /seed_session sets (tool answers may update it; sent back on every call), a tool call is posted to /<name> with
    its raw arguments and the model reads the answer's whole body text, the rollout ends as NeMo Gym's simple agent
    ends it (an incomplete answer, a call without function calls, or `max_steps` calls), /verify gets the row +
    `response` as NeMo Gym's `NeMoGymResponse` reads it (the last answer, the whole episode with its token bundles,
    the usage summed), then POST /close_session with an empty body where the server's OpenAPI says it takes one
    (NeMo Gym's servers that hold resources per session release them so). The record is this project's either way
    (schema 2, the row as sent), with `reward` and the verifier's other fields from /verify."""


class SimpleAgent(Agent):
    """Plays one episode per `/run`: one model server, one environment, speaking the protocol the config names."""

    config_class: ClassVar[type[BaseServerConfig]] = SimpleAgentConfig
    config: SimpleAgentConfig

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.peers = Peers(self.servers)
        # What each environment serves is read once per agent, not once per episode.
        self._declared_tools: DeclaredTools = {}
        self._closes_sessions: dict[str, bool] = {}

    def setup_routes(self, app: FastAPI) -> None:
        @app.post("/run", openapi_extra=json_body(AgentRunRequest, session="optional"))
        async def run(request: Request) -> dict[str, Any]:
            return await self.run_episode(await json_object(request), _session(request))

        @app.post("/v1/responses", openapi_extra=json_body(ResponsesRequest, session="optional"))
        async def responses(request: Request) -> HTTPResponse:
            # One model turn on the agent's model: body kept whole (a harness's fields survive the hop), and the
            # model server's answer, error status included, passed back as it came.
            body, session = await json_object(request), _session(request)
            answer = await self.peers.post(self.config.model_server, "/v1/responses", body, session)
            content_type = answer.headers.get("content-type", "")
            if answer.status_code < 400 and not content_type.startswith("application/json"):
                # A streamed answer (stream: true): its server-sent events, passed on whole.
                return HTTPResponse(answer.content, status_code=answer.status_code, media_type=content_type or None)
            return JSONResponse(status_code=answer.status_code, content=answer_json(self.config.model_server, answer))

    async def run_episode(self, row: dict[str, Any], session: str) -> dict[str, Any]:
        """One rollout record (schema_version 2): the row's fields, `response` (every item of the episode, each model
        call's bundle packed once), `reward`, verifier extras."""
        first_input, request = episode_request(row, self.config.request_overrides)
        offered = offered_tool_names(request.get("tools"))  # checked under either protocol: a bad row is a 400
        chain = self.config.chain_responses and self.config.send_token_bundles
        model = ModelCalls(
            self.peers,
            self.config.model_server,
            session,
            row,
            first_input,
            request,
            self.config.send_token_bundles,
            KeptResponse() if chain else None,
        )
        return await play_episode(row, model, self._environment(session, offered), self.config.max_steps)

    def _environment(self, session: str, offered: set[str]) -> EnvironmentProtocol:
        """The episode's side of the protocol `resources_server` speaks."""
        env = self.config.resources_server
        if self.config.environment_protocol == NEMO_GYM:
            return NemoGymEnvironment(self.peers, env, self._closes_sessions)
        return GymEnvironment(self.peers, env, session, offered, self._declared_tools)


def _session(request: Request) -> str:
    return request.headers.get(SESSION_HEADER) or uuid.uuid4().hex


SERVER = SimpleAgent
