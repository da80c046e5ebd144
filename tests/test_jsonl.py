"""The one JSONL policy (nemo_gym_tok/common/jsonl.py): blank lines skipped, a torn last line skipped and warned, any
other bad line a JsonlError naming file:line; the scan yields every line for readers that count bad ones."""

from __future__ import annotations

import io
import warnings
from pathlib import Path

import pytest

from nemo_gym_tok.common.jsonl import (
    TORN,
    JsonlError,
    TornLineWarning,
    iter_jsonl,
    read_jsonl,
    scan_jsonl,
    scan_lines,
)
from nemo_gym_tok.records.contiguity import check_file


def write(tmp_path: Path, data: bytes) -> Path:
    path = tmp_path / "records.jsonl"
    path.write_bytes(data)
    return path


def test_blank_lines_are_skipped_but_counted_in_line_numbers(tmp_path: Path) -> None:
    path = write(tmp_path, b'{"a": 1}\n\n   \n{"b": 2}\n\n')
    assert read_jsonl(path) == [{"a": 1}, {"b": 2}]
    assert [number for number, _ in iter_jsonl(path)] == [1, 4]


def test_a_torn_last_line_is_skipped_and_warned(tmp_path: Path) -> None:
    path = write(tmp_path, b'{"a": 1}\n{"b": 2}\n{"c": [1, 2')
    with pytest.warns(TornLineWarning, match=rf"{path}:3: skipped a torn last line"):
        assert read_jsonl(path) == [{"a": 1}, {"b": 2}]
    (*whole, torn) = scan_jsonl(path)
    assert [line.torn for line in whole] == [False, False] and torn.torn
    assert (torn.number, torn.start, torn.value) == (3, len(b'{"a": 1}\n{"b": 2}\n'), None)


def test_a_last_line_without_newline_that_reads_is_kept_silently(tmp_path: Path) -> None:
    path = write(tmp_path, b'{"a": 1}\n{"b": 2}')
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert read_jsonl(path) == [{"a": 1}, {"b": 2}]
    last = list(scan_jsonl(path))[-1]
    assert not last.terminated and not last.torn


@pytest.mark.parametrize(
    ("middle", "problem"),
    [
        (b'{"b": \n', "not valid JSON"),
        (b"\xff\xfe\n", "not valid JSON"),  # not UTF-8
        (b"[1, 2]\n", "expected a JSON object, got list"),
        (b'"text"\n', "expected a JSON object, got str"),
    ],
)
def test_a_bad_middle_line_raises_naming_file_and_line(tmp_path: Path, middle: bytes, problem: str) -> None:
    path = write(tmp_path, b'{"a": 1}\n\n' + middle + b'{"c": 3}\n')
    with pytest.raises(JsonlError, match=rf"^{path}:3: {problem}") as caught:
        read_jsonl(path)
    assert isinstance(caught.value, ValueError) and (caught.value.path, caught.value.line_number) == (str(path), 3)


def test_a_last_line_that_is_no_object_is_not_torn(tmp_path: Path) -> None:
    path = write(tmp_path, b'{"a": 1}\n[1]')
    with pytest.raises(JsonlError, match=rf"{path}:2: expected a JSON object, got list"):
        read_jsonl(path)


def test_the_scan_reports_every_bad_line_and_never_raises(tmp_path: Path) -> None:
    path = write(tmp_path, b'garbage\n{"a": 1}\n7\n{"b"')
    lines = list(scan_jsonl(path))
    assert [(line.number, line.value is None, line.torn) for line in lines] == [
        (1, True, False),
        (2, False, False),
        (3, True, False),
        (4, True, True),
    ]
    assert lines[2].problem == "expected a JSON object, got int"
    assert str(lines[0].error()).startswith(f"{path}:1: not valid JSON (")


def test_a_missing_file_raises_when_the_scan_is_made() -> None:
    with pytest.raises(FileNotFoundError):
        scan_jsonl("/nonexistent/records.jsonl")
    with pytest.raises(FileNotFoundError):
        iter_jsonl("/nonexistent/records.jsonl")


def test_lines_in_memory_split_only_at_newlines() -> None:
    # U+2028 is a line break to str.splitlines, but JSON writes it raw inside a string: a whole record here.
    data = '{"text": "a\u2028b"}\n{"b": 2}\n{"c"'.encode()
    lines = list(scan_lines(io.BytesIO(data), "out"))
    assert [line.value for line in lines] == [{"text": "a\u2028b"}, {"b": 2}, None]
    assert lines[-1].torn and lines[-1].start == data.index(b'{"c"')
    assert [line.value for line in scan_lines(['{"a": 1}', "", "{}"])] == [{"a": 1}, {}]


def test_check_counts_bad_lines_as_failures_instead_of_crashing(tmp_path: Path) -> None:
    path = write(tmp_path, b'[1, 2]\n\n{"rollout_id": {"row": 0}, "response": {"output": []}}\n{"rollout_id": {"ro')
    report = check_file(path)
    assert (report.rollouts, report.unreadable_lines, report.ok) == (1, 2, False)
    assert report.failures[0] == "line 1: expected a JSON object, got list"
    assert report.failures[2] == f"line 4: {TORN}"


def test_an_input_row_cut_short_is_refused_not_skipped(tmp_path: Path) -> None:
    # The rows file is the user's: a row that does not read would be a rollout silently never run.
    from nemo_gym_tok.collect.collect_errors import InputError
    from nemo_gym_tok.collect.identity import read_input

    path = tmp_path / "rows.jsonl"
    path.write_bytes(b'{"a": 1}\n{"b": ')
    with pytest.raises(InputError, match=r"rows.jsonl:2: not valid JSON"):
        read_input(path)
