"""Renderings of neutral messages kept from one request to the next, so a turn does not render what the last did.

A turn's neutral rendering of all its messages (with a generation prompt) is, message for message, what the next
turn of the same conversation renders for the messages before its prefix's turn: the structural check's prompt. The
memo maps a digest of (template scope, flags, messages) to the text; the messages hold no model text (placeholders),
so one entry is small next to the history it saves rendering again. Bounded; least recently used entries leave first.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import orjson


class RenderMemo:
    """A bounded map from (template scope, flags, neutral messages) to their rendering."""

    def __init__(self, max_entries: int = 512) -> None:
        self._max_entries = max_entries
        self._entries: OrderedDict[bytes, str] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def render(
        self, scope: str, messages: Sequence[Any], flags: dict[str, Any], render: Callable[[], str]
    ) -> str:
        """The memoized rendering, or `render()` (kept when it succeeds). `scope` names everything else the
        rendering depends on: the template, its arguments and the tools."""
        try:
            serialized = orjson.dumps([scope, flags, list(messages)], option=orjson.OPT_SORT_KEYS)
        except TypeError:  # something orjson cannot write: render without the memo
            return render()
        key = hashlib.blake2b(serialized, digest_size=20).digest()
        with self._lock:
            text = self._entries.get(key)
            if text is not None:
                self._entries.move_to_end(key)
                self.hits += 1
                return text
            self.misses += 1
        text = render()
        with self._lock:
            self._entries[key] = text
            while len(self._entries) > self._max_entries:
                self._entries.popitem(last=False)
        return text
