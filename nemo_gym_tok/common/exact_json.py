"""The gym's one JSON reader (exactly `json.loads`' values, at orjson's speed where that is exact), and its writer.

Bodies carry thousands of token ids (a bundled history, vLLM's answer with the prompt's ids, a rollout record), which
the stdlib reads and writes 5 to 25 times slower than orjson; and vLLM reads tool-call arguments with `json.loads`
before a chat template sees them, so a local rendering that must equal the server's has to read them into the same
values. orjson gives `json.loads`' values for every document it accepts (floats correctly rounded, the last of
repeated keys, `-0` an int), except an integer past 64 bits, which it reads as a float: such text, and everything
orjson refuses (NaN, Infinity, lone surrogates, a BOM, text that is not UTF-8, nesting past 1024), goes to the stdlib,
which decides and words its refusals as it always did. Nothing else in the gym reads JSON, but two scripts that other
Pythons run by path (tests/test_exact_json.py checks it and names them).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import orjson

JSON_MEDIA_TYPE = "application/json"
JSON_HEADERS = {"content-type": JSON_MEDIA_TYPE}
"""The header of a request whose body is already JSON bytes (httpx sets it itself only for `json=`)."""

Readable = str | bytes | bytearray | memoryview
"""What the reader takes: JSON text, or its bytes (UTF-8; the stdlib also detects UTF-16 and UTF-32)."""

_WIDE_INTEGER_LENGTH = 19
"""Digits in a row from which an integer may lie outside 64 bits (10**30 would become 1e+30 in orjson's hands).
Token ids and counts never come close."""
_NUMBER_CLASSES = bytes(
    ord("0") if ord("0") <= byte <= ord("9") else byte if byte == ord(".") else ord(" ") for byte in range(256)
)
"""Maps every digit to "0", keeps ".", and maps every other byte to " ", so that one substring search finds a run of
digits and what precedes it."""
_WIDE_INTEGER = b" " + b"0" * _WIDE_INTEGER_LENGTH
"""19 digits after anything but a decimal point. Fraction digits never make an integer, and they run long: orjson
and the stdlib write a logprob such as -0.000155 as -0.00015500000154133886, 20 digits in a row, which would
otherwise send every bundle to the stdlib."""


class NeedsStdlib(Exception):
    """loads_fast could not read a document exactly (orjson refuses it, or it may hold an integer past 64 bits):
    the caller reads it with the stdlib, as loads_exact does, or with its own stricter hooks."""


def has_wide_integer(raw: str | bytes | bytearray) -> bool:
    """Whether `raw` may hold an integer that orjson would not read exactly: 19 digits in a row not after a decimal
    point, in a number or in a string. Two C-speed passes (a regex takes ten times as long on a body of thousands of
    short numbers)."""
    if len(raw) < _WIDE_INTEGER_LENGTH:
        return False
    if isinstance(raw, str):
        raw = raw.encode("utf-8", "surrogatepass")  # a lone surrogate is no digit: the search is unchanged
    classes = raw.translate(_NUMBER_CLASSES)
    return _WIDE_INTEGER in classes or classes.startswith(_WIDE_INTEGER[1:])


def loads_fast(raw: Readable) -> Any:
    """`json.loads(raw)`'s value, read by orjson; NeedsStdlib where orjson refuses `raw` or could read it otherwise.
    For a caller whose fallback reads with hooks of its own (a request body's NaN refused with a message)."""
    if isinstance(raw, memoryview):
        raw = raw.tobytes()
    if not isinstance(raw, (str, bytes, bytearray)) or has_wide_integer(raw):
        raise NeedsStdlib
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise NeedsStdlib from None


def loads_exact(
    raw: Readable,
    *,
    parse_float: Callable[[str], Any] | None = None,
    parse_constant: Callable[[str], Any] | None = None,
) -> Any:
    """`json.loads(raw, parse_float=..., parse_constant=...)`: the same value (type and all), read by orjson wherever
    that is exact, and the same exceptions for what the stdlib refuses (ValueError: JSONDecodeError, or
    UnicodeDecodeError for bytes in no JSON encoding; TypeError for what is neither text nor bytes; RecursionError
    past the interpreter's depth). With a hook the stdlib reads the whole document: orjson has no hooks."""
    if parse_float is None and parse_constant is None:
        try:
            return loads_fast(raw)
        except NeedsStdlib:
            pass  # the stdlib decides: it takes NaN and lone surrogates, and words its refusals its own way
    if isinstance(raw, memoryview):
        raw = raw.tobytes()
    return json.loads(raw, parse_float=parse_float, parse_constant=parse_constant)


def dumps(value: Any) -> bytes:
    """`value` as compact UTF-8 JSON. orjson where it can write the value; the stdlib for what orjson refuses
    (integers past 64 bits, keys that are not strings), so nothing that serialised before fails now. NaN and the
    infinities, which no reader of the gym lets in, would be written as null (the stdlib encoder raised)."""
    try:
        return orjson.dumps(value)
    except orjson.JSONEncodeError:
        return json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode("utf-8")
