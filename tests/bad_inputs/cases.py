"""The shared table of bad request bodies every gym server must refuse with a 4xx naming the problem."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import httpx


@dataclass(frozen=True)
class BadBody:
    """One kind of bad body: the raw bytes, the status it must get, and words the error message must contain."""

    kind: str
    raw: bytes
    status: int
    names: str


def nested(depth: int, field: str = "extra") -> bytes:
    """An object whose unknown field holds arrays nested `depth` deep."""
    return b'{"%s": ' % field.encode() + b"[" * depth + b"]" * depth + b"}"


SMALL_LIMIT = 4096
"""max_body_bytes of the servers under test, so an oversized body costs a few kilobytes, not 64 MiB."""

BAD_BODIES: list[BadBody] = [
    BadBody("not_json", b"{not json", 400, "not valid JSON"),
    BadBody("truncated", b'{"input": ', 400, "not valid JSON"),
    BadBody("trailing_garbage", b"{} {}", 400, "Extra data"),
    BadBody("array", b"[1, 2]", 400, "must be a JSON object"),
    BadBody("string", b'"text"', 400, "must be a JSON object"),
    BadBody("number", b"7", 400, "must be a JSON object"),
    BadBody("null", b"null", 400, "must be a JSON object"),
    BadBody("bom_then_array", b"\xef\xbb\xbf[1]", 400, "must be a JSON object"),
    BadBody("nested_1000", nested(1000), 400, "nest more than 128 deep"),
    BadBody("nested_129", nested(128), 400, "extra: arrays/objects nest more than 128 deep"),
    BadBody(
        "nested_objects_300", b'{"extra": ' + b'{"a": ' * 300 + b"1" + b"}" * 300 + b"}", 400, "nest more than 128"
    ),
    BadBody("top_level_nested_3000", b"[" * 3000, 400, "nest more than 128 deep"),
    BadBody("nan_unknown_field", b'{"extra": NaN}', 400, "NaN is not a JSON number"),
    BadBody("infinity_unknown_field", b'{"extra": [1, Infinity]}', 400, "Infinity is not a JSON number"),
    BadBody("minus_infinity", b'{"extra": {"x": -Infinity}}', 400, "-Infinity is not a JSON number"),
    BadBody("float_overflow", b'{"extra": 1e400}', 400, "out of range"),
    BadBody("lone_surrogate", b'{"extra": "\\ud800"}', 400, "extra: a string has a lone UTF-16 surrogate"),
    BadBody("lone_low_surrogate_in_list", b'{"extra": ["ok", "a\\udfffb"]}', 400, "lone UTF-16 surrogate"),
    BadBody("lone_surrogate_key", b'{"\\udc00": 1}', 400, "key has a lone UTF-16 surrogate"),
    BadBody("invalid_utf8", b'{"extra": "\xff"}', 400, "not valid UTF-8"),
    BadBody("raw_surrogate_bytes", b'{"extra": "\xed\xa0\x80"}', 400, "not valid UTF-8"),
    BadBody("oversized", b'{"extra": "' + b"x" * (2 * SMALL_LIMIT) + b'"}', 413, "larger than this server's limit"),
]
"""Each kind fails the same way on every JSON route, whatever the route reads: the body reader refuses it first."""

BODY_IDS = [case.kind for case in BAD_BODIES]


def assert_refused(answer: httpx.Response, status: int, names: str, param: str | None = None) -> dict[str, Any]:
    """`answer` is `status` in the OpenAI error shape, its message (or param) contains `names`, no traceback."""
    assert answer.status_code == status, (answer.status_code, answer.text[:500])
    assert "Traceback" not in answer.text
    error = answer.json()["error"]
    assert set(error) >= {"message", "type", "param", "code"}, error
    assert error["code"] == status
    assert names in error["message"] or names == error["param"], error
    if param is not None:
        assert error["param"] == param, error
    return error
