"""Picks a call's token ids and log probs from the sources vLLM offers, in precedence order, refusing disagreement."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

from nemo_gym_tok.types.tokens import BUNDLE_FIELDS


class TokenSource(str, Enum):
    """Where a bundle field came from, best first."""

    MESSAGE = "message"  # the bundle the hooked vLLM put on choice.message
    RETURN_TOKEN_IDS = "return_token_ids"  # vLLM's top-level prompt_token_ids and per-choice token_ids
    TOKENIZE = "tokenize"  # the /tokenize fallback (prompt ids only)
    LOGPROBS = "logprobs"  # choice.logprobs with return_tokens_as_token_ids (generation ids, log probs)


@dataclass(frozen=True)
class PartialBundle:
    """What one source knows; None where it says nothing."""

    source: TokenSource
    prompt_token_ids: list[int] | None = None
    generation_token_ids: list[int] | None = None
    generation_log_probs: list[float] | None = None


@dataclass(frozen=True)
class ResolvedBundle:
    prompt_token_ids: list[int]
    generation_token_ids: list[int]
    generation_log_probs: list[float]
    source: TokenSource
    """The source of the prompt ids (the field whose provenance matters for contiguity)."""

    def as_fields(self) -> dict[str, Any]:
        return {
            "prompt_token_ids": self.prompt_token_ids,
            "generation_token_ids": self.generation_token_ids,
            "generation_log_probs": self.generation_log_probs,
        }


class TokenSourceError(ValueError):
    """Sources disagree, or none provides a field; the message says which and where."""


class PrefixMismatchError(ValueError):
    """Prompt ids do not start with the required prefix."""

    def __init__(self, position: int, expected: int | None, found: int | None, prefix_length: int) -> None:
        self.position = position
        self.expected = expected
        self.found = found
        self.prefix_length = prefix_length
        super().__init__(
            f"prompt ids differ from the required prefix ({prefix_length} ids) at position {position}: "
            f"expected {expected}, found {'end of prompt' if found is None else found}"
        )


_LOG_PROB_TOLERANCE = 1e-4


def resolve_bundle(sources: Sequence[PartialBundle]) -> ResolvedBundle:
    """Each field from the first source (in the given order) that has it; any later source that has it must agree."""
    chosen: dict[str, tuple[TokenSource, list[Any]]] = {}
    for partial in sources:
        for field in BUNDLE_FIELDS:
            value = getattr(partial, field)
            if value is None:
                continue
            if field not in chosen:
                chosen[field] = (partial.source, value)
                continue
            first_source, first_value = chosen[field]
            position = first_difference(first_value, value, approximate=field == "generation_log_probs")
            if position is not None:
                raise TokenSourceError(
                    f"{field} from {first_source.value} and from {partial.source.value} disagree at position "
                    f"{position} (lengths {len(first_value)} and {len(value)}); refusing to pick one"
                )
    missing = [field for field in BUNDLE_FIELDS if field not in chosen]
    if missing:
        raise TokenSourceError(f"no token source provided {', '.join(missing)}")
    generation_ids, log_probs = chosen["generation_token_ids"][1], chosen["generation_log_probs"][1]
    if len(generation_ids) != len(log_probs):
        raise TokenSourceError(
            f"generation_token_ids ({len(generation_ids)}) and generation_log_probs ({len(log_probs)}) differ in length"
        )
    return ResolvedBundle(
        prompt_token_ids=list(chosen["prompt_token_ids"][1]),
        generation_token_ids=list(generation_ids),
        generation_log_probs=list(log_probs),
        source=chosen["prompt_token_ids"][0],
    )


def first_difference(a: Sequence[Any], b: Sequence[Any], *, approximate: bool = False) -> int | None:
    """Index of the first position where `a` and `b` differ (a length difference counts), else None."""
    for index, (x, y) in enumerate(zip(a, b)):
        same = math.isclose(x, y, abs_tol=_LOG_PROB_TOLERANCE) if approximate else x == y
        if not same:
            return index
    return None if len(a) == len(b) else min(len(a), len(b))


def check_prefix(prompt_ids: Sequence[int], prefix: Sequence[int]) -> None:
    """Raise PrefixMismatchError unless `prompt_ids` starts with `prefix`."""
    for position, expected in enumerate(prefix):
        found = prompt_ids[position] if position < len(prompt_ids) else None
        if found != expected:
            raise PrefixMismatchError(position, expected, found, len(prefix))


def logprobs_bundle(logprobs: dict[str, Any] | None) -> PartialBundle | None:
    """Generation ids and log probs from a choice's `logprobs` (vLLM with `return_tokens_as_token_ids`)."""
    if not logprobs or logprobs.get("content") is None:
        return None
    ids: list[int] = []
    values: list[float] = []
    for entry in logprobs["content"]:
        token = entry.get("token", "")
        if not token.startswith("token_id:"):
            raise TokenSourceError(f"logprobs token {token!r} is not 'token_id:N'; request return_tokens_as_token_ids")
        ids.append(int(token.removeprefix("token_id:")))
        values.append(float(entry["logprob"]))
    return PartialBundle(TokenSource.LOGPROBS, generation_token_ids=ids, generation_log_probs=values)
