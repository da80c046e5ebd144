"""The Jinja sandbox's shortcuts (its attribute verdicts memoized, a plain dict's keys looked up at once): in place on
the installed jinja2, the same verdicts, the same lookups, the same renderings, the same refusals."""

from __future__ import annotations

import collections
from typing import Any

import pytest
from jinja2.exceptions import SecurityError
from jinja2.runtime import Undefined
from jinja2.sandbox import ImmutableSandboxedEnvironment

from nemo_gym_tok.common import jinja_sandbox
from nemo_gym_tok.common.jinja_sandbox import memoize_attribute_checks, sandbox_source_digest


def _original(name: str = "is_safe_attribute") -> Any:
    current = getattr(ImmutableSandboxedEnvironment, name)
    return getattr(current, "__wrapped__", current)


def _function() -> None:
    pass


def _generator():  # noqa: ANN202 - a generator object to ask about
    yield 1


class _Plain:
    def method(self) -> None:
        pass


def _objects() -> list[object]:
    return [
        {},
        [],
        set(),
        collections.deque(),
        collections.OrderedDict(),
        "text",
        b"bytes",
        3,
        2.5,
        None,
        (1, 2),
        _function,
        _Plain().method,
        _Plain(),
        _Plain,
        str,
        _generator(),
        _function.__code__,
    ]


ATTRIBUTES = [
    "append", "clear", "pop", "popitem", "update", "setdefault", "add", "discard", "extend", "insert", "remove",
    "keys", "items", "values", "get", "index", "count", "upper", "startswith", "split", "strip", "format", "mro",
    "__class__", "__globals__", "__code__", "__self__", "__func__", "_private", "gi_frame", "gi_code", "co_code",
    "f_locals", "method", "real", "appendleft", "sort", "reverse", "copy",
]  # fmt: skip


def test_the_memo_is_in_place_on_the_installed_jinja2() -> None:
    # Fails on a jinja2 whose sandbox checks changed: the memo then stays off until they are checked again (see the
    # module's docstring) and its digest added.
    assert sandbox_source_digest() in jinja_sandbox.CHECKED_SOURCES, sandbox_source_digest()
    assert memoize_attribute_checks()
    assert memoize_attribute_checks()  # idempotent
    assert getattr(ImmutableSandboxedEnvironment.is_safe_attribute, "__wrapped__", None) is not None
    assert getattr(ImmutableSandboxedEnvironment.getattr, "__wrapped__", None) is not None


def test_every_verdict_is_the_unmemoized_one_asked_twice() -> None:
    memoize_attribute_checks()
    env = ImmutableSandboxedEnvironment()
    original = _original()
    unsafe_seen = safe_seen = 0
    for _ in range(2):  # the second round answers from the memo
        for obj in _objects():
            for attr in ATTRIBUTES:
                expected = original(env, obj, attr, None)
                assert env.is_safe_attribute(obj, attr, None) is expected, (type(obj), attr)
                unsafe_seen += not expected
                safe_seen += expected
    assert unsafe_seen and safe_seen  # both verdicts were exercised


def test_a_full_memo_still_answers(monkeypatch: pytest.MonkeyPatch) -> None:
    memoize_attribute_checks()
    env = ImmutableSandboxedEnvironment()
    monkeypatch.setattr(jinja_sandbox, "MAX_VERDICTS", 0)  # read at each miss: nothing more is kept
    fresh_list = type("FreshList", (list,), {})()
    for _ in range(2):
        assert env.is_safe_attribute(fresh_list, "append", None) is False
        assert env.is_safe_attribute(fresh_list, "index", None) is True


def test_templates_render_the_same_text_and_refuse_the_same() -> None:
    memoize_attribute_checks()
    env = ImmutableSandboxedEnvironment()
    template = env.from_string(
        "{% for m in messages %}<{{ m.role }}>{{ m.content.strip() | upper }}{% if m.content.startswith('a') %}!"
        "{% endif %}{{ m.get('name', '-') }}{% for k in m.keys() | sort %}{{ k }}{% endfor %}{% endfor %}"
    )
    messages = [{"role": "user", "content": "abc "}, {"role": "assistant", "content": "xyz", "name": "n"}]
    memoized = template.render(messages=messages)
    with _without_shortcuts():
        assert template.render(messages=messages) == memoized
    assert memoized == "<user>ABC!-contentrole<assistant>XYZncontentnamerole"
    for _ in range(2):
        with pytest.raises(SecurityError):
            env.from_string("{{ messages.append(1) }}").render(messages=[])
        with pytest.raises(SecurityError):
            env.from_string("{{ m.clear() }}").render(m={})
        assert env.from_string("{{ f.__globals__ }}").render(f=_function) == ""


class _Dict(dict):  # type: ignore[type-arg] - a dict subclass: its attributes are not a plain dict's
    extra = "attribute"


def test_a_plain_dicts_keys_are_looked_up_as_the_sandbox_does() -> None:
    memoize_attribute_checks()
    env = ImmutableSandboxedEnvironment()
    original = _original("getattr")
    shadowing = {"items": "key", "content": "text", "get": 1, "tool_calls": [], "__class__": "k", "_private": 2}
    for obj in (shadowing, {}, {"a": None}, _Dict(content="x", extra="key"), [1], "text"):
        for name in ("items", "content", "get", "tool_calls", "missing", "__class__", "_private", "extra", "upper"):
            expected, got = original(env, obj, name), env.getattr(obj, name)
            if isinstance(expected, Undefined):
                assert isinstance(got, Undefined) and type(got) is type(expected), (obj, name)
                assert str(got._undefined_hint) == str(expected._undefined_hint), (obj, name)
            else:
                assert got == expected, (obj, name)
    # The dict's own methods win over a key of that name, and stay unsafe where they modify it.
    assert env.from_string("{{ m.items() | list }}").render(m={"items": 1}) == "[('items', 1)]"
    assert env.from_string("{{ m.content }}|{{ m.nothing is defined }}").render(m={"content": "c"}) == "c|False"
    with pytest.raises(SecurityError):
        env.from_string("{{ m.pop('a') }}").render(m={"a": 1, "pop": 2})


class _without_shortcuts:  # noqa: N801 - used as a context manager
    def __enter__(self) -> None:
        self.shortcuts = {
            name: getattr(ImmutableSandboxedEnvironment, name) for name in ("is_safe_attribute", "getattr")
        }
        for name in self.shortcuts:
            setattr(ImmutableSandboxedEnvironment, name, _original(name))

    def __exit__(self, *exc: object) -> None:
        for name, method in self.shortcuts.items():
            setattr(ImmutableSandboxedEnvironment, name, method)
