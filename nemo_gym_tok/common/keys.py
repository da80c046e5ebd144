"""A vLLM API key as every client of this package sends it: one rule for "no key", one way to write the header."""

from __future__ import annotations

NO_KEY_PLACEHOLDER = "EMPTY"
"""What the OpenAI SDK and NeMo Gym's configs write for "no key" (the SDK refuses an empty one): sent as no key."""


def effective_key(key: object) -> str | None:
    """`key` when it is one: None for None, a non-string, "" or NO_KEY_PLACEHOLDER."""
    return key if isinstance(key, str) and key and key != NO_KEY_PLACEHOLDER else None


def key_headers(key: object) -> dict[str, str]:
    """`Authorization: Bearer <key>`, or no header without an effective key."""
    found = effective_key(key)
    return {"Authorization": f"Bearer {found}"} if found is not None else {}
