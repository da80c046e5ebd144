"""The fleet tests' collection: number_guess rollouts through a running gym's agent, with `ngt collect`'s loop."""

from __future__ import annotations

import asyncio
from pathlib import Path

from nemo_gym_tok.collect import CollectSummary, collect
from nemo_gym_tok.servers.launcher import Gym

ROWS = Path(__file__).resolve().parents[2] / "resources_servers" / "number_guess" / "data" / "example.jsonl"


def collect_number_guess(gym: Gym, output: Path, repeats: int, *, concurrency: int, timeout: float) -> CollectSummary:
    """Each row of number_guess's example data `repeats` times into `output`."""
    return asyncio.run(
        collect(
            ROWS,
            output,
            gym.urls["number_guess_agent"],
            agent="number_guess_agent",
            repeats=repeats,
            concurrency=concurrency,
            timeout=timeout,
            progress=False,
            auth_token=gym.auth_token,
        )
    )
