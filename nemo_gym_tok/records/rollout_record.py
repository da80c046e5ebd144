"""The rollout record's schema versions: version 2 stores each model call's ids once; readers rebuild full prompts.

Version 1 (records without `schema_version`): each model call's bundled output item carries its whole
`prompt_token_ids`, so every id of the episode is repeated in every later call's prompt and a record grows with the
square of its length. Version 2 writes `prompt_prefix_length` (how many leading ids this prompt shares with the
previous bundled call's prompt + generation ids) and `prompt_suffix_token_ids` (the rest of the prompt) in its
place: the full prompt is `(previous prompt + previous generation)[:prompt_prefix_length] + prompt_suffix_token_ids`.
The encoding is lossless for any record, contiguous or not, so a reader rebuilds exactly what version 1 held.
Every other field of a bundled item (its telemetry: `token_source`, `prefix_splice`, `sampling`, `weight_version`,
`weight_version_spans`, ...) is stored as it is in both versions; an item written before a field existed lacks it,
which readers take as unknown (nemo_gym_tok.records.contiguity.bundled_turns).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

SCHEMA_VERSION_KEY = "schema_version"
RECORD_SCHEMA_VERSION = 2
"""The version the simple agent writes."""
READABLE_SCHEMA_VERSIONS = (1, 2)
PROMPT_PREFIX_LENGTH_KEY = "prompt_prefix_length"
PROMPT_SUFFIX_KEY = "prompt_suffix_token_ids"


class UnknownSchemaVersionError(ValueError):
    """The record's `schema_version` is not one this nemo_gym_tok reads (a newer collector wrote it)."""

    def __init__(self, version: Any) -> None:
        self.version = version
        readable = " and ".join(str(v) for v in READABLE_SCHEMA_VERSIONS)
        if isinstance(version, int) and not isinstance(version, bool) and version > RECORD_SCHEMA_VERSION:
            why = f"is newer than this nemo_gym_tok reads ({readable}): upgrade nemo_gym_tok to read it"
        else:
            why = f"is not a rollout record version (this nemo_gym_tok reads {readable})"
        super().__init__(f"rollout record {SCHEMA_VERSION_KEY} {version!r} {why}")


class MalformedRecordError(ValueError):
    """A version 2 record whose packed prompt ids cannot be rebuilt; says which output item."""


def record_schema_version(record: dict[str, Any]) -> int:
    """The record's schema version (1 when it has no `schema_version`); UnknownSchemaVersionError for any other."""
    version = record.get(SCHEMA_VERSION_KEY, 1)
    if type(version) is not int or version not in READABLE_SCHEMA_VERSIONS:  # type(): True and 2.0 are not versions
        raise UnknownSchemaVersionError(version)
    return version


def common_prefix_length(before: Sequence[int], prompt: Sequence[int]) -> int:
    """How many leading ids `prompt` shares with `before`."""
    length = min(len(before), len(prompt))
    if before[:length] == prompt[:length]:  # the usual case, compared in C
        return length
    return next(i for i in range(length) if before[i] != prompt[i])


class PromptPacker:
    """Writes version 2 bundles one model call at a time, in output order; holds only the previous call's ids."""

    def __init__(self) -> None:
        self._before: list[int] = []

    def pack(self, bundle: dict[str, Any]) -> dict[str, Any]:
        """`bundle` (an item's fields, `prompt_token_ids` among them) with its prompt as prefix length + suffix."""
        prompt = list(bundle["prompt_token_ids"])
        shared = common_prefix_length(self._before, prompt)
        self._before = prompt + list(bundle.get("generation_token_ids") or ())
        packed: dict[str, Any] = {}
        for key, value in bundle.items():
            if key == "prompt_token_ids":  # same place in the item, so the record reads in the same order
                packed[PROMPT_PREFIX_LENGTH_KEY] = shared
                packed[PROMPT_SUFFIX_KEY] = prompt[shared:]
            else:
                packed[key] = value
        return packed


def packed_record(record: dict[str, Any]) -> dict[str, Any]:
    """A version 1 or 2 record as version 2 (to convert files of an older `ngt collect`)."""
    output = full_output(record)
    packer = PromptPacker()
    items = [packer.pack(item) if item.get("prompt_token_ids") is not None else item for item in output]
    response = {**(record.get("response") or {}), "output": items}
    converted = {SCHEMA_VERSION_KEY: RECORD_SCHEMA_VERSION, **record, "response": response}
    converted[SCHEMA_VERSION_KEY] = RECORD_SCHEMA_VERSION
    return converted


def full_output(record: dict[str, Any]) -> list[dict[str, Any]]:
    """`record["response"]["output"]` with every bundled item's full `prompt_token_ids`, whatever the version.

    Raises UnknownSchemaVersionError for a version this module does not read, MalformedRecordError for a version 2
    item whose prefix length or suffix cannot be rebuilt.
    """
    version = record_schema_version(record)
    output = (record.get("response") or {}).get("output") or []
    if version == 1:
        return list(output)
    rebuilt: list[dict[str, Any]] = []
    before: list[int] = []
    for index, item in enumerate(output):
        if not isinstance(item, dict) or PROMPT_PREFIX_LENGTH_KEY not in item:
            if isinstance(item, dict) and item.get("prompt_token_ids") is not None:
                raise MalformedRecordError(
                    f"output item {index} has prompt_token_ids, which a version 2 record stores as "
                    f"{PROMPT_PREFIX_LENGTH_KEY} + {PROMPT_SUFFIX_KEY}"
                )
            rebuilt.append(item)
            continue
        shared, suffix = item[PROMPT_PREFIX_LENGTH_KEY], item.get(PROMPT_SUFFIX_KEY)
        if isinstance(shared, bool) or not isinstance(shared, int) or not 0 <= shared <= len(before):
            raise MalformedRecordError(
                f"output item {index}: {PROMPT_PREFIX_LENGTH_KEY} {shared!r} is not an integer from 0 to "
                f"{len(before)} (the previous call's prompt + generation ids)"
            )
        if not isinstance(suffix, list) or not isinstance(item.get("generation_token_ids"), list):
            raise MalformedRecordError(
                f"output item {index}: a version 2 bundle needs {PROMPT_SUFFIX_KEY} and generation_token_ids lists"
            )
        prompt = before[:shared] + suffix
        before = prompt + item["generation_token_ids"]
        unpacked = {k: v for k, v in item.items() if k not in (PROMPT_PREFIX_LENGTH_KEY, PROMPT_SUFFIX_KEY)}
        rebuilt.append({**unpacked, "prompt_token_ids": prompt})
    return rebuilt
