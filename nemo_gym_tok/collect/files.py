"""The collector's files: the append-only output (repaired on start), the failures side file, and the writer's lock."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from nemo_gym_tok.collect.collect_errors import CollectError, ResumeError
from nemo_gym_tok.collect.identity import RolloutId, RolloutKey
from nemo_gym_tok.common.jsonl import JsonlLine, scan_jsonl
from nemo_gym_tok.records.rollout_record import UnknownSchemaVersionError, record_schema_version

FAILURES_SUFFIX = ".failures.jsonl"


def failures_path_for(output_path: str | os.PathLike[str]) -> Path:
    """`<output>.failures.jsonl`: the side file holding rollouts that failed and are not in the output yet."""
    return Path(f"{os.fspath(output_path)}{FAILURES_SUFFIX}")


def repair_output(output_path: str | os.PathLike[str]) -> tuple[list[RolloutId], bool]:
    """Rollout ids of the output's records; truncates a torn last line (a kill mid-write) away.

    Returns (ids, whether the file was truncated). Only a last line without its newline can be left by a killed
    collector (a record is one write, and a failed write is undone): it is cut even when it reads, since the next
    record is appended after it. Any other bad line is an error to fix (the policy of nemo_gym_tok.common.jsonl).
    """
    path = Path(output_path)
    if not path.exists():
        return [], False
    ids: list[RolloutId] = []
    for line in scan_jsonl(path):
        if not line.terminated:
            os.truncate(path, line.start)  # the last line: nothing follows a line without a newline
            return ids, True
        try:
            ids.append(_record_id(line))
        except UnknownSchemaVersionError as exc:
            raise ResumeError(
                f"{path}:{line.number}: {exc}; resume it with the nemo_gym_tok that wrote it, or "
                "collect into another --output"
            ) from None
        except ValueError as exc:
            raise CollectError(
                f"{path}:{line.number}: {exc}; the output file was edited or written by something "
                "else: fix or remove that line"
            ) from None
    return ids, False


def _record_id(line: JsonlLine) -> RolloutId:
    record = line.value
    if record is None:
        raise ValueError(line.problem)
    if "rollout_id" not in record:
        raise ValueError("not a rollout record (no rollout_id)")
    record_schema_version(record)  # a version this collector cannot read back must not be appended to
    return RolloutId.from_json(record["rollout_id"])


def read_failures(failures_path: str | os.PathLike[str]) -> dict[RolloutKey, dict[str, Any]]:
    """The failures file as {rollout key: entry}; a later entry for the same rollout wins (its latest reason)."""
    path = Path(failures_path)
    entries: dict[RolloutKey, dict[str, Any]] = {}
    if not path.exists():
        return entries
    for line in scan_jsonl(path):
        # A side file: a line torn by a kill, or otherwise unreadable, only loses a reason, never a rollout.
        if line.value is None:
            continue
        try:
            entries[RolloutId.from_json(line.value["rollout_id"]).key] = line.value
        except (ValueError, KeyError, TypeError):
            continue
    return entries


def write_failures(failures_path: str | os.PathLike[str], entries: dict[RolloutKey, dict[str, Any]]) -> None:
    """Atomically replace the failures file with `entries` (temp file + os.replace); no entries removes it."""
    path = Path(failures_path)
    if not entries:
        path.unlink(missing_ok=True)
        return
    write_atomically(path, b"".join(json_line(entries[key]) for key in sorted(entries, key=_entry_order(entries))))


def write_atomically(path: Path, data: bytes) -> None:
    """Replace `path` with `data` all at once (temp file in the same folder, fsync, os.replace): never half-written."""
    fd, temp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.fchmod(fd, 0o644 & ~umask)  # mkstemp's 0600 would make the published file unreadable to others
        _write_all(fd, data)
        os.fsync(fd)  # the rename must not publish a file whose bytes are not on disk yet
        os.close(fd)
        fd = -1
        os.replace(temp_name, path)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        Path(temp_name).unlink(missing_ok=True)
        raise


def _entry_order(entries: dict[RolloutKey, dict[str, Any]]) -> Any:
    # Input order (row index when failed, then repeat) reads best; the key breaks ties deterministically.
    def order(key: RolloutKey) -> tuple[int, int, RolloutKey]:
        row = entries[key].get("rollout_id", {}).get("row")
        return (row if isinstance(row, int) else -1, key.repeat, key)

    return order


def json_line(obj: Any) -> bytes:
    """`obj` as one UTF-8 JSON line: json.dumps escapes newlines inside strings, so it is always exactly one."""
    return (json.dumps(obj, ensure_ascii=False) + "\n").encode("utf-8")


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


class AppendLog:
    """An O_APPEND file that gets whole lines: one os.write per line, and a failed write leaves no torn line.

    No fsync per line: a write() that returned is in the page cache and survives any kill of this process,
    SIGKILL included, and the kill-safety is what resuming needs. fsync only adds safety against an OS crash
    or power loss, which at worst loses the last lines (they are redone by the next run; a torn tail is
    repaired on start), while a per-line fsync would block the event loop and every in-flight rollout on a
    disk flush, which is slow on the network file systems clusters use. `close` syncs once at the end.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)

    def append(self, line: bytes) -> None:
        """Write one whole line, or nothing."""
        start = os.fstat(self.fd).st_size  # we hold the only writer (see lock_output), so this is where we append
        try:
            written = os.write(self.fd, line)
            if written < len(line):  # a short write (e.g. disk nearly full): finish it, or undo it below
                _write_all(self.fd, line[written:])
        except BaseException:
            # Never leave half a line followed by later lines: that would corrupt the middle of the file.
            os.ftruncate(self.fd, start)
            raise

    def close(self) -> None:
        """Sync once and close."""
        try:
            os.fsync(self.fd)
        finally:
            os.close(self.fd)


def lock_output(output_path: Path) -> int:
    """An exclusive lock on `<output>`, so two collectors never append to the same file; the kernel drops it on exit."""
    fd = os.open(output_path, os.O_RDONLY | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise CollectError(f"another `ngt collect` is writing {output_path}; wait for it or stop it") from None
        raise
    return fd
