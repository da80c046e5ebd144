"""The simple agent: seeds an episode, loops model call -> tools or user turn, then verifies for the reward."""

from __future__ import annotations

import contextlib
import json
import uuid
from collections.abc import Callable
from typing import Any, ClassVar, Literal

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from fastapi.responses import Response as HTTPResponse

from nemo_gym_tok.agents.simple_agent import nemo_gym_protocol as nemo_gym
from nemo_gym_tok.common.remote_errors import error_message, error_param
from nemo_gym_tok.records.rollout_record import RECORD_SCHEMA_VERSION, SCHEMA_VERSION_KEY, PromptPacker
from nemo_gym_tok.servers.api_errors import ApiError
from nemo_gym_tok.servers.base import RESERVED_PATHS, Agent, BaseServerConfig
from nemo_gym_tok.servers.bodies import json_object
from nemo_gym_tok.servers.client import SESSION_HEADER
from nemo_gym_tok.servers.openapi import AgentRunRequest, json_body
from nemo_gym_tok.types.responses import Response, ResponsesRequest, ResponseUsage
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
    """Send the latest call's token bundle back with the history (the hook takes the next prompt's prefix from it,
    which keeps the episode token-exact). False strips every bundle: stock re-tokenization, for ablations."""
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
    config_class: ClassVar[type[BaseServerConfig]] = SimpleAgentConfig
    config: SimpleAgentConfig

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._declared_tools: dict[str, frozenset[str] | None] = {}
        """Environment name -> the tool names its GET /tools lists (None: it serves no /tools)."""
        self._closes_sessions: dict[str, bool] = {}
        """NeMo Gym environment name -> whether its /close_session takes the empty body that closes a cookie session."""

    def setup_routes(self, app: FastAPI) -> None:
        @app.post("/run", openapi_extra=json_body(AgentRunRequest, session="optional"))
        async def run(request: Request) -> dict[str, Any]:
            return await self.run_episode(await json_object(request), _session(request))

        @app.post("/v1/responses", openapi_extra=json_body(ResponsesRequest, session="optional"))
        async def responses(request: Request) -> HTTPResponse:
            # One model turn on the agent's model: body kept whole (a harness's fields survive the hop), and the
            # model server's answer, error status included, passed back as it came.
            body, session = await json_object(request), _session(request)
            answer = await self._post(self.config.model_server, "/v1/responses", body, session)
            content_type = answer.headers.get("content-type", "")
            if answer.status_code < 400 and not content_type.startswith("application/json"):
                # A streamed answer (stream: true): its server-sent events, passed on whole.
                return HTTPResponse(answer.content, status_code=answer.status_code, media_type=content_type or None)
            return JSONResponse(status_code=answer.status_code, content=_answer_json(self.config.model_server, answer))

    async def run_episode(self, row: dict[str, Any], session: str) -> dict[str, Any]:
        """One rollout record (schema_version 2): the row's fields, `response` (every item of the episode, each model
        call's bundle packed once), `reward`, verifier extras."""
        params = row.get(ROW_PARAMS_KEY)
        if not isinstance(params, dict) or "input" not in params:
            raise ApiError(
                400,
                f"the row needs {ROW_PARAMS_KEY} with an `input` (the episode's first messages)",
                param=ROW_PARAMS_KEY,
            )
        env = self.config.resources_server
        first_input = _as_items(params["input"])
        request_base = {k: v for k, v in params.items() if k != "input"} | self.config.request_overrides
        offered = _offered_tool_names(request_base.get("tools"))
        if self.config.environment_protocol == nemo_gym.NEMO_GYM:
            return await self._run_nemo_gym_episode(row, session, first_input, request_base)
        await self._call(env, "/seed_session", row, session, row_param=_same_field)
        episode = _Episode()
        responses: list[dict[str, Any]] = []
        for step in range(self.config.max_steps):
            body = {**request_base, "input": first_input + episode.for_model(self.config.send_token_bundles)}
            response = await self._model_call(row, body, step, session)
            responses.append(response)
            items = response.get("output") or []
            episode.add_call(items)
            calls = [item for item in items if item.get("type") == "function_call"]
            if calls:
                for call in calls:
                    episode.add(await self._run_tool(env, call, session, offered))
                continue
            if any(item.get("context_overflow") for item in items):
                break  # the history no longer fits the model: the episode ends here
            # Environments judge text and tool calls: token ids are none of their business, and most of the bytes.
            step_result = await self._call(env, "/step", {"output": episode.items}, session)
            if step_result.get("user_message") is not None:
                episode.add({"type": "message", "role": "user", "content": str(step_result["user_message"])})
            if step_result.get("done", True):
                break  # a user_message that comes with done is the environment's last word, recorded as is
        summary = _episode_response(responses, episode.items)
        verdict = await self._call(
            env, "/verify", {**row, "response": summary}, session, row_param=_row_field_of_verify
        )
        return _record(row, {**summary, "output": episode.recorded()}, verdict)

    async def _model_call(self, row: dict[str, Any], body: dict[str, Any], step: int, session: str) -> dict[str, Any]:
        if step == 0 and PREFIX_KEY in row:  # a harness's prefix for the episode's first call
            body[PREFIX_KEY] = row[PREFIX_KEY]
        # Only the first call is the row's as sent; a refusal later is about the episode the gym built.
        row_param = _row_field if step == 0 else None
        return await self._call(self.config.model_server, "/v1/responses", body, session, row_param=row_param)

    async def _run_nemo_gym_episode(
        self,
        row: dict[str, Any],
        session: str,
        first_input: list[dict[str, Any]],
        request_base: dict[str, Any],
    ) -> dict[str, Any]:
        """One rollout against a NeMo Gym resources server (`environment_protocol: nemo_gym`)."""
        env, jar = self.config.resources_server, nemo_gym.CookieJar()
        await self._env_call(env, "/seed_session", row, jar, row_param=_same_field)
        episode = _Episode()
        responses: list[dict[str, Any]] = []
        whole: list[dict[str, Any]] = []  # the episode with every call's bundle as it came: what /verify reads
        try:
            for step in range(self.config.max_steps):
                body = {**request_base, "input": first_input + episode.for_model(self.config.send_token_bundles)}
                response = await self._model_call(row, body, step, session)
                responses.append(response)
                items = response.get("output") or []
                episode.add_call(items)
                whole.extend(items)
                if nemo_gym.ends_episode(response):
                    break
                for call in (item for item in items if item.get("type") == "function_call"):
                    output = _tool_output(call, await self._nemo_gym_tool(env, call, jar))
                    episode.add(output)
                    whole.append(output)
            summary = _episode_response(responses, episode.items)
            verify_body = {**row, "response": nemo_gym.verify_response(responses, whole)}
            verdict = await self._env_call(env, "/verify", verify_body, jar, row_param=_row_field_of_verify)
        except BaseException:
            with contextlib.suppress(Exception):  # the episode's own failure is the one the caller must see
                await self._nemo_gym_close(env, jar)
            raise
        await self._nemo_gym_close(env, jar)
        return _record(row, {**summary, "output": episode.recorded()}, nemo_gym.verdict_fields(verdict, row))

    async def _nemo_gym_tool(self, env: str, call: dict[str, Any], jar: nemo_gym.CookieJar) -> str:
        """The text the model reads for one function call: the environment's whole answer body, as NeMo Gym's agent
        gives it, or the agent's own JSON error for arguments that are not JSON and names that are no tool route."""
        try:
            arguments = json.loads(call.get("arguments") or "")
        except (ValueError, TypeError) as exc:
            return nemo_gym.invalid_arguments_text(exc)
        route = nemo_gym.tool_route(call.get("name"))
        if route is None:
            return nemo_gym.refused_tool_text(call.get("name"))
        answer = await self._post(env, route, arguments, None, jar.headers())
        jar.update(answer)
        return nemo_gym.tool_output_text(answer)

    async def _closes_cookie_sessions(self, env: str) -> bool:
        """Whether `env` releases a /run-seeded session on POST /close_session (read once from its OpenAPI)."""
        if env not in self._closes_sessions:
            try:
                answer = await self.servers.get(env, "/openapi.json")
                schema = answer.json() if answer.status_code == 200 else None
            except (httpx.TransportError, ValueError):
                schema = None
            self._closes_sessions[env] = nemo_gym.closes_cookie_sessions(schema)
        return self._closes_sessions[env]

    async def _env_call(
        self,
        env: str,
        path: str,
        body: dict[str, Any],
        jar: nemo_gym.CookieJar,
        row_param: RowParam,
    ) -> Any:
        answer = await self._post(env, path, body, None, jar.headers())
        jar.update(answer)
        return _checked_json(env, answer, row_param)

    async def _nemo_gym_close(self, env: str, jar: nemo_gym.CookieJar) -> None:
        """Release the episode's session on the environment (empty body: the session is the cookie's)."""
        if not jar.headers() or not await self._closes_cookie_sessions(env):
            return  # seeding failed before the server named a session, or the server keeps nothing to release
        answer = await self._post(env, nemo_gym.CLOSE_SESSION_PATH, {}, None, jar.headers())
        if answer.status_code >= 400 and answer.status_code not in nemo_gym.CLOSE_NOT_APPLICABLE:
            raise ApiError(
                502, f"{env} could not close the session: HTTP {answer.status_code}: {error_message(answer)}"
            )

    async def _run_tool(self, env: str, call: dict[str, Any], session: str, offered: set[str]) -> dict[str, Any]:
        """The tool's answer as a function_call_output item; the model's own mistakes become text it can read."""
        # Only tools the row offers AND the environment declares reach its endpoints: a row offering a tool named
        # "seed_session" must not let the model restart the episode.
        if call.get("name") not in offered or not await self._declares_tool(env, call["name"]):
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

    async def _call(
        self,
        server: str,
        path: str,
        body: dict[str, Any],
        session: str,
        row_param: RowParam | None = None,
    ) -> Any:
        """`server`'s JSON answer; with `row_param`, a 4xx refusal is the row's fault and becomes a 400 (413) naming
        the row field `row_param` maps the server's `error.param` to, else any error is a 502."""
        return _checked_json(server, await self._post(server, path, body, session), row_param)

    async def _declares_tool(self, env: str, name: str) -> bool:
        """Whether `env` lists `name` on GET /tools (read once per environment). An environment that does not serve
        /tools (not built on ResourcesServer) gets every name but its reserved endpoints."""
        if env not in self._declared_tools:
            try:
                answer = await self.servers.get(env, "/tools")
            except httpx.TransportError as exc:
                raise ApiError(502, f"{env} is unreachable ({type(exc).__name__}: {exc})") from None
            declared: frozenset[str] | None = None
            if answer.status_code not in (404, 405):
                payload = _checked_json(env, answer)
                names = payload.get("tools") if isinstance(payload, dict) else None
                if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
                    raise ApiError(502, f"{env} answered GET /tools without a list of tool names")
                declared = frozenset(names)
            self._declared_tools[env] = declared
        declared = self._declared_tools[env]
        return name not in RESERVED_PATHS if declared is None else name in declared

    async def _post(
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


RowParam = Callable[[str | None], str | None]
"""Maps the field a server's 4xx names (error.param) to the row field it came from; None: not the row's fault."""
_ROW_REFUSALS = (400, 413, 422)


def _record(row: dict[str, Any], response: dict[str, Any], verdict: dict[str, Any]) -> dict[str, Any]:
    record = {SCHEMA_VERSION_KEY: RECORD_SCHEMA_VERSION, **row, "response": response, **verdict}
    record[SCHEMA_VERSION_KEY] = RECORD_SCHEMA_VERSION  # ours, even over a row or verifier field of that name
    return record


def _checked_json(server: str, answer: httpx.Response, row_param: RowParam | None = None) -> Any:
    if answer.status_code >= 400:
        if row_param is not None and answer.status_code in _ROW_REFUSALS:
            param = row_param(error_param(answer))
            if param is not None:
                # The environment or the model refused what the row says: the caller's mistake, named by field.
                status = 413 if answer.status_code == 413 else 400
                named = f" ({param})" if param else ""
                raise ApiError(status, f"{server} refused the row{named}: {error_message(answer)}", param=param or None)
        # Our own request to another server failed: the rollout cannot go on; say which server and why.
        raise ApiError(502, f"{server} answered HTTP {answer.status_code}: {error_message(answer)}")
    return _answer_json(server, answer)


def _answer_json(server: str, answer: httpx.Response) -> Any:
    try:
        return answer.json()
    except ValueError:
        raise ApiError(502, f"{server} answered HTTP {answer.status_code} with a body that is not JSON") from None


def _same_field(param: str | None) -> str | None:
    """seed_session's body is the row itself: the environment's field is the row's ("": it named none)."""
    return param or ""


def _row_field(param: str | None) -> str:
    """The row field behind a field of the first model call's body (the row's responses_create_params)."""
    if param is None:
        return ROW_PARAMS_KEY
    if param.split(".")[0].split("[")[0] == PREFIX_KEY:  # `required_prefix_token_ids[9]` too
        return param  # a top-level row field, copied onto the first call
    if param.startswith("messages"):
        return f"{ROW_PARAMS_KEY}.input"  # vLLM names its chat messages; the row's are its input items
    param = "max_output_tokens" if param == "max_tokens" else param
    return f"{ROW_PARAMS_KEY}.{param}"


def _row_field_of_verify(param: str | None) -> str | None:
    """verify's body is the row plus the episode the agent built: a refused `response` is the agent's fault."""
    if param is not None and param.split(".")[0].split("[")[0] == "response":
        return None
    return _same_field(param)


def _offered_tool_names(tools: Any) -> set[str]:
    """Names of the function tools the row offers, or a 400 naming the malformed tool field."""
    where = f"{ROW_PARAMS_KEY}.tools"
    if tools is None:
        return set()
    if not isinstance(tools, list):
        raise ApiError(400, f"{where} must be a list of tool objects, got {type(tools).__name__}", param=where)
    names: set[str] = set()
    for index, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise ApiError(
                400, f"{where}[{index}] must be a tool object, got {type(tool).__name__}", param=f"{where}[{index}]"
            )
        if "function" in tool and "name" not in tool:  # chat-style {"type": "function", "function": {"name": ...}}
            function = tool["function"]
            if not isinstance(function, dict):
                raise ApiError(400, f"{where}[{index}].function must be an object", param=f"{where}[{index}].function")
            name, field = function.get("name"), f"{where}[{index}].function.name"
        else:
            name, field = tool.get("name"), f"{where}[{index}].name"
        if (tool.get("type", "function") == "function" or name is not None) and not isinstance(name, str):
            raise ApiError(400, f"{field}: a function tool needs a name, as a string", param=field)
        if isinstance(name, str):
            names.add(name)
    return names


def _session(request: Request) -> str:
    return request.headers.get(SESSION_HEADER) or uuid.uuid4().hex


def _as_items(value: Any) -> list[dict[str, Any]]:
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if isinstance(value, list) and all(isinstance(item, dict) for item in value):
        return list(value)
    raise ApiError(400, f"{ROW_PARAMS_KEY}.input must be a string or a list of items", param=f"{ROW_PARAMS_KEY}.input")


def _tool_output(call: dict[str, Any], text: str) -> dict[str, Any]:
    return {"type": "function_call_output", "call_id": call.get("call_id"), "output": text}


_TOKEN_FIELDS = frozenset((*BUNDLE_FIELDS, *TELEMETRY_FIELDS))


class _Episode:
    """The episode's items, kept once, and what each party gets of them: the model, the environment, the record.

    Items are stored without their token fields. Each model call's bundle is kept apart, packed as a version 2
    rollout record stores it; only the latest call's bundle is kept whole, because the adapter takes the next
    prompt's prefix from the last bundled item and nothing else reads the earlier ones (resending them made every
    request as large as the whole episode's ids, turn after turn). One exception: a call that starts with a function
    call right after a call that ended on its text (no item between, as when /step continues without a user turn)
    would read as one call to the adapter, so the earlier call keeps its bundle, which closes it (conversion.py).
    """

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []
        """Every item after the input, without bundle or telemetry fields: what environments get."""
        self._packed: dict[int, dict[str, Any]] = {}
        """Item index -> the token fields it came with, its prompt packed (prefix length + suffix) for the record."""
        self._latest: tuple[int, dict[str, Any]] | None = None
        """The latest bundled item's index and its token fields as the model server returned them."""
        self._separators: dict[int, dict[str, Any]] = {}
        """Earlier bundled items whose bundle is still sent: it is all that tells their call from the next (above)."""
        self._packer = PromptPacker()

    def add_call(self, items: list[dict[str, Any]]) -> None:
        """Append one model call's output items."""
        latest = self._latest
        if (
            items
            and latest is not None
            and latest[0] == len(self.items) - 1
            and _is_type(items[0], "function_call")
            and _is_type(self.items[-1], "message")
        ):
            self._separators[latest[0]] = latest[1]
        for item in items:
            self.add(item)

    def add(self, item: dict[str, Any]) -> None:
        """Append an item of the episode (a model output item, a tool result, a user turn)."""
        token_fields = {k: v for k, v in item.items() if k in _TOKEN_FIELDS} if isinstance(item, dict) else {}
        if token_fields:
            item = {k: v for k, v in item.items() if k not in _TOKEN_FIELDS}
        index = len(self.items)
        self.items.append(item)
        if not token_fields:
            return
        if token_fields.get("prompt_token_ids") is not None:
            self._packed[index] = self._packer.pack(token_fields)
            self._latest = (index, token_fields)
        else:
            self._packed[index] = token_fields  # telemetry without a bundle: recorded as it came

    def for_model(self, send_bundle: bool) -> list[dict[str, Any]]:
        """The history for the next model call: the items, the latest call's bundle back on its item (if sent)."""
        if not send_bundle or self._latest is None:
            return list(self.items)
        history = list(self.items)
        for index, token_fields in [*self._separators.items(), self._latest]:
            history[index] = {**history[index], **token_fields}
        return history

    def recorded(self) -> list[dict[str, Any]]:
        """The items as the rollout record (schema_version 2) holds them: each call's packed bundle on its item."""
        return [{**item, **self._packed[i]} if i in self._packed else item for i, item in enumerate(self.items)]


def _is_type(item: Any, kind: str) -> bool:
    return isinstance(item, dict) and item.get("type", "message") == kind


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
