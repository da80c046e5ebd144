"""grid_navigation: move/look/pick_up tools on a small walled grid; the reward comes from where the walker ended."""

from __future__ import annotations

import json
from typing import Any, ClassVar

from pydantic import Field, ValidationError

from nemo_gym_tok.servers.api_errors import ApiError, validation_message
from nemo_gym_tok.servers.base import BaseServerConfig, ResourcesServer, ToolHandler
from nemo_gym_tok.servers.client import ServerClient
from nemo_gym_tok.servers.episode_store import EpisodeStore
from nemo_gym_tok.servers.openapi import JsonSchema, SeedSessionRequest
from resources_servers.grid_navigation.picture import grid_picture_url
from resources_servers.grid_navigation.world import DIRECTIONS, Grid, Walker


def _tool(name: str, description: str, properties: dict[str, Any]) -> dict[str, Any]:
    # Enums only, all required: even a random model can only send choices it was given.
    parameters = {"type": "object", "properties": properties, "required": list(properties)}
    parameters["additionalProperties"] = False
    return {"type": "function", "name": name, "description": description, "parameters": parameters, "strict": True}


TOOLS: dict[str, dict[str, Any]] = {
    tool["name"]: tool
    for tool in (
        _tool(
            "move",
            "Walk up to `steps` cells in one direction; walls and the grid edge stop you.",
            {
                "direction": {"type": "string", "enum": list(DIRECTIONS)},
                "steps": {"type": "integer", "enum": [1, 2, 3]},
            },
        ),
        _tool("look", "Your position, the goal, blocked directions, items on the grid and what you hold.", {}),
        _tool("pick_up", "Pick up an item lying on your cell.", {"item": {"type": "string", "enum": ["key", "coin"]}}),
    )
}
"""The tools as rows offer them to the model; data/example.jsonl repeats them and a test keeps them equal."""


class GridNavigationConfig(BaseServerConfig):
    partial_credit: float = Field(0.5, ge=0.0, le=1.0)
    """Most reward an episode that misses the goal can earn; it shrinks with the distance left to the goal."""
    look_shows_picture: bool = False
    """`look` answers its text and a picture of the grid (Responses content parts: input_text, input_image), for a
    vision model; off, its text alone."""


class GridNavigationRow(SeedSessionRequest):
    """The row field /seed_session reads (for the OpenAPI document; the handler validates it as a Grid itself)."""

    grid: Grid


class GridNavigation(ResourcesServer):
    config_class: ClassVar[type[BaseServerConfig]] = GridNavigationConfig
    config: GridNavigationConfig
    row_model = GridNavigationRow

    def __init__(self, name: str, config: BaseServerConfig, servers: ServerClient | None = None) -> None:
        super().__init__(name, config, servers)
        self.walkers: EpisodeStore[Walker] = EpisodeStore()

    async def seed_session(self, session_id: str, row: dict[str, Any]) -> dict[str, Any]:
        try:
            grid = Grid.model_validate(row.get("grid"))
        except ValidationError as exc:
            message, param = validation_message(list(exc.errors()), skip=())
            raise ApiError(400, f"the row's grid is invalid: {message}", param=f"grid.{param}" if param else "grid")
        # Seeding a session id again restarts its episode, so a retried seed is harmless.
        self.walkers.start(session_id, Walker(grid, grid.start, dict(grid.items)))
        return {}

    def tools(self) -> dict[str, ToolHandler]:
        return {name: self._tool(name) for name in TOOLS}

    def tool_schemas(self) -> dict[str, JsonSchema]:
        return {name: tool["parameters"] for name, tool in TOOLS.items()}

    def _tool(self, name: str) -> ToolHandler:
        async def handler(session_id: str, arguments: dict[str, Any]) -> str | list[dict[str, Any]]:
            walker = self.walkers.get(session_id)  # an unknown session is the caller's mistake: HTTP 400
            # Wrong arguments are the model's mistake: it reads what was wrong and may try again.
            problem = _argument_problem(TOOLS[name], arguments)
            if problem:
                return problem
            text = getattr(walker, name)(**arguments)
            if name != "look" or not self.config.look_shows_picture:
                return text
            picture = {"type": "input_image", "image_url": grid_picture_url(walker)}
            return [{"type": "input_text", "text": text}, picture]

        return handler

    async def verify(self, session_id: str, body: dict[str, Any]) -> dict[str, Any]:
        # The walker's state is the truth; the transcript in `body` adds nothing the tools did not see.
        walker = self.walkers.end(session_id)
        at_goal = walker.distance_to_goal() == 0
        span = 2 * (walker.grid.size - 1)  # the longest Manhattan distance on the grid
        partial = max(0.0, 1.0 - walker.distance_to_goal() / span) * self.config.partial_credit
        succeeded = at_goal and (not walker.grid.requires_key or "key" in walker.held)
        return {
            "reward": 1.0 if succeeded else partial,
            "final_position": list(walker.position),
            "reached_goal": at_goal,
            "moves": walker.moves,
            "holding": walker.held,
        }


def _argument_problem(tool: dict[str, Any], arguments: dict[str, Any]) -> str | None:
    """What is wrong with the model's arguments, told so the model can correct itself; None when they are fine."""
    name, properties = tool["name"], tool["parameters"]["properties"]
    if extra := sorted(set(arguments) - set(properties)):
        takes = ", ".join(properties) or "no arguments"
        return f"error: {name} has no argument {', '.join(extra)}; it takes {takes}"
    for key, spec in properties.items():
        choices = ", ".join(json.dumps(option) for option in spec["enum"])
        if key not in arguments:
            return f"error: {name} needs {key}, one of {choices}"
        # Compare types too: JSON true == 1 and 2.0 == 2 in Python, but neither is a valid choice.
        if not any(arguments[key] == option and type(arguments[key]) is type(option) for option in spec["enum"]):
            return f"error: {key} must be one of {choices}, got {json.dumps(arguments[key])}"
    return None


SERVER = GridNavigation
