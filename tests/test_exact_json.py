"""The gym's one JSON reader gives json.loads' value and refusal for every document, and nothing else reads JSON."""

from __future__ import annotations

import ast
import json
import math
from decimal import Decimal

import pytest
from hypothesis import given
from hypothesis import strategies as st

from nemo_gym_tok.common.exact_json import NeedsStdlib, has_wide_integer, loads_exact, loads_fast
from tests.test_architecture_doc import ROOT, library_files

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
    "[1e400, -1e400, 1e-400]",  # past a float: the stdlib's inf and 0.0
    '{"ids": [' + ", ".join(str(i * 7919) for i in range(2000)) + "]}",  # long enough for the bytes scan
    '{"ids": [' + ", ".join(str(i) for i in range(200)) + "], " + '"big": ' + str(2**64 + 1) + "}",
]


def _same(left: object, right: object) -> bool:
    if isinstance(left, float) and isinstance(right, float) and math.isnan(left) and math.isnan(right):
        return True
    if type(left) is not type(right):
        return False
    if isinstance(left, float):
        return left == right and math.copysign(1.0, left) == math.copysign(1.0, right)  # -0.0 stays -0.0
    if isinstance(left, dict):
        return list(left) == list(right) and all(_same(left[key], right[key]) for key in left)  # type: ignore[index]
    if isinstance(left, list):
        return len(left) == len(right) and all(map(_same, left, right))  # type: ignore[arg-type]
    return left == right


@pytest.mark.parametrize("text", DOCUMENTS)
def test_the_stdlibs_value(text: str) -> None:
    for raw in (text, text.encode("utf-8"), bytearray(text.encode("utf-8")), memoryview(text.encode("utf-8"))):
        assert _same(loads_exact(raw), json.loads(text)), type(raw)


@pytest.mark.parametrize("value", [2**64 + 1, -(2**70), 2**64 - 1, -(2**63), 2**64, -(2**63) - 1, 10**400])
def test_integers_past_64_bits_stay_exact(value: int) -> None:
    for raw in (str(value), f'{{"n": {value}}}'.encode(), f"[{value}]"):
        read = loads_exact(raw)
        number = read if isinstance(read, int) else read["n"] if isinstance(read, dict) else read[0]
        assert type(number) is int and number == value


@given(st.integers())
def test_any_integer_is_read_as_the_stdlib_reads_it(value: int) -> None:
    assert _same(loads_exact(f"[{value}]"), json.loads(f"[{value}]"))


@given(st.floats(allow_nan=False, allow_infinity=False))
def test_any_float_is_read_as_the_stdlib_reads_it(value: float) -> None:
    for text in (repr(value), f"{value:.17e}", f"{value:.3g}", f"{value:.25f}"):
        assert _same(loads_exact(text.encode()), json.loads(text)), text


@given(st.decimals(allow_nan=False, allow_infinity=False))
def test_any_decimal_text_is_rounded_as_the_stdlib_rounds_it(value: Decimal) -> None:
    text = str(value)  # "0.1000000000000000055511151231257827", "-1.5E+308": digits past a double's
    assert _same(loads_exact(text), json.loads(text)), text


def test_nan_and_infinity_as_the_stdlib_takes_them() -> None:
    read = loads_exact(b'[NaN, Infinity, -Infinity, {"x": NaN}]')
    assert math.isnan(read[0]) and read[1] == math.inf and read[2] == -math.inf and math.isnan(read[3]["x"])
    with pytest.raises(NeedsStdlib):
        loads_fast(b"[NaN]")  # orjson refuses it: a strict caller reads it with hooks of its own


def _refuse(name: str) -> None:
    raise ValueError(f"refused {name}")


def test_hooks_are_the_stdlibs() -> None:
    assert loads_exact("[1.5, 2]", parse_float=Decimal) == [Decimal("1.5"), 2]  # orjson would have made a float
    with pytest.raises(ValueError, match="refused NaN"):
        loads_exact("[NaN]", parse_constant=_refuse)


@pytest.mark.parametrize(
    "raw", ["", "{", '{"a": }', "{'a': 1}", '{"a": 1} x', "[1,]", "[NaN", b"<html>proxy error</html>", b"\xef\xbb"]
)
def test_the_stdlibs_refusal(raw: str | bytes) -> None:
    with pytest.raises(ValueError) as stdlib:
        json.loads(raw)
    with pytest.raises(ValueError) as ours:
        loads_exact(raw)
    # The type and the words callers catch and pass on (a 502's message, a line named unreadable) are the stdlib's.
    assert type(ours.value) is type(stdlib.value) and str(ours.value) == str(stdlib.value)
    if isinstance(stdlib.value, json.JSONDecodeError):
        assert isinstance(ours.value, json.JSONDecodeError)


def test_bytes_in_no_json_encoding_raise_as_the_stdlib_raises() -> None:
    with pytest.raises(UnicodeDecodeError):
        json.loads(b'{"a": "\xff"}')
    with pytest.raises(UnicodeDecodeError):
        loads_exact(b'{"a": "\xff"}')


@pytest.mark.parametrize("value", [None, {"a": 1}, 3])
def test_what_is_not_text_is_a_type_error_as_with_the_stdlib(value: object) -> None:
    with pytest.raises(TypeError):
        loads_exact(value)  # type: ignore[arg-type]


def test_wide_integer_detection() -> None:
    for wide in (
        '{"a": 1000000000000000000}',
        '{"a": "id 12345678901234567890"}',
        "12345678901234567890",
        "[-1" + "0" * 19 + "]",
    ):
        assert has_wide_integer(wide) and has_wide_integer(wide.encode()), wide
    for narrow in ('{"a": [123456789012345678, 1, 2]}', "\ud800 123456789012345678", "[-0.00015500000154133886]"):
        assert not has_wide_integer(narrow) and not has_wide_integer(narrow.encode("utf-8", "surrogatepass")), narrow


def test_long_fraction_digits_stay_on_orjson() -> None:
    # Logprobs near 0 come written as -0.000012345678901234568: 21 digits in a row, none of them an integer's.
    raw = b'{"generation_log_probs": [-0.00015500000154133886, -0.000012345678901234568, -0.5]}'
    assert loads_fast(raw) == json.loads(raw)


# Every library module (test_architecture_doc's LIBRARY_ROOTS; tests aside, which hold the reader to the stdlib)
# reads JSON through nemo_gym_tok/common/exact_json.py.
READER = "nemo_gym_tok/common/exact_json.py"
STANDALONE = {
    "nemo_gym_tok/servers/nemo_gym_resolve.py": "run by NeMo Gym's Python, where this project is not installed",
    "nemo_gym_tok/testing/chat_templates/renderers_worker.py": "run by .venv-renderers' Python, without this project",
}
"""Scripts another interpreter runs by path: they cannot import the reader, so they keep the stdlib's."""
PENDING: dict[str, str] = {}
"""Readers in files other changes of issue 32 hold: switch each to loads_exact, then drop its entry here (a test
below fails once an entry has nothing left to excuse)."""
READ_NAMES = {"loads", "load", "JSONDecoder"}


def json_reads(source: str) -> list[str]:
    """Each place `source` reads JSON itself: json's or orjson's readers (imported or reached as attributes), and
    `.json()` with no arguments (httpx's and Starlette's readers, which call json.loads)."""
    tree = ast.parse(source)
    modules: set[str] = set()
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules.update(alias.asname or alias.name for alias in node.names if alias.name in ("json", "orjson"))
        elif isinstance(node, ast.ImportFrom) and node.module in ("json", "orjson"):
            found += [(node.lineno, f"from {node.module} import {a.name}") for a in node.names if a.name in READ_NAMES]
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules:
            if node.attr in READ_NAMES:
                found.append((node.lineno, f"{node.value.id}.{node.attr}"))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "json":
            if not node.args and not node.keywords:
                found.append((node.lineno, ".json()"))
    return [f"line {line}: {what}" for line, what in sorted(found)]


def _pending(file: str) -> str | None:
    return next((entry for entry in PENDING if file == entry or (entry.endswith("/") and file.startswith(entry))), None)


def test_the_scan_sees_every_kind_of_read() -> None:
    source = (
        "import json\nimport orjson as fast\nfrom json import load\n"
        "json.loads(a)\nfast.loads(b)\nreader = json.loads\nresponse.json()\njson.dumps(c)\nrequest.json(default=1)\n"
    )
    assert json_reads(source) == [
        "line 3: from json import load",
        "line 4: json.loads",
        "line 5: fast.loads",
        "line 6: json.loads",
        "line 7: .json()",
    ]


def test_nothing_but_the_reader_reads_json() -> None:
    files = library_files()
    assert READER in files and len(files) > 100, files[:5]
    readers = {}
    for file in files:
        if file == READER or file in STANDALONE or _pending(file):
            continue
        found = json_reads((ROOT / file).read_text(encoding="utf-8"))
        if found:
            readers[file] = found
    assert not readers, (
        "JSON read outside nemo_gym_tok/common/exact_json.py (use loads_exact: the stdlib's values at orjson's "
        f"speed): {readers}"
    )


def test_every_exception_is_still_needed() -> None:
    files = library_files()
    stale = [file for file in STANDALONE if file not in files or not json_reads((ROOT / file).read_text("utf-8"))]
    stale += [
        entry
        for entry in PENDING
        if not any(_pending(file) == entry and json_reads((ROOT / file).read_text("utf-8")) for file in files)
    ]
    assert not stale, f"exceptions that excuse no JSON read any more: drop them from tests/test_exact_json.py: {stale}"
