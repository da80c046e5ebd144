"""The reward function handed to GRPOTrainer: the environment's verdict, carried by the rollout_func's extra key."""

from __future__ import annotations

from typing import Any

REWARD_KEY = "gym_reward"
"""The rollout_func's extra key holding each episode's reward from the environment's /verify."""


def gym_reward(prompts: list[Any], completions: list[Any], **kwargs: Any) -> list[float]:
    """One reward per completion: the environment's, as the rollout collected it (TRL passes extra keys as keyword
    arguments). Raises KeyError when the rollout_func did not collect through the gym."""
    if REWARD_KEY not in kwargs:
        raise KeyError(f"no {REWARD_KEY!r} among the reward function's arguments: use nemo_gym_tok.train's rollout")
    rewards = [float(reward) for reward in kwargs[REWARD_KEY]]
    if len(rewards) != len(completions):
        raise ValueError(f"{len(rewards)} rewards for {len(completions)} completions")
    return rewards
