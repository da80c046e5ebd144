"""capital_lookup: one `lookup_capital` tool; the reward checks that the final answer names the expected capital."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, ClassVar

from pydantic import Field

from nemo_gym_tok.servers.api_errors import ApiError
from nemo_gym_tok.servers.base import BaseServerConfig, ResourcesServer, ToolHandler
from nemo_gym_tok.servers.client import ServerClient
from nemo_gym_tok.servers.episode_store import EpisodeStore
from nemo_gym_tok.servers.openapi import JsonSchema, SeedSessionRequest

CAPITALS: dict[str, str] = {
    "France": "Paris",
    "Germany": "Berlin",
    "Italy": "Rome",
    "Spain": "Madrid",
    "Japan": "Tokyo",
    "Canada": "Ottawa",
    "Australia": "Canberra",
    "Egypt": "Cairo",
    "Kenya": "Nairobi",
    "Peru": "Lima",
}

LOOKUP_CAPITAL_TOOL: dict[str, Any] = {
    "type": "function",
    "name": "lookup_capital",
    "description": "Look up the capital city of a country.",
    "parameters": {
        "type": "object",
        "properties": {"country": {"type": "string", "enum": list(CAPITALS), "description": "The country."}},
        "required": ["country"],
        "additionalProperties": False,
    },
    "strict": True,
}
"""The tool as rows offer it to the model; data/example.jsonl repeats it and a test keeps the two equal."""


class CapitalLookupConfig(BaseServerConfig):
    require_tool_call: bool = False
    """Reward only episodes that called lookup_capital at least once (rewards tool use, not recall)."""


class CapitalLookupRow(SeedSessionRequest):
    """The row fields /seed_session reads (for the OpenAPI document; the handler checks them itself)."""

    expected_answer: str = Field(min_length=1, pattern=r"\S", description="the capital the answer must name")


@dataclass
class Episode:
    expected_answer: str
    tool_calls: int = 0


class CapitalLookup(ResourcesServer):
    config_class: ClassVar[type[BaseServerConfig]] = CapitalLookupConfig
    config: CapitalLookupConfig
    row_model = CapitalLookupRow

    def __init__(self, name: str, config: BaseServerConfig, servers: ServerClient | None = None) -> None:
        super().__init__(name, config, servers)
        self.episodes: EpisodeStore[Episode] = EpisodeStore()

    async def seed_session(self, session_id: str, row: dict[str, Any]) -> dict[str, Any]:
        expected = row.get("expected_answer")
        if not isinstance(expected, str) or not expected.strip():
            raise ApiError(400, "the row needs expected_answer: the capital to name", param="expected_answer")
        # Seeding a session id again restarts its episode, so a retried seed is harmless.
        self.episodes.start(session_id, Episode(expected.strip()))
        return {}

    def tools(self) -> dict[str, ToolHandler]:
        return {"lookup_capital": self.lookup_capital}

    def tool_schemas(self) -> dict[str, JsonSchema]:
        return {"lookup_capital": LOOKUP_CAPITAL_TOOL["parameters"]}

    async def lookup_capital(self, session_id: str, arguments: dict[str, Any]) -> str:
        episode = self.episodes.get(session_id)
        episode.tool_calls += 1  # wrong calls count too: the record says how often the model reached for the tool
        extra = sorted(set(arguments) - {"country"})
        if extra:
            return f"error: lookup_capital takes only `country`, not {', '.join(extra)}"
        country = arguments.get("country")
        if not isinstance(country, str) or country not in CAPITALS:
            got = "no country" if country is None else f"unknown country {json.dumps(country)}"
            return f"error: {got}; country must be one of: {', '.join(CAPITALS)}"
        return f"The capital of {country} is {CAPITALS[country]}."

    async def verify(self, session_id: str, body: dict[str, Any]) -> dict[str, Any]:
        answer = _final_answer(_output_items(body))  # parsed first, so a malformed body can be sent again
        episode = self.episodes.end(session_id)
        # Whole words only: "Rome" must not be credited inside "Romero".
        named = re.search(rf"(?<!\w){re.escape(episode.expected_answer)}(?!\w)", answer, re.IGNORECASE) is not None
        used_tool = episode.tool_calls > 0 or not self.config.require_tool_call
        answered = bool(answer.strip())
        return {"reward": 1.0 if named and used_tool else 0.0, "answered": answered, "tool_calls": episode.tool_calls}


def _output_items(body: dict[str, Any]) -> list[Any]:
    response = body.get("response")
    output = response.get("output") if isinstance(response, dict) else None
    if not isinstance(output, list):
        raise ApiError(400, "verify needs response.output: the list of the episode's items", param="response.output")
    return output


def _final_answer(items: list[Any]) -> str:
    """Text of the last assistant message; empty when the model never answered in words."""
    for item in reversed(items):
        if isinstance(item, dict) and item.get("type", "message") == "message" and item.get("role") == "assistant":
            content = item.get("content")
            if isinstance(content, list):  # parts: {"type": "output_text", "text": ...}
                return "".join(p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
            return content if isinstance(content, str) else ""
    return ""


SERVER = CapitalLookup
