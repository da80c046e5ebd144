"""The simple agent: seeds an episode, loops model call -> tools or user turn, then verifies for the reward."""

from __future__ import annotations

import json
import uuid
from typing import Any, ClassVar

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from nemo_gym_tok.servers.base import Agent, BaseServerConfig
from nemo_gym_tok.servers.bodies import json_object
from nemo_gym_tok.servers.client import SESSION_HEADER
from nemo_gym_tok.http_errors import error_message
from nemo_gym_tok.servers.errors import ApiError
from nemo_gym_tok.types.responses import Response, ResponseUsage
from nemo_gym_tok.types.tokens import BUNDLE_FIELDS, TELEMETRY_FIELDS

ROW_PARAMS_KEY = "responses_create_params"
PREFIX_KEY = "required_prefix_token_ids"


class SimpleAgentConfig(BaseServerConfig):
    model_server: str
    """Instance name of the model adapter (e.g. a vllm_model)."""
    resources_server: str
    """Instance name of the environment."""
    max_steps: int = 8
    """Model calls per episode at most."""
    request_overrides: dict[str, Any] = {}
    """Responses fields set on every model call, over the row's (e.g. temperature: 1.0)."""
    send_token_bundles: bool = True
    """Send each call's token bundle back with the history (the hook keeps the episode token-exact). False
    strips them: stock re-tokenization, for ablations."""


class SimpleAgent(Agent):
    config_class: ClassVar[type[BaseServerConfig]] = SimpleAgentConfig
    config: SimpleAgentConfig

    def setup_routes(self, app: FastAPI) -> None:
        @app.post("/run")
        async def run(request: Request) -> dict[str, Any]:
            return await self.run_episode(await json_object(request), _session(request))

        @app.post("/v1/responses")
        async def responses(request: Request) -> JSONResponse:
            # One model turn on the agent's model: body kept whole (a harness's fields survive the hop), and the
            # model server's answer, error status included, passed back as it came.
            body, session = await json_object(request), _session(request)
            answer = await self._post(self.config.model_server, "/v1/responses", body, session)
            return JSONResponse(status_code=answer.status_code, content=answer.json())

    async def run_episode(self, row: dict[str, Any], session: str) -> dict[str, Any]:
        """One rollout record: the row's fields, `response` (every item of the episode), `reward`, verifier extras."""
        params = row.get(ROW_PARAMS_KEY)
        if not isinstance(params, dict) or "input" not in params:
            raise ApiError(400, f"the row needs {ROW_PARAMS_KEY} with an `input` (the episode's first messages)")
        env, model = self.config.resources_server, self.config.model_server
        await self._call(env, "/seed_session", row, session)
        first_input = _as_items(params["input"])
        request_base = {k: v for k, v in params.items() if k != "input"} | self.config.request_overrides
        offered = {tool.get("name") or tool.get("function", {}).get("name") for tool in request_base.get("tools") or []}
        output: list[dict[str, Any]] = []
        responses: list[dict[str, Any]] = []
        for step in range(self.config.max_steps):
            body = {**request_base, "input": first_input + self._history(output)}
            if step == 0 and PREFIX_KEY in row:  # a harness's prefix for the episode's first call
                body[PREFIX_KEY] = row[PREFIX_KEY]
            response = await self._call(model, "/v1/responses", body, session)
            responses.append(response)
            items = response.get("output") or []
            output.extend(items)
            calls = [item for item in items if item.get("type") == "function_call"]
            if calls:
                for call in calls:
                    output.append(await self._run_tool(env, call, session, offered))
                continue
            if any(item.get("context_overflow") for item in items):
                break  # the history no longer fits the model: the episode ends here
            step_result = await self._call(env, "/step", {"output": output}, session)
            if step_result.get("user_message") is not None:
                output.append({"type": "message", "role": "user", "content": str(step_result["user_message"])})
            if step_result.get("done", True):
                break  # a user_message that comes with done is the environment's last word, recorded as is
        episode = _episode_response(responses, output)
        verdict = await self._call(env, "/verify", {**row, "response": episode}, session)
        return {**row, "response": episode, **verdict}

    def _history(self, output: list[dict[str, Any]]) -> list[dict[str, Any]]:
        if self.config.send_token_bundles:
            return output
        stripped = set(BUNDLE_FIELDS) | set(TELEMETRY_FIELDS)
        return [{k: v for k, v in item.items() if k not in stripped} for item in output]

    async def _run_tool(self, env: str, call: dict[str, Any], session: str, offered: set[str]) -> dict[str, Any]:
        """The tool's answer as a function_call_output item; the model's own mistakes become text it can read."""
        if call.get("name") not in offered:  # only tools the row offers reach the environment's endpoints
            return _tool_output(call, f"error: there is no tool named {call.get('name')!r}")
        try:
            arguments = json.loads(call.get("arguments") or "{}")
        except ValueError as exc:
            return _tool_output(call, f"error: the arguments are not valid JSON ({exc})")
        if not isinstance(arguments, dict):
            return _tool_output(call, "error: the arguments must be a JSON object")
        answer = await self._post(env, f"/{call['name']}", arguments, session)
        if answer.status_code in (400, 404, 422):
            return _tool_output(call, f"error: {error_message(answer)}")
        payload = _checked_json(env, answer)
        result = payload.get("output", payload) if isinstance(payload, dict) else payload
        return _tool_output(call, result if isinstance(result, str) else json.dumps(result))

    async def _call(self, server: str, path: str, body: dict[str, Any], session: str) -> Any:
        return _checked_json(server, await self._post(server, path, body, session))

    async def _post(self, server: str, path: str, body: dict[str, Any], session: str) -> httpx.Response:
        try:
            return await self.servers.post(server, path, json=body, headers={SESSION_HEADER: session})
        except httpx.TransportError as exc:
            raise ApiError(502, f"{server} is unreachable ({type(exc).__name__}: {exc})") from None
        except LookupError as exc:
            raise ApiError(500, str(exc)) from None


def _checked_json(server: str, answer: httpx.Response) -> Any:
    if answer.status_code >= 400:
        # Our own request to another server failed: the rollout cannot go on; say which server and why.
        raise ApiError(502, f"{server} answered HTTP {answer.status_code}: {error_message(answer)}")
    return answer.json()


def _session(request: Request) -> str:
    return request.headers.get(SESSION_HEADER) or uuid.uuid4().hex


def _as_items(value: Any) -> list[dict[str, Any]]:
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if isinstance(value, list) and all(isinstance(item, dict) for item in value):
        return list(value)
    raise ApiError(400, f"{ROW_PARAMS_KEY}.input must be a string or a list of items")


def _tool_output(call: dict[str, Any], text: str) -> dict[str, Any]:
    return {"type": "function_call_output", "call_id": call.get("call_id"), "output": text}


def _episode_response(responses: list[dict[str, Any]], output: list[dict[str, Any]]) -> dict[str, Any]:
    usage = ResponseUsage()
    for response in responses:
        part = response.get("usage") or {}
        usage.input_tokens += part.get("input_tokens", 0)
        usage.output_tokens += part.get("output_tokens", 0)
        usage.total_tokens += part.get("total_tokens", 0)
    last = responses[-1] if responses else {}
    episode = Response(model=last.get("model", ""), status=last.get("status", "completed"), output=[], usage=usage)
    return {**episode.model_dump(exclude_none=True), "output": output, "model_calls": len(responses)}


SERVER = SimpleAgent
