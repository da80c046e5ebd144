"""Fast JSON (orjson) for bodies carrying long token-id lists, with the stdlib wherever orjson would change a value."""

from __future__ import annotations

import json
from typing import Any

import orjson  # only the stdlib and orjson here: `ngt collect` and the gym's clients import this module

JSON_MEDIA_TYPE = "application/json"
JSON_HEADERS = {"content-type": JSON_MEDIA_TYPE}
"""The header of a request whose body is already JSON bytes (httpx sets it itself only for `json=`)."""

_DIGIT_CLASSES = bytes(ord("0") if ord("0") <= byte <= ord("9") else ord(" ") for byte in range(256))
"""Maps every digit to "0" and every other byte to " ", so a run of digits can be found with one substring search."""
_WIDE_INTEGER_DIGITS = b"0" * 19
"""19 digits in a row: possibly an integer outside 64 bits, which orjson reads as a float (10**30 becomes 1e+30) where
the stdlib keeps Python's exact int. Token ids and counts never come close."""


def has_wide_integer(raw: bytes | bytearray) -> bool:
    """Whether `raw` may hold an integer that orjson would not read exactly (19 digits in a row, in a number or in a
    string). Two C-speed passes (a regex takes ten times as long on a body of thousands of short numbers)."""
    return _WIDE_INTEGER_DIGITS in raw.translate(_DIGIT_CLASSES)


def loads(raw: str | bytes | bytearray | memoryview) -> Any:
    """An answer of another server (vLLM) parsed, at orjson's speed. Raises ValueError (orjson's or the stdlib's
    JSONDecodeError) for invalid JSON; where orjson refuses a document (NaN, Infinity, lone surrogates), the stdlib
    decides, as it did before. Integers past 64 bits would come back as floats: vLLM writes none (request bodies,
    which a caller writes, go through bodies.parse_json_object, which leaves them to the stdlib)."""
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return json.loads(raw if isinstance(raw, (str, bytes)) else bytes(raw))


def dumps(value: Any) -> bytes:
    """`value` as compact UTF-8 JSON. orjson where it can write the value; the stdlib for what orjson refuses
    (integers past 64 bits, keys that are not strings), so nothing that serialised before fails now. NaN and the
    infinities, which no reader of the gym lets in, would be written as null (the stdlib encoder raised)."""
    try:
        return orjson.dumps(value)
    except orjson.JSONEncodeError:
        return json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode("utf-8")
