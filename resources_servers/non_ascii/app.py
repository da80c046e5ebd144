"""non_ascii: the model writes a few short answers, each answered by the environment as the user; the reward is the
share of their characters beyond ASCII (a per-token signal that a tiny model can learn, see README.md)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from pydantic import Field

from nemo_gym_tok.servers.api_errors import ApiError
from nemo_gym_tok.servers.base import BaseServerConfig, ResourcesServer
from nemo_gym_tok.servers.client import ServerClient
from nemo_gym_tok.servers.episode_store import EpisodeStore
from nemo_gym_tok.servers.step_items import last_assistant_text, step_output

REPLY = "{percent}% beyond ASCII. Another line."
LAST_REPLY = "{percent}% beyond ASCII. Done."


class NonAsciiConfig(BaseServerConfig):
    turns: int = Field(3, ge=1)
    """Answers per episode: the model answers the row's opening message and turns - 1 replies."""


@dataclass
class Writing:
    counts: list[tuple[int, int]] = field(default_factory=list)
    """Per judged answer: (characters beyond ASCII, non-whitespace characters)."""
    over: bool = False


def character_counts(text: str) -> tuple[int, int]:
    """(non-whitespace characters beyond ASCII, non-whitespace characters) of `text`."""
    characters = [char for char in text if not char.isspace()]
    return sum(1 for char in characters if ord(char) > 127), len(characters)


def share(beyond: int, characters: int) -> float:
    """The reward's ratio; 0.0 for an answer without characters (nothing written, nothing earned)."""
    return beyond / characters if characters else 0.0


class NonAscii(ResourcesServer):
    config_class: ClassVar[type[BaseServerConfig]] = NonAsciiConfig
    config: NonAsciiConfig

    def __init__(self, name: str, config: BaseServerConfig, servers: ServerClient | None = None) -> None:
        super().__init__(name, config, servers)
        self.writings: EpisodeStore[Writing] = EpisodeStore()

    async def seed_session(self, session_id: str, row: dict[str, Any]) -> dict[str, Any]:
        # Seeding a session id again restarts its episode, so a retried seed is harmless.
        self.writings.start(session_id, Writing())
        return {}

    async def step(self, session_id: str, body: dict[str, Any]) -> dict[str, Any]:
        writing = self.writings.get(session_id)
        if writing.over:
            raise ApiError(400, f"the episode of session {session_id!r} is over; call /verify")
        output = step_output(body)
        counts = character_counts(last_assistant_text(output))
        writing.counts.append(counts)
        writing.over = len(writing.counts) >= self.config.turns
        percent = round(100 * share(*counts))
        if writing.over:
            return {"done": True, "user_message": LAST_REPLY.format(percent=percent)}  # the last word
        return {"done": False, "user_message": REPLY.format(percent=percent)}

    async def verify(self, session_id: str, body: dict[str, Any]) -> dict[str, Any]:
        # The answers /step judged are the truth: they are what the user turns answered.
        writing = self.writings.end(session_id)
        beyond = sum(b for b, _ in writing.counts)
        characters = sum(c for _, c in writing.counts)
        return {
            "reward": share(beyond, characters),
            "shares": [share(*counts) for counts in writing.counts],
            "characters": characters,
        }


SERVER = NonAscii
