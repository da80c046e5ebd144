"""Fast JSON (orjson) for bodies carrying long token-id lists, with the stdlib wherever orjson would change a value."""

from __future__ import annotations

import json
from typing import Any

import orjson  # only the stdlib, orjson and common/ here: `ngt collect` and the gym's clients import this module

from nemo_gym_tok.common.exact_json import has_wide_integer

__all__ = ["JSON_HEADERS", "JSON_MEDIA_TYPE", "dumps", "has_wide_integer", "loads"]

JSON_MEDIA_TYPE = "application/json"
JSON_HEADERS = {"content-type": JSON_MEDIA_TYPE}
"""The header of a request whose body is already JSON bytes (httpx sets it itself only for `json=`)."""


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
