"""The structural check's fast path: match the template's fixed text against the caller's ids without tokenizing it.

Tokenizers split text at added tokens before anything else, so a fixed segment of template text is a sequence of
added tokens and the text runs between them. The fast walk checks each added token by id, finds each text run in the
ids as the ids between two added ids, and compares it as text: one batched decode of all runs at the end, which costs
a fraction of tokenizing the same text. Only a segment's last run (an assistant header's tail such as "assistant\\n",
which a body follows with no added token between) is tokenized, and those short pieces repeat, so they are cached.

What it proves: outside the model's bodies, the ids spell the template's text with every added token where the
template has it. What it does not: that each run's ids are the tokenizer's own split of that text (a client that
tokenized a user message another way passes). Where the fast walk cannot prove a match (a difference, a tokenizer
whose decoding is not the inverse of its encoding, added tokens that strip neighbouring spaces), the caller runs the
exact walk (`match_fixed_segments`), which tokenizes each segment and reports the first differing id.
"""

from __future__ import annotations

import re
from bisect import bisect_left
from collections.abc import Callable, Mapping, Sequence

from nemo_gym_tok.splice._structure import Layout, segment_end

Encode = Callable[[str], list[int]]
DecodeBatch = Callable[[list[list[int]]], list[str]]

_CACHED_PIECE_LENGTH = 64
_MAX_CACHED_PIECES = 4096


class FixedTextMatcher:
    """Walks ids along a layout's fixed text by added-token ids and decoded text runs (see the module docstring)."""

    def __init__(
        self, encode: Encode, decode_batch: DecodeBatch, added_tokens: Mapping[str, int],
        piece_cache: dict[str, list[int]] | None = None,
    ) -> None:
        self._encode = encode
        self._decode_batch = decode_batch
        self._added = dict(added_tokens)
        self._added_ids = frozenset(added_tokens.values())
        self._splitter = _added_token_pattern(tuple(sorted(added_tokens, key=len, reverse=True)))
        self._pieces = piece_cache if piece_cache is not None else {}

    def body_spans(
        self, ids: Sequence[int], layout: Layout, closer_ids: frozenset[int], end_ids: frozenset[int] = frozenset()
    ) -> list[tuple[int, int]] | None:
        """The id spans of the layout's bodies (the last runs to the end of `ids`) when every fixed segment is
        proven to match; None when the fast walk cannot prove it (the exact walk then decides)."""
        if not closer_ids:
            return None  # turns closed by text: a body's end is found by matching text, which needs the exact walk
        # One pass over the ids: where the added tokens are (text runs end there; closers are among them).
        added_at = [index for index, token in enumerate(ids) if token in self._added_ids]
        closers_at = [index for index in added_at if ids[index] in closer_ids]
        runs: list[tuple[int, int, str]] = []
        spans: list[tuple[int, int]] = []
        position = 0
        for number, (start, end) in enumerate(layout.fixed_segments()):
            pieces = self._split(layout.text[start:end])
            if number > 0:
                if pieces:
                    body_end = segment_end(
                        ids, position, lambda at: self._walk(ids, at, pieces, added_at, None) is not None,
                        closer_ids, end_ids, closers_at,
                    )
                else:
                    body_end = len(ids)
                if body_end is None:
                    return None
                spans.append((position, body_end))
                position = body_end
            after = self._walk(ids, position, pieces, added_at, runs)
            if after is None:
                return None
            position = after
        spans.append((position, len(ids)))
        if runs:
            decoded = self._decode_batch([list(ids[run_start:run_end]) for run_start, run_end, _ in runs])
            if any(text != expected for text, (_, _, expected) in zip(decoded, runs)):
                return None
        return spans

    def _split(self, text: str) -> list[str | int]:
        """Text runs (str) and added tokens (their id), in order."""
        pieces: list[str | int] = []
        position = 0
        for match in self._splitter.finditer(text):
            if match.start() > position:
                pieces.append(text[position : match.start()])
            pieces.append(self._added[match.group()])
            position = match.end()
        if position < len(text):
            pieces.append(text[position:])
        return pieces

    def _walk(
        self, ids: Sequence[int], position: int, pieces: list[str | int], added_at: list[int],
        runs: list[tuple[int, int, str]] | None,
    ) -> int | None:
        """Where the pieces end when they match at `position` (text runs between added tokens are queued in `runs`
        for the batched decode, or not checked when `runs` is None); None when they cannot match."""
        for number, piece in enumerate(pieces):
            if isinstance(piece, int):
                if position >= len(ids) or ids[position] != piece:
                    return None
                position += 1
            elif number + 1 < len(pieces):  # an added token follows: the run ends at the next added id
                next_added = bisect_left(added_at, position)
                if next_added == len(added_at) or added_at[next_added] == position:
                    return None
                run_end = added_at[next_added]
                if runs is not None:
                    runs.append((position, run_end, piece))
                position = run_end
            else:  # the segment's last piece, followed by a body or the end: its own tokenization
                expected = self._piece_ids(piece)
                if list(ids[position : position + len(expected)]) != expected:
                    return None
                position += len(expected)
        return position

    def _piece_ids(self, piece: str) -> list[int]:
        if len(piece) > _CACHED_PIECE_LENGTH:
            return self._encode(piece)
        cached = self._pieces.get(piece)
        if cached is None:
            if len(self._pieces) >= _MAX_CACHED_PIECES:
                self._pieces.clear()
            cached = self._pieces[piece] = self._encode(piece)
        return cached


_patterns: dict[tuple[str, ...], re.Pattern[str]] = {}


def _added_token_pattern(tokens: tuple[str, ...]) -> re.Pattern[str]:
    pattern = _patterns.get(tokens)
    if pattern is None:
        if len(_patterns) >= 16:
            _patterns.clear()
        pattern = _patterns[tokens] = (
            re.compile("|".join(re.escape(token) for token in tokens)) if tokens else re.compile(r"(?!x)x")
        )
    return pattern
