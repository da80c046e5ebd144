"""The head server: the one place that knows every server's URL (`GET /servers`)."""

from __future__ import annotations

from typing import ClassVar

from fastapi import FastAPI

from nemo_gym_tok.servers.base import BaseServer, BaseServerConfig


class HeadServerConfig(BaseServerConfig):
    servers: dict[str, str] = {}
    """instance name -> base URL of every server `ngt run` started."""


class HeadServer(BaseServer):
    config_class: ClassVar[type[BaseServerConfig]] = HeadServerConfig
    kind = "head"

    def setup_routes(self, app: FastAPI) -> None:
        servers = dict(self.config.servers)  # type: ignore[attr-defined]

        @app.get("/servers")
        async def list_servers() -> dict[str, str]:
            return servers


SERVER = HeadServer
