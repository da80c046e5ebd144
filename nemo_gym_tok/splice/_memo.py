"""What one request's splice learned that the next turn of the same conversation can reuse: renderings and prompts.

A turn's neutral rendering of all its messages (with a generation prompt) is, message for message, what the next
turn of the same conversation renders for the messages before its prefix's turn: the structural check's prompt. The
memo maps a digest of (template scope, flags, messages) to the text; the messages hold no model text (placeholders),
so one entry is small next to the history it saves rendering again.

It also keeps the prompts this server spliced, by the same digest: a spliced prompt passed the structural check for
exactly those neutral messages (the prefix's part) and is the template's own ids after it (the tail). The next turn's
prefix opens with that prompt, id for id, when the client sends back what it was given; the memo then proves the
prefix's prompt part by one digest of its ids instead of walking the history again. A prefix that differs anywhere
in that part, or messages that differ in anything the template sees, find no entry and take the full check.

And it keeps the messages for which the splice's shortcut to the tail (the placement rendering) proved wrong, so
they take the full path when they come again. Bounded; least recently used entries leave first.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import orjson


@dataclass(frozen=True)
class ProvenPrompt:
    """A prompt this server spliced for some neutral messages: what the next turn's check needs of it."""

    length: int
    """Its ids: the next turn's prefix holds them first, then the model's generation."""
    closing_text: str
    """The template's text after the last assistant body (it ends with the generation prompt)."""
    checked_by_text: bool
    """How the splice that made it was proven (see SpliceResult.checked_by_text)."""


class RenderMemo:
    """Bounded maps from (template scope, flags, neutral messages) to their rendering and to the prompt spliced."""

    def __init__(self, max_entries: int = 512, max_prompts: int = 8192) -> None:
        """`max_entries` renderings (each the size of a history's text) and `max_prompts` spliced prompts (a few
        hundred bytes each: one per conversation in flight, so they outnumber the renderings)."""
        self._max_entries = max_entries
        self._max_prompts = max_prompts
        self._entries: OrderedDict[bytes, str] = OrderedDict()
        self._prompts: OrderedDict[bytes, tuple[bytes, ProvenPrompt]] = OrderedDict()
        self._distrusted: OrderedDict[bytes, None] = OrderedDict()
        self._located: OrderedDict[tuple[Any, ...], Any] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0
        self.proven = 0

    def render(self, scope: str, messages: Sequence[Any], flags: dict[str, Any], render: Callable[[], str]) -> str:
        """The memoized rendering, or `render()` (kept when it succeeds). `scope` names everything else the
        rendering depends on: the template, its arguments and the tools."""
        key = _key(scope, messages, flags)
        if key is None:  # something orjson cannot write: render without the memo
            return render()
        with self._lock:
            text = self._entries.get(key)
            if text is not None:
                self._entries.move_to_end(key)
                self.hits += 1
                return text
            self.misses += 1
        text = render()
        with self._lock:
            _put(self._entries, key, text, self._max_entries)
        return text

    def located(self, key: tuple[Any, ...], locate: Callable[[], Any]) -> Any:
        """What `locate()` found in a memoized rendering, by `key` (which holds that rendering's text: the memo
        hands out one string object per rendering, whose hash Python keeps, so the lookup does not read the text)."""
        with self._lock:
            found = self._located.get(key)
            if found is not None:
                self._located.move_to_end(key)
                return found
        found = locate()
        with self._lock:
            _put(self._located, key, found, self._max_entries)
        return found

    def remember_prompt(
        self, scope: str, messages: Sequence[Any], prompt_ids: Sequence[int], closing_text: str, checked_by_text: bool
    ) -> None:
        """Keep that `prompt_ids` was spliced (and proven) for neutral `messages` with a generation prompt."""
        key = _key(scope, messages, _PROMPT_FLAGS)
        if key is None:
            return
        entry = (_ids_digest(prompt_ids), ProvenPrompt(len(prompt_ids), closing_text, checked_by_text))
        with self._lock:
            _put(self._prompts, key, entry, self._max_prompts)

    def proven_prompt(self, scope: str, messages: Sequence[Any], prefix: Sequence[int]) -> ProvenPrompt | None:
        """The prompt this server spliced for neutral `messages`, when `prefix` opens with exactly its ids and
        goes on past them; None otherwise."""
        key = _key(scope, messages, _PROMPT_FLAGS)
        if key is None:
            return None
        with self._lock:
            entry = self._prompts.get(key)
            if entry is not None:
                self._prompts.move_to_end(key)
        if entry is None:
            return None
        digest, proven = entry
        if len(prefix) <= proven.length or _ids_digest(prefix[: proven.length]) != digest:
            return None
        with self._lock:
            self.proven += 1
        return proven

    def distrust_placement(self, scope: str, messages: Sequence[Any]) -> None:
        """Keep that the placement rendering's tail was wrong for these neutral messages (splice._splice)."""
        key = _key(scope, messages, _PROMPT_FLAGS)
        if key is not None:
            with self._lock:
                _put(self._distrusted, key, None, self._max_entries)

    def distrusts_placement(self, scope: str, messages: Sequence[Any]) -> bool:
        if not self._distrusted:  # the common case, without digesting the messages
            return False
        key = _key(scope, messages, _PROMPT_FLAGS)
        with self._lock:
            return key is not None and key in self._distrusted


_PROMPT_FLAGS = {"add_generation_prompt": True}
"""The flags of the rendering a spliced prompt belongs to (the structural check renders its prompt with them)."""


def _key(scope: str, messages: Sequence[Any], flags: dict[str, Any]) -> bytes | None:
    try:
        serialized = orjson.dumps([scope, flags, list(messages)], option=orjson.OPT_SORT_KEYS)
    except TypeError:
        return None
    return hashlib.sha256(serialized).digest()


def _ids_digest(ids: Sequence[int]) -> bytes:
    # SHA-256: CPUs with the SHA extensions hash it at twice blake2b's speed (a 32k-id prompt is 200 KB of JSON).
    return hashlib.sha256(orjson.dumps(ids if isinstance(ids, (list, tuple)) else list(ids))).digest()


def _put(entries: OrderedDict[bytes, Any], key: bytes, value: Any, max_entries: int) -> None:
    entries[key] = value
    entries.move_to_end(key)
    while len(entries) > max_entries:
        entries.popitem(last=False)
