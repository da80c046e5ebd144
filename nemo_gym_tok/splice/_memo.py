"""What one request's splice learned that the next turn of the same conversation can reuse: renderings and prompts.

A turn's neutral rendering of all its messages (with a generation prompt) is, message for message, what the next
turn of the same conversation renders for the messages before its prefix's turn: the structural check's prompt. The
memo maps a digest of (template scope, flags, messages) to the text; the messages hold no model text (placeholders),
so one entry is small next to the history it saves rendering again.

It also keeps the prompts this server spliced, by a digest of the template scope and the messages as the client sent
them (`prompt_keys`: one orjson pass and one SHA-256, the token fields left out): a spliced prompt passed the
structural check for those messages (the prefix's part) and is the template's own ids after it (the tail). The next
turn's prefix opens with that prompt, id for id, when the client sends back what it was given; the memo then proves
the prefix's prompt part by one digest of its ids (`ids_hasher`, which the next prompt's digest extends without
reading those ids again) instead of walking the history. A prefix that differs anywhere in that part, or messages
that differ in anything, find no entry and take the full check.

And it keeps the messages for which the splice's shortcut to the tail (the placement rendering) proved wrong, so
they take the full path when they come again, and per template scope and conversation shape whether a next turn's
text may be read from a short conversation (`verdict`, see _locality). Bounded; least recently used entries leave
first.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from nemo_gym_tok.types.tokens import BUNDLE_FIELDS, TELEMETRY_FIELDS


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
        self._verdicts: OrderedDict[bytes, bool] = OrderedDict()
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
        return self._kept(self._entries, key, render, count=True)

    def located(self, key: tuple[Any, ...], locate: Callable[[], Any]) -> Any:
        """What `locate()` found in a memoized rendering, by `key` (which holds that rendering's text: the memo
        hands out one string object per rendering, whose hash Python keeps, so the lookup does not read the text)."""
        return self._kept(self._located, key, locate)

    def verdict(self, scope: str, messages: Sequence[Any], name: str, decide: Callable[[], bool]) -> bool:
        """What `decide()` found for these (placeholder-only) messages in `scope`, decided once: a property of the
        template and the conversation's shape, such as whether a next turn's text depends on the history."""
        key = _key(scope, messages, {"verdict": name})
        if key is None:
            return decide()
        return self._kept(self._verdicts, key, decide)

    def _kept(self, entries: OrderedDict[Any, Any], key: Any, make: Callable[[], Any], *, count: bool = False) -> Any:
        """`entries[key]`, or `make()` kept there (made outside the lock: two requests may make it once each);
        `count`: a lookup counts as a hit or a miss."""
        with self._lock:
            found = entries.get(key)
            if found is not None:
                entries.move_to_end(key)
                self.hits += count
                return found
            self.misses += count
        found = make()
        with self._lock:
            _put(entries, key, found, self._max_entries)
        return found

    def remember_prompt(
        self, scope: str, messages: Sequence[Any], prompt_ids: Sequence[int], closing_text: str, checked_by_text: bool
    ) -> None:
        """Keep that `prompt_ids` was spliced (and proven) for `messages` with a generation prompt (prompt_keys)."""
        keys = prompt_keys(scope, messages, 0)
        if keys is None:
            return
        self.remember_prompt_by_key(
            keys[1],
            ids_hasher(prompt_ids).digest(),
            len(prompt_ids),
            closing_text,
            checked_by_text,
        )

    def remember_prompt_by_key(
        self, key: bytes, ids_digest: bytes, length: int, closing_text: str, checked_by_text: bool
    ) -> None:
        """remember_prompt with the messages' key (prompt_keys) and the ids' digest (ids_hasher) made already."""
        with self._lock:
            _put(
                self._prompts, key, (ids_digest, ProvenPrompt(length, closing_text, checked_by_text)), self._max_prompts
            )

    def proven_prompt(self, scope: str, messages: Sequence[Any], prefix: Sequence[int]) -> ProvenPrompt | None:
        """The prompt this server spliced for `messages` (prompt_keys), when `prefix` opens with exactly its ids and
        goes on past them; None otherwise."""
        keys = prompt_keys(scope, messages, 0)
        found = None if keys is None else self.proven_prompt_by_key(keys[1], prefix)
        return None if found is None else found[0]

    def proven_prompt_by_key(
        self, key: bytes, prefix: Sequence[int], opening_json: bytes | None = None, opening_length: int | None = None
    ) -> tuple[ProvenPrompt, Any] | None:
        """proven_prompt by the messages' key, with the hash of the prompt's ids, which a caller extends into the next
        prompt's digest without hashing them again (ids_hasher). `opening_json`: orjson's text of exactly the ids the
        prompt may hold (a bundle's `opening_length` prompt ids, written once already when they were checked): used
        where they are as many as the remembered prompt's."""
        with self._lock:
            entry = self._prompts.get(key)
            if entry is not None:
                self._prompts.move_to_end(key)
        if entry is None:
            return None
        digest, proven = entry
        if len(prefix) <= proven.length:
            return None
        if opening_json is not None and opening_length == proven.length:
            hasher = ids_hasher(prefix, opening_json)
        else:
            hasher = ids_hasher(prefix[: proven.length])
        if hasher.digest() != digest:
            return None
        with self._lock:
            self.proven += 1
        return proven, hasher

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


def _key(scope: str, messages: Sequence[Any], flags: dict[str, Any]) -> bytes | None:
    try:
        serialized = orjson.dumps([scope, flags, list(messages)], option=orjson.OPT_SORT_KEYS)
    except TypeError:
        return None
    return hashlib.sha256(serialized).digest()


TOKEN_FIELDS = frozenset((*BUNDLE_FIELDS, *TELEMETRY_FIELDS))
"""What the gym adds to a message beside the template's input (the bundle, its telemetry): never rendered."""

_PROMPT_FLAGS = {"add_generation_prompt": True}
"""The flags of the rendering a spliced prompt belongs to (the structural check renders its prompt with them)."""


def prompt_keys(scope: str, messages: Sequence[Any], cut: int) -> tuple[bytes, bytes] | None:
    """The memo's keys of the prompts for `messages[:cut]` and for all `messages` (each with a generation prompt):
    SHA-256 over the scope and the messages as orjson writes them, the token fields left out (they are not template
    input, and which call carries the bundle varies), in one pass at C speed. The messages' own text is in the key:
    a prompt is found again only for the very messages it was spliced for. None where orjson cannot write them."""
    plain = [_key_input(message) for message in messages]
    try:
        before = orjson.dumps(plain[:cut], option=orjson.OPT_SORT_KEYS)
        after = orjson.dumps(plain[cut:], option=orjson.OPT_SORT_KEYS)
    except TypeError:
        return None
    hasher = hashlib.sha256(scope.encode())
    hasher.update(memoryview(before)[1:-1])
    first = hasher.digest()
    if cut < len(plain):
        if cut > 0:
            hasher.update(b",")
        hasher.update(memoryview(after)[1:-1])
    return first, hasher.digest()


def _key_input(message: Any) -> Any:
    """`message` without the token fields, its reasoning under one name (copied only where it changes)."""
    if type(message) is not dict:
        message = message.model_dump(exclude_none=True) if hasattr(message, "model_dump") else dict(message)
    if TOKEN_FIELDS.isdisjoint(message) and "reasoning_content" not in message:
        return message
    # vLLM's chat request reads `reasoning_content` as `reasoning`, its /tokenize request keeps it: one name, so a
    # conversation has one key whichever route sent it.
    return {
        ("reasoning" if key == "reasoning_content" else key): value
        for key, value in message.items()
        if key not in TOKEN_FIELDS
    }


def ids_hasher(ids: Sequence[int], written: bytes | None = None) -> Any:
    """SHA-256 over the ids as orjson writes them, without the brackets (`written`: that text with them, made
    already): a hash that `extend_ids_hash` carries on to a longer prompt without reading these ids again. SHA-256:
    CPUs with the SHA extensions hash it at twice blake2b's speed (a 32k-id prompt is 200 KB of text)."""
    text = written if written is not None else orjson.dumps(ids if isinstance(ids, list) else list(ids))
    return hashlib.sha256(memoryview(text)[1:-1])


def extend_ids_hash(hasher: Any, more: Sequence[int]) -> bytes:
    """The digest ids_hasher gives the hashed ids followed by `more`, from a hash of the first ones (left as it was)."""
    extended = hasher.copy()
    if more:
        extended.update(b",")
        extended.update(memoryview(orjson.dumps(more if isinstance(more, list) else list(more)))[1:-1])
    return extended.digest()


def _put(entries: OrderedDict[Any, Any], key: Any, value: Any, max_entries: int) -> None:
    entries[key] = value
    entries.move_to_end(key)
    while len(entries) > max_entries:
        entries.popitem(last=False)
