"""Jinja's immutable sandbox with two shortcuts: chat templates render faster, to the same text.

transformers renders every chat template in a `jinja2.sandbox.ImmutableSandboxedEnvironment`, which checks every
attribute a template reads (`content.startswith`, `message.tool_calls`, ...) with `is_safe_attribute`: a dozen
`isinstance` tests against Python's type machinery and the mutable ABCs each time. Its verdict depends only on the
object's type and the attribute's name (the value it is handed is not read), so one verdict per (type, name) gives
the same answers. And a message is a plain dict, on which the sandbox's `getattr` first tries the attribute, raising
and catching AttributeError, before it looks the key up. On a long history the two are about half the rendering.
`memoize_attribute_checks` installs both on the class, in the process that calls it (the adapter and the hooked vLLM
API server), and only over the jinja2 code they were checked against: any other leaves the sandbox as it is.
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
        "c236a6f252e858d6a889f489",  # jinja2 3.1.6
    }
)
"""Digests of the sandbox methods' source these shortcuts were checked against (see `sandbox_source_digest`)."""
MAX_VERDICTS = 4096
"""Verdicts kept; past this, checks run unmemoized (a template touching thousands of types is not a chat template)."""

_MEMO_MARK = "_ngt_memoized"
_DICT_ATTRIBUTES = frozenset(dir(dict))
"""Every attribute a plain dict has: for any other name, `getattr` on one raises and Jinja looks the key up."""


def _unwrapped(method: Any) -> Any:
    return getattr(method, "__wrapped__", method)


def sandbox_source_digest() -> str:
    """A digest of the source of the sandbox methods the shortcuts stand in for: both environments'
    `is_safe_attribute` and the sandbox's `getattr`."""
    text = "".join(
        inspect.getsource(_unwrapped(method))
        for method in (
            SandboxedEnvironment.is_safe_attribute,
            ImmutableSandboxedEnvironment.is_safe_attribute,
            SandboxedEnvironment.getattr,
        )
    )
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def memoize_attribute_checks() -> bool:
    """Memoize the immutable sandbox's attribute verdicts per (type, attribute name), and look a plain dict's keys up
    at once (`message.content`); idempotent.

    A plain dict has no attribute by any other name than its type's, so Jinja's `getattr` on one, which tries the
    attribute first (raising and catching AttributeError) and then the key, gives the key's value, or undefined, for
    every such name: the shortcut goes there directly. Returns whether both are in place: False, with a log line,
    where the installed jinja2's methods are not the ones they were checked against (a check might read the value or
    the instance), which then stay as they are.
    """
    if getattr(ImmutableSandboxedEnvironment.is_safe_attribute, _MEMO_MARK, False):
        return True
    digest = sandbox_source_digest()
    if digest not in CHECKED_SOURCES:
        logger.info(
            "jinja2's sandbox (source %s) is not the one its shortcuts were checked against; left as it is", digest
        )
        return False
    check = ImmutableSandboxedEnvironment.is_safe_attribute
    look_up = ImmutableSandboxedEnvironment.getattr
    verdicts: dict[tuple[type, str], bool] = {}

    def is_safe_attribute(self: Any, obj: Any, attr: str, value: Any) -> bool:
        key = (type(obj), attr)
        verdict = verdicts.get(key)
        if verdict is None:
            verdict = check(self, obj, attr, value)
            if len(verdicts) < MAX_VERDICTS:
                verdicts[key] = verdict
        return verdict

    def getattr_(self: Any, obj: Any, attribute: str) -> Any:
        if type(obj) is dict and attribute not in _DICT_ATTRIBUTES:
            try:
                return obj[attribute]
            except (TypeError, LookupError):
                return self.undefined(obj=obj, name=attribute)
        return look_up(self, obj, attribute)

    for name, method, original in (("is_safe_attribute", is_safe_attribute, check), ("getattr", getattr_, look_up)):
        method.__wrapped__ = original  # type: ignore[attr-defined]
        setattr(method, _MEMO_MARK, True)
        setattr(ImmutableSandboxedEnvironment, name, method)
    return True
