"""number_guess: the model guesses a secret number from 1 to 100 and the environment answers as the user."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, ClassVar

from pydantic import Field

from nemo_gym_tok.servers.api_errors import ApiError
from nemo_gym_tok.servers.base import BaseServerConfig, ResourcesServer
from nemo_gym_tok.servers.client import ServerClient
from nemo_gym_tok.servers.episode_store import EpisodeStore
from nemo_gym_tok.servers.openapi import SeedSessionRequest
from nemo_gym_tok.servers.step_items import last_assistant_text, step_output

LOWEST, HIGHEST = 1, 100
NO_NUMBER = f"I could not find a number in your answer; guess a number from {LOWEST} to {HIGHEST}."
INTEGER = re.compile(r"-?[0-9]+")
FAR_AWAY = 10**18
"""Guesses beyond this are recorded as ±FAR_AWAY: int() refuses thousands of digits, and the answer is the same."""


class NumberGuessConfig(BaseServerConfig):
    max_rounds: int = Field(4, ge=1)
    """Most guesses per episode: the model answers the row's opening message and up to max_rounds - 1 replies."""


class NumberGuessRow(SeedSessionRequest):
    """The row field /seed_session reads (for the OpenAPI document; the handler checks it itself)."""

    secret: int = Field(ge=LOWEST, le=HIGHEST, description="the number to guess")


@dataclass
class Game:
    secret: int
    guesses: list[int | None] = field(default_factory=list)
    """One entry per model answer judged by /step; None when the answer held no number."""
    solved: bool = False
    over: bool = False


class NumberGuess(ResourcesServer):
    config_class: ClassVar[type[BaseServerConfig]] = NumberGuessConfig
    config: NumberGuessConfig
    row_model = NumberGuessRow

    def __init__(self, name: str, config: BaseServerConfig, servers: ServerClient | None = None) -> None:
        super().__init__(name, config, servers)
        self.games: EpisodeStore[Game] = EpisodeStore()

    async def seed_session(self, session_id: str, row: dict[str, Any]) -> dict[str, Any]:
        secret = row.get("secret")
        # bool is an int in Python, but `true` is not a secret number.
        if type(secret) is not int or not LOWEST <= secret <= HIGHEST:
            raise ApiError(400, f"the row needs secret: an integer from {LOWEST} to {HIGHEST}", param="secret")
        # Seeding a session id again restarts its game, so a retried seed is harmless.
        self.games.start(session_id, Game(secret))
        return {}

    async def step(self, session_id: str, body: dict[str, Any]) -> dict[str, Any]:
        game = self.games.get(session_id)
        if game.over:
            raise ApiError(400, f"the game of session {session_id!r} is over; call /verify")
        output = step_output(body)
        guess = _first_integer(last_assistant_text(output))
        game.guesses.append(guess)
        game.solved = guess == game.secret
        if guess is None:
            reply = NO_NUMBER
        else:
            reply = "Correct!" if game.solved else "Higher." if guess < game.secret else "Lower."
        # Every answer gets a reply, whatever it says, so even a model that never names a number plays max_rounds.
        game.over = game.solved or len(game.guesses) >= self.config.max_rounds
        if game.over:
            return {"done": True, "user_message": reply}  # the last word: recorded, no model turn follows
        return {"done": False, "user_message": reply}

    async def verify(self, session_id: str, body: dict[str, Any]) -> dict[str, Any]:
        # The guesses /step judged are the truth: they are what the user turns answered.
        game = self.games.end(session_id)
        # The row's fields (secret included) are in the rollout record already; only what the game adds goes here.
        return {"reward": 1.0 if game.solved else 0.0, "guesses": game.guesses, "rounds": len(game.guesses)}


def _first_integer(text: str) -> int | None:
    match = INTEGER.search(text)
    if match is None:
        return None
    digits = match.group()
    if len(digits.lstrip("-")) > 18:
        return -FAR_AWAY if digits.startswith("-") else FAR_AWAY
    return int(digits)


SERVER = NumberGuess
