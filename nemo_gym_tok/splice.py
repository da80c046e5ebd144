"""The prefix splice: the model's exact ids for the history, then the chat template's ids for what follows.

Pure functions with no vLLM import; the vLLM hook (nemo_gym_tok.vllm.hook) calls them on every request that
carries a required prefix.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from nemo_gym_tok.token_sources import PrefixMismatchError, check_prefix, first_difference

Decode = Callable[[Sequence[int]], str]

BUNDLE_KEYS = ("prompt_token_ids", "generation_token_ids", "generation_log_probs")
PREFIX_KEY = "required_prefix_token_ids"


class SpliceError(ValueError):
    """The prefix cannot be spliced; the message says why and what to fix."""


class StalePrefixError(SpliceError):
    """The prefix does not belong to these messages (its turn count does not fit)."""


class BoundaryNotFoundError(SpliceError):
    """The template's rendering has no turn boundary where the prefix should end."""


class InvalidTokenIdsError(SpliceError):
    """Ids that are not non-negative ints below the vocabulary size, or a malformed bundle."""


@dataclass(frozen=True)
class SpliceResult:
    prompt_token_ids: list[int]
    template_differed: bool
    """The template's ids for the history were not the model's ids."""
    replaced_tokens: int
    """Template history ids from the first difference to the boundary: what the model's ids replaced."""
    boundary: int
    """Index in the template's full prompt where the kept tail starts (the history's last turn terminator)."""

    def telemetry(self) -> dict[str, Any]:
        return {"applied": True, "template_differed": self.template_differed, "replaced_tokens": self.replaced_tokens}


@dataclass(frozen=True)
class PrefixSource:
    """The required prefix of a request and the index of the assistant message it ends with."""

    prefix: list[int]
    message_index: int
    """-1 for an explicit prefix sent before any assistant turn: nothing to splice, only to check."""
    explicit: bool
    """True for a top-level `required_prefix_token_ids`, False when derived from a message's bundle."""


def splice_prefix(
    *,
    terminator_id: int,
    model_prefix: Sequence[int],
    template_history: Sequence[int],
    template_full: Sequence[int],
    decode: Decode | None = None,
) -> SpliceResult:
    """`model_prefix` without its trailing turn terminator, then `template_full` from the history's last terminator.

    `template_history` is the template's rendering of the messages up to and including the assistant message the
    prefix came from; its terminator count k locates the boundary in `template_full` (the k-th terminator). The
    prefix must hold k terminators (ended on the terminator) or k - 1 (cut by max_tokens, or stopped on another stop
    token, which it keeps).
    """
    turns = _count(template_history, terminator_id)
    if turns == 0:
        raise BoundaryNotFoundError(
            "the chat template's rendering of the history has no turn terminator "
            f"(id {terminator_id}){_context('history ends', template_history, decode)}; "
            "check the terminator id (NEMO_GYM_TOK_TURN_TERMINATOR) for this template"
        )
    prefix_turns = _count(model_prefix, terminator_id)
    ends_on_terminator = bool(model_prefix) and model_prefix[-1] == terminator_id
    if ends_on_terminator and prefix_turns == turns:
        kept = list(model_prefix[:-1])
    elif not ends_on_terminator and prefix_turns == turns - 1:
        kept = list(model_prefix)
    else:
        shape = "ends on" if ends_on_terminator else "does not end on"
        raise StalePrefixError(
            f"stale prefix: it holds {prefix_turns} turn terminators and {shape} one, but the messages up to the "
            f"assistant turn it belongs to render to {turns} (expected {turns}, or {turns - 1} for a turn cut by "
            f"max_tokens){_context('prefix ends', model_prefix, decode)}; send the prefix of the last assistant "
            "message, or the messages it was produced with"
        )
    boundary = _nth_index(template_full, terminator_id, turns)
    if boundary is None:
        raise BoundaryNotFoundError(
            f"the full prompt renders only {_count(template_full, terminator_id)} turn terminators, fewer than the "
            f"{turns} of the history{_context('prompt ends', template_full, decode)}; the template drops or merges "
            "turns, so the boundary cannot be found"
        )
    template_part = list(template_full[:boundary])
    difference = first_difference(template_part, kept)
    return SpliceResult(
        prompt_token_ids=kept + list(template_full[boundary:]),
        template_differed=difference is not None,
        replaced_tokens=0 if difference is None else len(template_part) - difference,
        boundary=boundary,
    )


def check_starts_with(template_full: Sequence[int], prefix: Sequence[int], decode: Decode | None = None) -> None:
    """For a prefix with no assistant turn to splice: the template's prompt must already start with it."""
    try:
        check_prefix(template_full, prefix)
    except PrefixMismatchError as exc:
        found = "end of prompt" if exc.found is None else exc.found
        raise StalePrefixError(
            f"{PREFIX_KEY} names no assistant turn to splice (none in messages) and the rendered prompt does not "
            f"start with it: position {exc.position} is {found}, the prefix says {exc.expected}"
            f"{_context('prompt begins', template_full[: exc.position + 1], decode)}"
        ) from None


def find_prefix_source(
    messages: Sequence[Any], required_prefix: Any = None, vocab_size: int | None = None
) -> PrefixSource | None:
    """Where the request's prefix comes from: explicit `required_prefix_token_ids`, else the LAST bundled message.

    An explicit prefix belongs to the last assistant message (index -1 if there is none yet). Raises
    InvalidTokenIdsError for malformed input.
    """
    assistant_indices = [i for i, m in enumerate(messages) if _get(m, "role") == "assistant"]
    if required_prefix is not None:
        prefix = check_token_ids(required_prefix, PREFIX_KEY, vocab_size)
        return PrefixSource(prefix, assistant_indices[-1] if assistant_indices else -1, explicit=True)
    for index in reversed(range(len(messages))):
        present = [key for key in BUNDLE_KEYS if _get(messages[index], key) is not None]
        if not present:
            continue
        where = f"messages[{index}]"
        if len(present) != len(BUNDLE_KEYS):
            missing = ", ".join(k for k in BUNDLE_KEYS if k not in present)
            raise InvalidTokenIdsError(f"{where}: token bundle is all or none; {missing} missing")
        if _get(messages[index], "role") != "assistant":
            raise InvalidTokenIdsError(f"{where}: a token bundle belongs on an assistant message")
        prompt = check_token_ids(_get(messages[index], "prompt_token_ids"), f"{where}.prompt_token_ids", vocab_size)
        generation = check_token_ids(
            _get(messages[index], "generation_token_ids"), f"{where}.generation_token_ids", vocab_size
        )
        return PrefixSource(prompt + generation, index, explicit=False)
    return None


def check_token_ids(ids: Any, field: str, vocab_size: int | None = None) -> list[int]:
    """`ids` as a list of non-negative ints (bools, floats and strings rejected), below `vocab_size` if given."""
    if not isinstance(ids, list):
        raise InvalidTokenIdsError(f"{field} must be a list of token ids, got {type(ids).__name__}")
    for position, value in enumerate(ids):
        if type(value) is not int:
            raise InvalidTokenIdsError(f"{field}[{position}] must be an int token id, got {value!r}")
        if value < 0:
            raise InvalidTokenIdsError(f"{field}[{position}] must be non-negative, got {value}")
        if vocab_size is not None and value >= vocab_size:
            raise InvalidTokenIdsError(f"{field}[{position}] = {value} is out of vocabulary (size {vocab_size})")
    return list(ids)


def _get(message: Any, key: str) -> Any:
    return message.get(key) if isinstance(message, dict) else getattr(message, key, None)


def _count(ids: Sequence[int], token: int) -> int:
    return sum(1 for value in ids if value == token)


def _nth_index(ids: Sequence[int], token: int, n: int) -> int | None:
    seen = 0
    for index, value in enumerate(ids):
        if value == token:
            seen += 1
            if seen == n:
                return index
    return None


def _context(label: str, ids: Sequence[int], decode: Decode | None, width: int = 12) -> str:
    if decode is None or not ids:
        return ""
    return f" ({label} with {decode(list(ids[-width:]))!r})"
