"""Base classes of the three server kinds: each builds a FastAPI app from a validated Pydantic config."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, ClassVar

import httpx
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from nemo_gym_tok.servers.api_errors import (
    ApiError,
    UnexpectedErrorMiddleware,
    api_error_handler,
    error_response,
    http_error_handler,
    validation_message,
)
from nemo_gym_tok.servers.auth import BearerTokenMiddleware
from nemo_gym_tok.servers.bodies import DEFAULT_MAX_BODY_BYTES, MAX_BODY_STATE_KEY, json_object
from nemo_gym_tok.servers.client import SESSION_HEADER, ServerClient
from nemo_gym_tok.servers.http_pool import (
    DEFAULT_CONNECT_TIMEOUT_SECONDS,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_REQUEST_TIMEOUT_SECONDS,
    call_timeout,
    pool_limits,
)
from nemo_gym_tok.servers.openapi import (
    ANY_OBJECT,
    JsonSchema,
    SeedSessionRequest,
    StepRequest,
    VerifyRequest,
    install_components,
    json_body,
)


class BaseServerConfig(BaseModel):
    """Fields every server accepts; implementations subclass this with their own fields."""

    model_config = ConfigDict(extra="forbid")

    host: str = "127.0.0.1"
    port: int = 0
    """0 lets `ngt run` pick a free port."""
    max_body_bytes: int = Field(DEFAULT_MAX_BODY_BYTES, gt=0)
    """Largest request body the server reads (64 MiB by default); a larger one is refused with 413."""
    max_connections: int = Field(DEFAULT_MAX_CONNECTIONS, gt=0)
    """Connections the server's HTTP client holds open at most (to the other gym servers; the adapter's to vLLM too):
    the most calls it has in flight at once. Keep it at least `ngt collect --concurrency` (http_pool)."""
    max_keepalive_connections: int | None = Field(None, ge=0)
    """Idle connections kept open for the next call; unset, as many as max_connections."""
    connect_timeout_seconds: float = Field(DEFAULT_CONNECT_TIMEOUT_SECONDS, gt=0)
    """Longest wait to open a connection to another server (or vLLM): a host that does not answer is down."""
    request_timeout_seconds: float = Field(DEFAULT_REQUEST_TIMEOUT_SECONDS, gt=0)
    """Longest wait for the answer to one call to another server (or, in the adapter, one vLLM call)."""

    def http_limits(self) -> httpx.Limits:
        """The connection pool of this server's HTTP clients."""
        return pool_limits(self.max_connections, self.max_keepalive_connections)

    def http_timeout(self) -> httpx.Timeout:
        """The timeouts of this server's HTTP clients."""
        return call_timeout(self.request_timeout_seconds, self.connect_timeout_seconds)


class BaseServer:
    """A gym server: owns its config, a client to reach other servers by name, and its FastAPI app.

    With the gym's auth token on the client (`ServerClient(auth_token=...)`, which `ngt run` sets from the config's
    `auth_token`), every route but `/health` answers 401 without `Authorization: Bearer <token>`.
    """

    config_class: ClassVar[type[BaseServerConfig]] = BaseServerConfig
    kind: ClassVar[str] = ""

    def __init__(self, name: str, config: BaseServerConfig, servers: ServerClient | None = None) -> None:
        self.name = name
        self.config = config
        self.servers = servers or ServerClient({})

    def build_app(self) -> FastAPI:
        @asynccontextmanager
        async def lifespan(_: FastAPI) -> AsyncIterator[None]:
            yield
            await self.aclose()

        app = FastAPI(title=f"{self.name} ({type(self).__name__})", lifespan=lifespan)
        app.add_exception_handler(RequestValidationError, _validation_error_as_400)
        app.add_exception_handler(ApiError, api_error_handler)
        app.add_exception_handler(StarletteHTTPException, http_error_handler)
        app.add_middleware(UnexpectedErrorMiddleware, server_name=self.name)
        if self.servers.auth_token:  # added last, so outermost: checked before anything else runs
            app.add_middleware(BearerTokenMiddleware, token=self.servers.auth_token)
        setattr(app.state, MAX_BODY_STATE_KEY, self.config.max_body_bytes)

        @app.get("/health")
        async def health() -> dict[str, str]:
            return {"status": "ok", "name": self.name}

        self.setup_routes(app)
        install_components(app)
        return app

    def setup_routes(self, app: FastAPI) -> None:
        """Add this server's endpoints to `app`."""

    async def aclose(self) -> None:
        """Release what the server holds (HTTP clients); subclasses extend this."""
        await self.servers.aclose()


class ModelServer(BaseServer):
    """An OpenAI-compatible model server: `/v1/responses` and `/v1/chat/completions`."""

    kind = "responses_api_models"


class ResourcesServer(BaseServer):
    """An environment: `/seed_session`, `/step`, `/verify`, and one `POST /<tool>` endpoint per tool.

    Every call names its episode with the `x-session-id` header (the agent sends one per rollout). Subclasses
    override the coroutines below and return JSON-able dicts; raise ApiError(400, ...) for a caller's mistake.
    A tool receives the model's arguments (already parsed from JSON) and returns what the model should read.
    """

    kind = "resources_servers"
    row_model: ClassVar[type[BaseModel]] = SeedSessionRequest
    """The input row as `/seed_session` takes it, for the OpenAPI document; subclasses name the fields they need."""

    def setup_routes(self, app: FastAPI) -> None:
        @app.post("/seed_session", openapi_extra=json_body(self.row_model, session="required"))
        async def seed_session(request: Request) -> Any:
            return await self.seed_session(_session_of(request), await json_object(request))

        @app.post("/step", openapi_extra=json_body(StepRequest, session="required"))
        async def step(request: Request) -> Any:
            return await self.step(_session_of(request), await json_object(request))

        @app.post("/verify", openapi_extra=json_body(VerifyRequest, session="required"))
        async def verify(request: Request) -> Any:
            session, body = _session_of(request), await json_object(request)
            response = body.get("response")
            if not isinstance(response, dict) or not isinstance(response.get("output"), list):
                raise ApiError(
                    400, "verify needs response.output: the list of the episode's items", param="response.output"
                )
            result = await self.verify(session, body)
            reward = result.get("reward") if isinstance(result, dict) else None
            if isinstance(reward, bool) or not isinstance(reward, (int, float)):
                raise ApiError(500, f"{type(self).__name__}.verify must return a dict with a numeric reward")
            return result

        tools = self.tools()
        declared = {"tools": sorted(tools)}

        @app.get("/tools")
        async def declared_tools() -> dict[str, list[str]]:
            # The agent sends a model's function call only to a name listed here, so a row that offers a tool
            # called "seed_session" or "verify" never reaches those endpoints.
            return declared

        schemas = self.tool_schemas()
        for tool_name, tool in tools.items():
            if tool_name in RESERVED_PATHS:
                raise ValueError(
                    f"{type(self).__name__}: a tool cannot be named {tool_name!r} (an endpoint of its own)"
                )
            schema = schemas.get(tool_name, ANY_OBJECT)
            arguments = json_body(schema, session="required", description="the tool's arguments")
            app.add_api_route(
                f"/{tool_name}",
                _tool_endpoint(tool),
                methods=["POST"],
                name=tool_name,
                openapi_extra=arguments,
            )

    async def seed_session(self, session_id: str, row: dict[str, Any]) -> dict[str, Any]:
        """Start the episode `session_id` for one input row; the default keeps no state."""
        return {}

    async def step(self, session_id: str, body: dict[str, Any]) -> dict[str, Any]:
        """After a model turn without tool calls: `{"done": false, "user_message": "..."}` continues the episode
        with a user turn, `{"done": true}` ends it (a `user_message` with it is recorded as the last word, and no
        model call follows). `body` has `output`: the episode's items so far."""
        return {"done": True}

    async def verify(self, session_id: str, body: dict[str, Any]) -> dict[str, Any]:
        """The reward of the finished episode: `{"reward": float, ...extra fields for the rollout record}`.
        `body` is the input row plus `response` (the episode's Responses object)."""
        raise NotImplementedError

    def tools(self) -> dict[str, ToolHandler]:
        """Tool name -> coroutine(session_id, arguments) returning the tool's output (str or JSON-able)."""
        return {}

    def tool_schemas(self) -> dict[str, JsonSchema]:
        """Tool name -> JSON schema of its arguments (what rows offer the model), for the OpenAPI document; a tool
        left out is documented as taking any JSON object."""
        return {}


RESERVED_PATHS = frozenset({"seed_session", "step", "verify", "tools", "health", "docs", "openapi.json", "redoc"})
ToolHandler = Callable[[str, dict[str, Any]], Awaitable[Any]]


def _tool_endpoint(tool: ToolHandler) -> Callable[[Request], Awaitable[Any]]:
    async def endpoint(request: Request) -> Any:
        return {"output": await tool(_session_of(request), await json_object(request))}

    return endpoint


def _session_of(request: Request) -> str:
    session = request.headers.get(SESSION_HEADER)
    if not session:
        raise ApiError(400, f"missing the {SESSION_HEADER} header that names the episode")
    return session


class Agent(BaseServer):
    """An agent: `/run` plays one rollout; `/v1/responses` answers one model turn of the agent."""

    kind = "responses_api_agents"


async def _validation_error_as_400(request: Request, exc: RequestValidationError) -> JSONResponse:
    # A client's malformed body is a 400 naming the field, in OpenAI's error shape, not FastAPI's 422 list.
    message, param = validation_message(list(exc.errors()))
    return error_response(400, message, param)
