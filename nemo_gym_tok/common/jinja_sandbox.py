"""Jinja's immutable sandbox with its attribute verdicts memoized: chat templates render faster, to the same text.

transformers renders every chat template in a `jinja2.sandbox.ImmutableSandboxedEnvironment`, which asks
`is_safe_attribute` on every attribute a template reads (`content.startswith`, `message.tool_calls`, ...). On a long
history that check is about a third of the rendering: it runs a dozen `isinstance` tests against Python's type
machinery and the mutable ABCs each time. Its verdict depends only on the object's type and the attribute's name
(the value it is handed is not read), so one verdict per (type, name) gives the same answers. `memoize_attribute_checks`
installs that memo on the class, in the process that calls it (the adapter and the hooked vLLM API server), and only
over the jinja2 implementation it was checked against: any other leaves the sandbox as it is.
"""

from __future__ import annotations

import hashlib
import inspect
import logging
from typing import Any

from jinja2.sandbox import ImmutableSandboxedEnvironment, SandboxedEnvironment

logger = logging.getLogger("nemo_gym_tok.jinja_sandbox")

CHECKED_SOURCES = frozenset(
    {
        "7d897efc310849c275192444",  # jinja2 3.1.6
    }
)
"""Digests of the two methods' source this memo was checked against (see `sandbox_source_digest`)."""
MAX_VERDICTS = 4096
"""Verdicts kept; past this, checks run unmemoized (a template touching thousands of types is not a chat template)."""

_MEMO_MARK = "_ngt_memoized"


def sandbox_source_digest() -> str:
    """A digest of the source of the two `is_safe_attribute` methods the memo stands in for."""
    immutable = ImmutableSandboxedEnvironment.is_safe_attribute
    immutable = getattr(immutable, "__wrapped__", immutable)
    text = inspect.getsource(SandboxedEnvironment.is_safe_attribute) + inspect.getsource(immutable)
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def memoize_attribute_checks() -> bool:
    """Memoize the immutable sandbox's attribute verdicts per (type, attribute name); idempotent.

    Returns whether the memo is in place: False, with a log line, where the installed jinja2's checks are not the
    ones it was checked against (they might read the value or the instance), which then stay as they are.
    """
    current = ImmutableSandboxedEnvironment.is_safe_attribute
    if getattr(current, _MEMO_MARK, False):
        return True
    digest = sandbox_source_digest()
    if digest not in CHECKED_SOURCES:
        logger.info("jinja2's sandbox attribute check (source %s) is not the one memoized; left as it is", digest)
        return False
    verdicts: dict[tuple[type, str], bool] = {}

    def is_safe_attribute(self: Any, obj: Any, attr: str, value: Any) -> bool:
        key = (type(obj), attr)
        verdict = verdicts.get(key)
        if verdict is None:
            verdict = current(self, obj, attr, value)
            if len(verdicts) < MAX_VERDICTS:
                verdicts[key] = verdict
        return verdict

    is_safe_attribute.__wrapped__ = current  # type: ignore[attr-defined]
    setattr(is_safe_attribute, _MEMO_MARK, True)
    ImmutableSandboxedEnvironment.is_safe_attribute = is_safe_attribute  # type: ignore[method-assign]
    return True
