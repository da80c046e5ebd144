"""loads_exact gives json.loads' value (type and all) for every document, orjson's speed where that is exact."""

from __future__ import annotations

import json
import math

import pytest

from nemo_gym_tok.common.exact_json import loads_exact

DOCUMENTS = [
    '{"city": "Paris", "days": 3}',
    '{"a": 1, "b": 2, "a": 3}',  # a repeated key: the last value, at the first key's place
    '{"n": 12345678901234567890}',
    '{"n": -9223372036854775809}',  # past 64 bits: orjson alone would give a float
    '{"n": 123456789012345678901234567890}',
    '{"s": "id 12345678901234567890", "n": 1}',
    '{"x": 1.0, "y": 1E2, "z": -0, "w": 0.1, "v": 1.7976931348623157e308}',
    '{"x": NaN, "y": Infinity, "z": -Infinity}',  # the stdlib takes these; orjson refuses them
    '{"s": "\\ud800"}',  # a lone surrogate escape
    '{"s": "caf\\u00e9 \\ud83d\\ude00"}',
    " [1, 2, 3] ",
    '"just a string"',
    "42",
    "null",
    "{}",
]


def _same(left: object, right: object) -> bool:
    if isinstance(left, float) and isinstance(right, float) and math.isnan(left) and math.isnan(right):
        return True
    if type(left) is not type(right):
        return False
    if isinstance(left, dict):
        return list(left) == list(right) and all(_same(left[key], right[key]) for key in left)  # type: ignore[index]
    if isinstance(left, list):
        return len(left) == len(right) and all(map(_same, left, right))  # type: ignore[arg-type]
    return left == right


@pytest.mark.parametrize("text", DOCUMENTS)
def test_the_stdlibs_value(text: str) -> None:
    assert _same(loads_exact(text), json.loads(text))


@pytest.mark.parametrize("text", ["", "{", '{"a": }', "{'a': 1}", '{"a": 1} x', "[1,]"])
def test_the_stdlibs_refusal(text: str) -> None:
    with pytest.raises(ValueError):
        json.loads(text)
    with pytest.raises(ValueError):
        loads_exact(text)
