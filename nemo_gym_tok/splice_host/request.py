"""What a chat request asks of the splice (its prefix, a new token segment), and the telemetry of one not spliced."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from nemo_gym_tok.splice import NEW_SEGMENT_KEY, PrefixSource, SpliceError, check_in_vocabulary, find_prefix_source
from nemo_gym_tok.types.tokens import NEW_SEGMENT_REASON_KEY, SEGMENT_ASKED


@dataclass(frozen=True)
class SpliceRequest:
    """A request's prefix (validated ids, or None) and whether it asks for a new token segment."""

    source: PrefixSource | None
    new_segment: bool


def read_splice_request(
    messages: Sequence[Any],
    required_prefix: Any,
    new_segment: Any,
    vocab_size: int | None,
    *,
    types_checked: bool = False,
) -> SpliceRequest:
    """The prefix of `messages` (the top-level `required_prefix` first, else the last bundle) and the request's
    `start_token_segment` value; raises SpliceError naming what to fix. `types_checked`: every id list was validated
    as token ids already (find_prefix_source). Read once per call: the adapter reads it at validation (ChatCall) and
    hands it on (`within_vocabulary`), the hook when vLLM hands it the parsed request."""
    source = find_prefix_source(messages, required_prefix, vocab_size, types_checked=types_checked)
    if new_segment is not None and not isinstance(new_segment, bool):
        raise SpliceError(f"{NEW_SEGMENT_KEY} must be true or false, got {new_segment!r}")
    return SpliceRequest(source, bool(new_segment))


def within_vocabulary(asked: SpliceRequest, vocab_size: int | None) -> SpliceRequest:
    """`asked`, read before the vocabulary was known, once its ids are checked against `vocab_size` (SpliceError)."""
    if asked.source is not None:
        check_in_vocabulary(asked.source, vocab_size)
    return asked


def new_segment_telemetry() -> dict[str, Any]:
    """`prefix_splice` of a request that took the template's ids on purpose (start_token_segment: true)."""
    return {
        "applied": False,
        "template_differed": False,
        "replaced_tokens": 0,
        "new_segment": True,
        NEW_SEGMENT_REASON_KEY: SEGMENT_ASKED,
    }


def first_turn_telemetry() -> dict[str, Any]:
    """`prefix_splice` of a first-turn prefix: the template's own ids were checked to start with it, nothing spliced."""
    return {"applied": False, "template_differed": False, "replaced_tokens": 0}
