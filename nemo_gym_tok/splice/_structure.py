"""The structure of a neutral rendering (fixed template text vs. assistant bodies) and the structural check of a prefix.

A neutral rendering (see _neutral) is cut into fixed segments and assistant bodies. A body runs from the end of the
assistant header to the turn's closing special token; everything else (system, user and tool messages, tool schemas,
role headers, closings) is fixed. The structural check walks the caller's ids: every fixed segment must be there id
for id, and each body holds whatever the model generated (it ends at a closing id followed by the next fixed segment,
and never past an end id, where generation stops).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache

from nemo_gym_tok.splice._neutral import placeholder_spans

Encode = Callable[[str], list[int]]


@dataclass(frozen=True)
class Body:
    """One assistant turn's body in a neutral rendering: text offsets [start, end); `end`: where its closing starts."""

    message_index: int
    start: int
    end: int


@dataclass(frozen=True)
class Layout:
    """A neutral rendering cut into fixed segments around assistant bodies."""

    text: str
    bodies: tuple[Body, ...]

    def fixed_segments(self) -> list[tuple[int, int]]:
        """Text offsets of the fixed segments: before the first body, between bodies, after the last."""
        segments, start = [], 0
        for body in self.bodies:
            segments.append((start, body.start))
            start = body.end
        segments.append((start, len(self.text)))
        return segments


@dataclass(frozen=True)
class Mismatch:
    """The first place the caller's ids leave the template's fixed text."""

    position: int
    """Index in the caller's ids."""
    segment: tuple[int, int]
    """Text offsets in the neutral rendering of the fixed segment that differs."""
    segment_position: int
    """Index within that segment's ids where the difference starts."""
    expected: list[int]
    found: list[int]


def locate_bodies(
    text: str,
    message_indices: Sequence[int],
    *,
    special_tokens: Mapping[str, int],
    closers: frozenset[str],
    header_for: Callable[[int], tuple[str, bool, frozenset[str]]],
    open_ended: int | None = None,
    closed_by_text: bool = False,
) -> tuple[Body, ...]:
    """The bodies of the neutral assistant messages `message_indices` in `text`, in order.

    A body starts after the assistant header `header_for(index)` gives: the last of its anchor special tokens
    before the message's first placeholder, then its text (right there, or its last occurrence before the placeholder
    when message text comes between), and ends where the first closing token after the message's last
    placeholder starts (with `closed_by_text`, at the end of its last placeholder). `open_ended` names a message
    whose body may run to the end of the text (a final message rendered with continue_final_message).
    Raises LookupError with the reason when a body cannot be located.
    """
    spans = placeholder_spans(text)
    specials = special_pattern(tuple(sorted(special_tokens, key=len, reverse=True)))
    closing = special_pattern(tuple(sorted(closers, key=len, reverse=True)))
    bodies, previous_end = [], 0
    for index in message_indices:
        if index not in spans:
            raise LookupError(f"the template renders nothing of messages[{index}] (an assistant turn)")
        first, last = spans[index]
        assistant_header, header_follows_special, anchors = header_for(index)
        anchoring = special_pattern(tuple(sorted(anchors, key=len, reverse=True))) if anchors else specials
        start = None
        for match in anchoring.finditer(text, previous_end, first):
            start = match.end()
        if start is None:
            if anchors and header_follows_special:
                raise LookupError(f"no {' or '.join(sorted(anchors))} opens messages[{index}]")
            start = previous_end  # a header after message text is found by its own text
        if assistant_header:
            if header_follows_special:
                header_at = (
                    start if text.startswith(assistant_header, start) and start + len(assistant_header) <= first else -1
                )
            else:
                header_at = text.rfind(assistant_header, start, first)
            if header_at < 0:
                raise LookupError(f"the assistant header {assistant_header!r} does not open messages[{index}]")
            start = header_at + len(assistant_header)
        close = None if closed_by_text else closing.search(text, last)
        if closed_by_text:
            end = len(text) if index == open_ended else last
        elif close is None:
            if index != open_ended:
                raise LookupError(f"no turn-closing token follows messages[{index}] (an assistant turn)")
            end = len(text)
        else:
            end = close.start()
        if start < previous_end or end < last:
            raise LookupError(f"the turns around messages[{index}] overlap in the template's rendering")
        bodies.append(Body(index, start, end))
        previous_end = end
    return tuple(bodies)


def match_fixed_segments(
    ids: Sequence[int],
    layout: Layout,
    encode: Encode,
    closer_ids: frozenset[int],
    end_ids: frozenset[int] = frozenset(),
) -> tuple[list[tuple[int, int]], Mismatch | None]:
    """Walk `ids` along `layout`: fixed segments id for id, each body up to the closing id where the next segment is.

    A body ends at a closing id followed by the next fixed segment; it cannot run past an end id (`end_ids`), where
    generation stops. Returns the id spans [start, end) of the bodies found (the last one runs to the end of `ids`)
    and the first mismatch, if any.
    """
    segments = layout.fixed_segments()
    body_spans: list[tuple[int, int]] = []
    position = 0
    for number, (start, end) in enumerate(segments):
        expected = encode(layout.text[start:end]) if end > start else []
        if number > 0:
            body_end = (
                segment_end(ids, position, _starts_with(ids, expected), closer_ids, end_ids) if expected else len(ids)
            )
            if body_end is None:
                return body_spans, Mismatch(len(ids), (start, end), 0, expected[:8], [])
            body_spans.append((position, body_end))
            position = body_end
        found = list(ids[position : position + len(expected)])
        if found != expected:
            differs = next(
                (i for i, (a, b) in enumerate(zip(found, expected)) if a != b), min(len(found), len(expected))
            )
            return body_spans, Mismatch(
                position + differs, (start, end), differs, expected[differs : differs + 8], found[differs : differs + 8]
            )
        position += len(expected)
    body_spans.append((position, len(ids)))
    return body_spans, None


def segment_end(
    ids: Sequence[int],
    start: int,
    matches_at: Callable[[int], bool],
    closer_ids: frozenset[int],
    end_ids: frozenset[int],
    next_closer: Callable[[int], int | None] | None = None,
) -> int | None:
    """Where the body that starts at `start` ends: the first closing id at which the next fixed segment matches.

    Without a match, the first closing id (so the mismatch is reported there); None when there is no closing id.
    Without closing ids (turns closed by text), the first place the segment matches, and never past the model's
    first end token (generation stopped there, so the template's text follows it at the latest).
    `next_closer(i)`, when given, finds the first closing id at or after i faster than scanning id by id.
    """
    if not closer_ids:
        for index in range(start, len(ids) + 1):
            if matches_at(index):
                return index
            if index < len(ids) and ids[index] in end_ids:
                return index + 1
        return None
    if next_closer is None:
        next_closer = lambda at: next((i for i in range(at, len(ids)) if ids[i] in closer_ids), None)  # noqa: E731
    first = None
    index = next_closer(start)
    while index is not None:
        if first is None:
            first = index
        if matches_at(index) or ids[index] in end_ids:
            return index
        index = next_closer(index + 1)
    return first


def _starts_with(ids: Sequence[int], expected: list[int]) -> Callable[[int], bool]:
    length = len(expected)
    return lambda index: list(ids[index : index + length]) == expected


@lru_cache(maxsize=64)
def special_pattern(tokens: tuple[str, ...]) -> re.Pattern[str]:
    """A regex matching any of `tokens` (longest first, as given); one that matches nothing for none."""
    if not tokens:
        return re.compile(r"(?!x)x")  # matches nothing
    return re.compile("|".join(re.escape(token) for token in tokens))
