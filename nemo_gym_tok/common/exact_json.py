"""JSON text read at orjson's speed into exactly the values the stdlib's `json.loads` gives.

vLLM parses tool-call arguments with `json.loads` before a chat template sees them; a local rendering that must equal
the server's has to read them into the same values. orjson does, for every document it accepts, except an integer
past 64 bits (which it reads as a float): such text, and everything orjson refuses (NaN, Infinity, lone surrogates),
goes to the stdlib.
"""

from __future__ import annotations

import json
import re
from typing import Any

import orjson

_DIGIT_CLASSES = bytes(ord("0") if ord("0") <= byte <= ord("9") else ord(" ") for byte in range(256))
"""Maps every digit to "0" and every other byte to " ", so a run of digits can be found with one substring search."""
_WIDE_INTEGER_DIGITS = b"0" * 19
"""19 digits in a row: possibly an integer outside 64 bits, which orjson reads as a float (10**30 becomes 1e+30) where
the stdlib keeps Python's exact int. Token ids and counts never come close."""
_WIDE_INTEGER_TEXT = re.compile(r"[0-9]{19}")
"""The same run in a str (short texts such as tool-call arguments: a regex is quick there)."""


def has_wide_integer(raw: bytes | bytearray) -> bool:
    """Whether `raw` may hold an integer that orjson would not read exactly (19 digits in a row, in a number or in a
    string). Two C-speed passes (a regex takes ten times as long on a body of thousands of short numbers)."""
    return _WIDE_INTEGER_DIGITS in raw.translate(_DIGIT_CLASSES)


def loads_exact(text: str) -> Any:
    """`json.loads(text)`, the same value, at orjson's speed wherever orjson reads it exactly. Raises ValueError
    (the stdlib's JSONDecodeError) for what the stdlib refuses."""
    if len(text) < 19 or _WIDE_INTEGER_TEXT.search(text) is None:
        try:
            return orjson.loads(text)
        except orjson.JSONDecodeError:
            pass  # the stdlib decides: it takes NaN and lone surrogates, and words its refusals its own way
    return json.loads(text)
