"""The head server: the one place that knows every server's URL (`GET /servers`) and its routers' (`GET /routers`)."""

from __future__ import annotations

from typing import ClassVar

from fastapi import FastAPI

from nemo_gym_tok.servers.base import BaseServer, BaseServerConfig


class HeadServerConfig(BaseServerConfig):
    servers: dict[str, str] = {}
    """instance name -> base URL of every server `ngt run` started."""
    routers: dict[str, str] = {}
    """model instance name -> URL of the vllm-router `ngt run` started in front of its workers (`ngt push-weights -c`
    asks it for the live worker list)."""


class HeadServer(BaseServer):
    config_class: ClassVar[type[BaseServerConfig]] = HeadServerConfig
    kind = "head"

    def setup_routes(self, app: FastAPI) -> None:
        servers = dict(self.config.servers)  # type: ignore[attr-defined]
        routers = dict(self.config.routers)  # type: ignore[attr-defined]

        @app.get("/servers")
        async def list_servers() -> dict[str, str]:
            return servers

        @app.get("/routers")
        async def list_routers() -> dict[str, str]:
            return routers


SERVER = HeadServer
