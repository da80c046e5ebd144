"""The gym's one JSONL reader: files of one JSON object per line, with one policy for a line that does not read.

Every JSONL file of the gym (rollout outputs, `.failures.jsonl` side files, input rows, training step records and
metrics, the token store's call records) is read here, and the policy is this:

- A line ends at `\\n` and is numbered from 1, blank ones included. A blank line (whitespace only) is skipped.
- A line is read with `loads_exact` and must be a JSON object.
- The last line, when it has no `\\n` and does not read, is *torn*: a writer killed mid-line (the gym writes each
  line with one write, so only a file's end can be cut). Readers skip it and report it: `scan_jsonl` yields it
  marked `torn`, and the strict readers (`iter_jsonl`, `read_jsonl`, `keep`) warn with a TornLineWarning naming the
  file and line (printed on stderr by default). A last line without `\\n` that reads is an ordinary line.
- Any other line that does not read, or is not an object, raises JsonlError (a ValueError) naming file and line.

Readers with other needs go through `scan_jsonl` (every non-blank line with its object or its problem) rather than
parse lines themselves: `ngt check` and the soak's report count bad lines as failures, the failures side file only
loses a reason to one, and the collector's own output must end in whole lines: `ngt collect` truncates an unended
last line away when it resumes (`repair_output`), and `ngt export-nemo-gym` refuses it until then.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import IO, Any

from nemo_gym_tok.common.exact_json import loads_exact

TORN = "a torn last line (its writer was killed mid-line)"
"""How a torn line is named in warnings and reports."""

LINES = "<lines>"
"""The name `scan_lines` gives lines that come from no file."""


class JsonlError(ValueError):
    """A line of a JSONL file that is not a JSON object (and not a torn last line): `<file>:<line>: <problem>`."""

    def __init__(self, path: str, line_number: int, problem: str) -> None:
        super().__init__(f"{path}:{line_number}: {problem}")
        self.path = path
        self.line_number = line_number
        self.problem = problem


class TornLineWarning(UserWarning):
    """A strict reader skipped a torn last line: the file's writer was killed mid-line."""


@dataclass(frozen=True)
class JsonlLine:
    """One non-blank line as read: its object, or why it is not one."""

    path: str
    number: int
    """1-based, counting blank lines too: what an editor shows."""
    start: int
    """Byte offset of the line in its file (or in the lines `scan_lines` was given): where a truncation cuts."""
    raw: bytes
    """The line's bytes, its `\\n` included when it has one."""
    value: dict[str, Any] | None
    """The object; None when `problem` says why there is none."""
    problem: str | None
    unreadable: bool
    """Whether the line is not JSON at all (rather than JSON that is not an object)."""

    @property
    def terminated(self) -> bool:
        """Whether the line ends in `\\n` (only a file's last line can lack it)."""
        return self.raw.endswith(b"\n")

    @property
    def torn(self) -> bool:
        """A last line cut by a writer killed mid-line: no `\\n`, and it does not read."""
        return self.unreadable and not self.terminated

    def error(self) -> JsonlError:
        """The JsonlError that names this line and its problem (for a reader that refuses it)."""
        return JsonlError(self.path, self.number, self.problem or "not a JSON object")


def parse_line(raw: bytes | str) -> tuple[dict[str, Any] | None, str | None, bool]:
    """(the object, None, False), or (None, why the line is not one, whether it is not JSON at all): the words every
    reader reports a bad line with."""
    try:
        value = loads_exact(raw)
    except ValueError as exc:  # UnicodeDecodeError included: bytes that are not UTF-8
        return None, f"not valid JSON ({exc})", True
    if not isinstance(value, dict):
        return None, f"expected a JSON object, got {type(value).__name__}", False
    return value, None, False


def scan_lines(lines: Iterable[bytes | str], path: str = LINES) -> Iterator[JsonlLine]:
    """Every non-blank line of `lines` (each with its `\\n` where it has one, as a binary file yields them), read and
    never refused: the base of every reader here, for lines already in memory. `path` names them in errors."""
    start = 0
    for number, line in enumerate(lines, start=1):
        raw = line.encode("utf-8", "surrogatepass") if isinstance(line, str) else line
        if raw.strip():
            yield JsonlLine(path, number, start, raw, *parse_line(raw))
        start += len(raw)


def scan_jsonl(path: str | os.PathLike[str]) -> Iterator[JsonlLine]:
    """Every non-blank line of the file at `path`, read and never refused, for readers that count or act on bad lines
    themselves. The file is opened now, so a missing one raises OSError here rather than at the first line."""
    handle = open(path, "rb")  # closed by _scan_handle when it ends or is dropped
    return _scan_handle(handle, os.fspath(path))


def _scan_handle(handle: IO[bytes], path: str) -> Iterator[JsonlLine]:
    with handle:
        yield from scan_lines(handle, path)


def keep(line: JsonlLine) -> bool:
    """The policy for one scanned line: True for an object; False for a torn last line, skipped with a
    TornLineWarning; JsonlError for any other bad line."""
    if line.problem is None:
        return True
    if line.torn:
        warnings.warn(f"{line.path}:{line.number}: skipped {TORN}", TornLineWarning, stacklevel=2)
        return False
    raise line.error()


def iter_jsonl(path: str | os.PathLike[str]) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, object) for each object line of `path` by the policy (a torn last line skipped and warned, any
    other bad line a JsonlError): for readers that name records by their line. Opens the file now, as scan_jsonl."""
    return _objects(scan_jsonl(path))


def _objects(lines: Iterable[JsonlLine]) -> Iterator[tuple[int, dict[str, Any]]]:
    for line in lines:
        if keep(line) and line.value is not None:
            yield line.number, line.value


def read_jsonl(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The objects of the JSONL file at `path`, in order, by the policy (see the module's docstring)."""
    return [record for _, record in iter_jsonl(path)]
