"""The rows of an environment as GRPOTrainer's prompts, and each prompt back to its row (TRL hands a rollout_func
only the prompts)."""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from typing import Any

ROW_PARAMS_KEY = "responses_create_params"


def prompt_of(row: dict[str, Any]) -> list[dict[str, Any]]:
    """The row's first messages (`responses_create_params.input`) as a conversational prompt (a string input is one
    user message)."""
    params = row.get(ROW_PARAMS_KEY)
    if not isinstance(params, dict) or "input" not in params:
        raise ValueError(f"a row needs {ROW_PARAMS_KEY} with an `input` (the episode's first messages)")
    messages = params["input"]
    if isinstance(messages, str):
        return [{"role": "user", "content": messages}]
    if not isinstance(messages, list) or not all(isinstance(message, dict) for message in messages):
        raise ValueError(f"{ROW_PARAMS_KEY}.input must be a string or a list of message objects")
    return messages


def prompt_key(prompt: Any) -> str:
    """One string per prompt, however a dataset hands it back (keys in any order; a key a dataset filled with null
    because another message has it is left out)."""
    if isinstance(prompt, str):
        prompt = [{"role": "user", "content": prompt}]
    cleaned = [{k: v for k, v in message.items() if v is not None} for message in prompt]
    return json.dumps(cleaned, sort_keys=True, ensure_ascii=False, separators=(",", ":"))


class PromptRows:
    """The rows of one data set, found again by their prompt."""

    def __init__(self, rows: Sequence[dict[str, Any]]) -> None:
        if not rows:
            raise ValueError("no rows: give at least one")
        self.rows = list(rows)
        self._by_prompt: dict[str, dict[str, Any]] = {}
        for index, row in enumerate(self.rows):
            key = prompt_key(prompt_of(row))
            if key in self._by_prompt and self._by_prompt[key] != row:
                raise ValueError(
                    f"row {index} has the prompt of an earlier row with other fields: a rollout_func is handed only "
                    "the prompt, so it could not tell them apart"
                )
            self._by_prompt[key] = row

    def prompts(self) -> list[list[dict[str, Any]]]:
        """One conversational prompt per row, in order: the `prompt` column of the trainer's data set."""
        return [prompt_of(row) for row in self.rows]

    def row_for(self, prompt: Any) -> dict[str, Any]:
        """The row a prompt came from; KeyError for a prompt of no row."""
        try:
            return self._by_prompt[prompt_key(prompt)]
        except KeyError:
            raise KeyError(f"no row has the prompt {prompt_key(prompt)[:200]}") from None

    def schedule(self, steps: int, prompts_per_step: int, num_generations: int, seed: int = 0) -> list[list[Any]]:
        """The rows each step trains on, fixed before training starts so collection can run ahead of the trainer:
        step N's `prompts_per_step` rows, each repeated `num_generations` times in a row (as TRL hands them to a
        rollout_func), the rows walked in a seeded shuffle, one shuffle per pass over them."""
        if min(steps, prompts_per_step, num_generations) < 1:
            raise ValueError("steps, prompts_per_step and num_generations must be >= 1")
        order: list[dict[str, Any]] = []
        shuffler = random.Random(seed)
        while len(order) < steps * prompts_per_step:
            passing = list(self.rows)
            shuffler.shuffle(passing)
            order += passing
        return [
            [
                row
                for row in order[step * prompts_per_step : (step + 1) * prompts_per_step]
                for _ in range(num_generations)
            ]
            for step in range(steps)
        ]
