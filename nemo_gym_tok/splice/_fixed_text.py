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
from collections.abc import Callable, Iterable, Mapping

from nemo_gym_tok.splice._structure import Layout, segment_end

Encode = Callable[[str], list[int]]
DecodeBatch = Callable[[list[list[int]]], list[str]]

_CACHED_PIECE_LENGTH = 64
_MAX_CACHED_PIECES = 4096


class FixedTextMatcher:
    """Walks ids along a layout's fixed text by added-token ids and decoded text runs (see the module docstring)."""

    def __init__(
        self,
        encode: Encode,
        decode_batch: DecodeBatch,
        added_tokens: Mapping[str, int],
        piece_cache: dict[str, list[int]] | None = None,
    ) -> None:
        self._encode = encode
        self._decode_batch = decode_batch
        self._added = dict(added_tokens)
        self._added_ids = frozenset(added_tokens.values())
        self._splitter = added_token_pattern(added_tokens)
        self._pieces = piece_cache if piece_cache is not None else {}

    def body_spans(
        self, ids: list[int], layout: Layout, closer_ids: frozenset[int], end_ids: frozenset[int] = frozenset()
    ) -> list[tuple[int, int]] | None:
        """The id spans of the layout's bodies (the last runs to the end of `ids`) when every fixed segment is
        proven to match; None when the fast walk cannot prove it (the exact walk then decides)."""
        if not closer_ids:
            return None  # turns closed by text: a body's end is found by matching text, which needs the exact walk
        runs: list[tuple[int, int, str]] = []
        spans: list[tuple[int, int]] = []
        position = 0
        for number, (start, end) in enumerate(layout.fixed_segments()):
            pieces = self._split(layout.text[start:end])
            if number > 0:
                if pieces:
                    body_end = segment_end(
                        ids,
                        position,
                        lambda at: self._starts_at(ids, at, pieces),
                        closer_ids,
                        end_ids,
                        next_closer=lambda start: _next_of(ids, start, closer_ids),
                    )
                else:
                    body_end = len(ids)
                if body_end is None:
                    return None
                spans.append((position, body_end))
                position = body_end
            after = self._walk(ids, position, pieces, runs)
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

    def _starts_at(self, ids: list[int], position: int, pieces: list[str | int]) -> bool:
        """Whether the segment can start at `position` (a closing id inside the model's body is not where the next
        segment starts): its added tokens and last piece are where they must be, and its first text run reads as
        the template's (decoded now, not batched: it decides where the body ends)."""
        first_run: list[tuple[int, int, str]] = []
        if self._walk(ids, position, pieces, first_run, first_only=True) is None:
            return False
        return not first_run or self._decode_batch([list(ids[first_run[0][0] : first_run[0][1]])])[0] == first_run[0][2]

    def _walk(
        self,
        ids: list[int],
        position: int,
        pieces: list[str | int],
        runs: list[tuple[int, int, str]],
        *,
        first_only: bool = False,
    ) -> int | None:
        """Where the pieces end when they match at `position`, their text runs between added tokens queued in
        `runs` for the batched decode (only the first with `first_only`); None when they cannot match."""
        for number, piece in enumerate(pieces):
            if isinstance(piece, int):
                if position >= len(ids) or ids[position] != piece:
                    return None
                position += 1
            elif number + 1 < len(pieces):  # an added token follows: the run ends where its id first comes
                # (list.index scans in C; a run that holds another added id decodes to that token's text, which the
                # template's run cannot hold, so it fails the text comparison)
                run_end = _next_of(ids, position, (pieces[number + 1],))
                if run_end is None or run_end == position:
                    return None
                if not (first_only and runs):
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


def _next_of(ids: list[int], start: int, wanted: Iterable[int]) -> int | None:
    """The first index at or after `start` holding one of `wanted` (a few ids), or None."""
    found = None
    for token in wanted:
        try:
            found = ids.index(token, start, len(ids) if found is None else found)
        except ValueError:
            continue
    return found


_patterns: dict[tuple[str, ...], re.Pattern[str]] = {}


def added_token_pattern(added_tokens: Iterable[str]) -> re.Pattern[str]:
    """A regex matching any added token's text, longest first (as tokenizers split at them); kept per token set."""
    tokens = tuple(sorted(added_tokens, key=len, reverse=True))
    pattern = _patterns.get(tokens)
    if pattern is None:
        if len(_patterns) >= 16:
            _patterns.clear()
        pattern = _patterns[tokens] = (
            re.compile("|".join(re.escape(token) for token in tokens)) if tokens else re.compile(r"(?!x)x")
        )
    return pattern
