"""Base classes of the three server kinds: each builds a FastAPI app from a validated Pydantic config."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import ClassVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict

from nemo_gym_tok.servers.client import ServerClient
from nemo_gym_tok.servers.errors import ApiError, api_error_handler, error_response, validation_message


class BaseServerConfig(BaseModel):
    """Fields every server accepts; implementations subclass this with their own fields."""

    model_config = ConfigDict(extra="forbid")

    host: str = "127.0.0.1"
    port: int = 0
    """0 lets `ngt run` pick a free port."""


class BaseServer:
    """A gym server: owns its config, a client to reach other servers by name, and its FastAPI app."""

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

        @app.get("/health")
        async def health() -> dict[str, str]:
            return {"status": "ok", "name": self.name}

        self.setup_routes(app)
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
    """An environment: `/seed_session`, `/verify`, and one `POST /<tool>` endpoint per tool."""

    kind = "resources_servers"


class Agent(BaseServer):
    """An agent: `/run` plays one rollout; `/v1/responses` answers one model turn of the agent."""

    kind = "responses_api_agents"


async def _validation_error_as_400(request: Request, exc: RequestValidationError) -> JSONResponse:
    # A client's malformed body is a 400 naming the field, in OpenAI's error shape, not FastAPI's 422 list.
    message, param = validation_message(list(exc.errors()))
    return error_response(400, message, param)
