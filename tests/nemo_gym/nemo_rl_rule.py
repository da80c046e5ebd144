"""NeMo RL's contiguity rule over a NeMo Gym rollout, re-expressed (not copied) from how NeMo RL reads Gym results.

NeMo RL walks `response.output` in order and looks only at items that carry `generation_token_ids` (non-empty):
everything it has seen so far (each earlier item's `prompt_token_ids`, then its `generation_token_ids`) must be
exactly the start of this item's `prompt_token_ids`; the new part of the prompt becomes a non-trained segment and
the generation a trained one. A rollout that breaks this is refused by NeMo RL ("Non-contiguous messages found").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class RuleResult:
    """What the rule found in one rollout: model calls it read, and the first break (None when contiguous)."""

    model_calls: int
    first_break: str | None

    @property
    def contiguous(self) -> bool:
        return self.first_break is None


def check_rollout(result: dict[str, Any]) -> RuleResult:
    """Apply the rule to one `/run` answer of NeMo Gym's agent (its `response.output` items)."""
    seen: list[int] = []
    calls = 0
    for position, item in enumerate(result["response"]["output"]):
        generation = item.get("generation_token_ids")
        if not generation:
            continue
        prompt = item["prompt_token_ids"]
        if prompt[: len(seen)] != seen:
            at = next((i for i, (a, b) in enumerate(zip(seen, prompt)) if a != b), min(len(seen), len(prompt)))
            return RuleResult(
                calls,
                f"output[{position}]: prompt differs from the ids seen before at position {at} "
                f"(seen {len(seen)} ids, prompt has {len(prompt)})",
            )
        seen = list(prompt) + list(generation)
        calls += 1
    return RuleResult(calls, None)


@dataclass
class Collection:
    """The rule over a whole collection of `/run` answers, and the figures both NeMo Gym tests print."""

    checks: list[RuleResult]
    broken: list[str]
    """The first break of every rollout that is not contiguous."""
    long_rollouts: int
    """Rollouts of 3 or more model calls."""
    model_calls: int
    cut: int
    """Rollouts whose last answer was incomplete (cut by max_tokens)."""
    rewards: float


def check_collection(results: list[Any]) -> Collection:
    """Every `/run` answered 200 (asserted), then the rule over each rollout; `results` are gym.RunResult."""
    failed = [(r.status, str(r.body)[:500]) for r in results if r.status != 200]
    assert not failed, failed
    checks = [check_rollout(r.body) for r in results]
    return Collection(
        checks,
        [c.first_break for c in checks if c.first_break is not None],
        sum(c.model_calls >= 3 for c in checks),
        sum(c.model_calls for c in checks),
        sum(bool(r.body["response"].get("incomplete_details")) for r in results),
        sum(r.body["reward"] for r in results),
    )
