"""Where a request's required prefix comes from, the validation of every token id a caller sends, and how the splice
reads a message's fields (`message_field`: dicts and objects alike)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from nemo_gym_tok.contract.token_sources import PrefixMismatchError, check_prefix
from nemo_gym_tok.splice._refusals import InvalidTokenIdsError, StalePrefixError
from nemo_gym_tok.types.tokens import BUNDLE_FIELDS, PREFIX_KEY, plain_token_ids, plain_token_ids_json

Decode = Callable[[Sequence[int]], str]


@dataclass(frozen=True)
class PrefixSource:
    """The required prefix of a request and the index of the assistant message it ends with."""

    prefix: list[int]
    message_index: int
    """-1 for an explicit prefix sent before any assistant turn: nothing to splice, only to check."""
    explicit: bool
    """True for a top-level `required_prefix_token_ids`, False when derived from a message's bundle."""
    prompt_length: int | None = None
    """For a bundle, how many of `prefix` are the prompt ids (the rest the generation); None for explicit."""
    prompt_json: bytes | None = field(default=None, repr=False, compare=False)
    """For a bundle whose prompt ids were checked from their JSON text (plain_token_ids_json), that text: the render
    memo hashes it instead of writing the ids again."""


def find_prefix_source(
    messages: Sequence[Any], required_prefix: Any = None, vocab_size: int | None = None, *, types_checked: bool = False
) -> PrefixSource | None:
    """Where the request's prefix comes from: explicit `required_prefix_token_ids`, else the LAST bundled message.

    An explicit prefix belongs to the last assistant message (index -1 if there is none yet). Raises
    InvalidTokenIdsError for malformed input. `types_checked`: the caller validated every id list as token ids
    already (nemo_gym_tok.types' TokenIds, as the adapter's request model does), so only `vocab_size` is left to check.
    """
    if required_prefix is not None:
        prefix = list(_checked_ids(required_prefix, PREFIX_KEY, vocab_size, types_checked))
        assistants = (i for i in reversed(range(len(messages))) if message_field(messages[i], "role") == "assistant")
        return PrefixSource(prefix, next(assistants, -1), explicit=True)
    for index in reversed(range(len(messages))):
        present = [key for key in BUNDLE_FIELDS if message_field(messages[index], key) is not None]
        if not present:
            continue
        where = f"messages[{index}]"
        if len(present) != len(BUNDLE_FIELDS):
            missing = ", ".join(k for k in BUNDLE_FIELDS if k not in present)
            raise InvalidTokenIdsError(f"{where}: token bundle is all or none; {missing} missing")
        if message_field(messages[index], "role") != "assistant":
            raise InvalidTokenIdsError(f"{where}: a token bundle belongs on an assistant message")
        raw_prompt = message_field(messages[index], "prompt_token_ids")
        # Written once whether or not the caller checked the types: the check at C speed and the render memo's
        # digest (prompt_json) both read this text.
        prompt_json = plain_token_ids_json(raw_prompt)
        prompt = _checked_ids(raw_prompt, f"{where}.prompt_token_ids", vocab_size, prompt_json is not None)
        generation = _checked_ids(
            message_field(messages[index], "generation_token_ids"),
            f"{where}.generation_token_ids",
            vocab_size,
            types_checked,
        )
        return PrefixSource(
            prompt + generation, index, explicit=False, prompt_length=len(prompt), prompt_json=prompt_json
        )
    return None


def check_in_vocabulary(source: PrefixSource, vocab_size: int | None, start: int = 0) -> None:
    """A prefix found before the vocabulary was known (the adapter reads it once per call, at validation) checked
    against `vocab_size`, from id `start` on (the ids before it proven otherwise); InvalidTokenIdsError names the
    first id out of it where the caller sent it."""
    prefix = source.prefix
    if vocab_size is None or len(prefix) <= start or max(prefix[start:] if start else prefix) < vocab_size:
        return
    position = next(i for i in range(start, len(prefix)) if prefix[i] >= vocab_size)
    if source.explicit or source.prompt_length is None:
        field = f"{PREFIX_KEY}[{position}]"
    elif position < source.prompt_length:
        field = f"messages[{source.message_index}].prompt_token_ids[{position}]"
    else:
        field = f"messages[{source.message_index}].generation_token_ids[{position - source.prompt_length}]"
    raise InvalidTokenIdsError(f"{field} = {prefix[position]} is out of vocabulary (size {vocab_size})")


def check_starts_with(template_full: Sequence[int], prefix: Sequence[int], decode: Decode | None = None) -> None:
    """For a prefix with no assistant turn to splice: the template's prompt must already start with it."""
    try:
        check_prefix(template_full, prefix)
    except PrefixMismatchError as exc:
        found = "end of prompt" if exc.found is None else exc.found
        context = (
            f" (prompt begins with {decode(list(template_full[max(0, exc.position - 11) : exc.position + 1]))!r})"
            if decode
            else ""
        )
        raise StalePrefixError(
            f"{PREFIX_KEY} names no assistant turn to splice (none in messages) and the rendered prompt does not "
            f"start with it: position {exc.position} is {found}, the prefix says {exc.expected}{context}"
        ) from None


def check_token_ids(ids: Any, field: str, vocab_size: int | None = None) -> list[int]:
    """`ids` as a list of non-negative ints (bools, floats and strings rejected), below `vocab_size` if given."""
    return list(_checked_ids(ids, field, vocab_size, types_checked=False))


def _checked_ids(ids: Any, field: str, vocab_size: int | None, types_checked: bool) -> list[int]:
    """`ids` itself once checked (callers copy or concatenate it)."""
    if not isinstance(ids, list):
        raise InvalidTokenIdsError(f"{field} must be a list of token ids, got {type(ids).__name__}")
    # The common case checked at C speed (a prefix holds thousands of ids); the loop below names the first bad one.
    if not ids or ((types_checked or plain_token_ids(ids)) and (vocab_size is None or max(ids) < vocab_size)):
        return ids
    for position, value in enumerate(ids):
        if type(value) is not int:
            raise InvalidTokenIdsError(f"{field}[{position}] must be an int token id, got {value!r}")
        if value < 0:
            raise InvalidTokenIdsError(f"{field}[{position}] must be non-negative, got {value}")
        if vocab_size is not None and value >= vocab_size:
            raise InvalidTokenIdsError(f"{field}[{position}] = {value} is out of vocabulary (size {vocab_size})")
    return ids


def message_field(message: Any, key: str) -> Any:
    """`message[key]`, or None where it is missing: the splice takes messages as dicts (the adapter, the tests) or as
    objects (vLLM's parsed requests), and reads them through this one accessor."""
    return message.get(key) if isinstance(message, dict) else getattr(message, key, None)
