"""The collector: runs every (row, repeat) rollout of a JSONL file against an agent's `/run`, resumably."""

from __future__ import annotations

import asyncio
import errno
import fcntl
import json
import os
import sys
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from tqdm import tqdm

from nemo_gym_tok.http_errors import error_message
from nemo_gym_tok.servers.client import SESSION_HEADER

DEFAULT_HEAD_URL = "http://127.0.0.1:11500"  # launcher.DEFAULT_HEAD_PORT; not imported to keep `ngt collect` light
HEAD_URL_ENV = "NGT_HEAD_URL"
FAILURES_SUFFIX = ".failures.jsonl"
_SHOWN_FAILURES = 3  # failures echoed to stderr while running; the rest are only in the failures file

RolloutKey = tuple[int, int]
"""(row index among the input's non-empty lines, repeat index), both 0-based."""


class CollectError(RuntimeError):
    """A problem that stops the run before (or instead of) rollouts: the message says what to fix."""


class InputError(CollectError):
    """The input file is missing or holds a line that is not a JSON object."""


class HeadError(CollectError):
    """The head server is unreachable, answers oddly, or does not know the agent."""


@dataclass(frozen=True)
class CollectSummary:
    """What one `collect` run did, counted over the rollouts in scope (rows after --limit, times repeats)."""

    done_now: int
    already_done: int
    failed: int
    total: int
    output_path: Path
    failures_path: Path

    def line(self) -> str:
        """The one-line summary `ngt collect` prints."""
        text = (
            f"collect: {self.done_now} done now, {self.already_done} already done, {self.failed} failed, "
            f"{self.total} total -> {self.output_path}"
        )
        if self.failed:
            text += f" (failures: {self.failures_path}; rerun the same command to retry them)"
        return text


def failures_path_for(output_path: str | os.PathLike[str]) -> Path:
    """`<output>.failures.jsonl`: the side file holding rollouts that failed and are not in the output yet."""
    return Path(f"{os.fspath(output_path)}{FAILURES_SUFFIX}")


def resolve_agent_url(head_url: str, agent: str, *, timeout: float = 10.0) -> str:
    """The agent's base URL from the head server's `GET /servers`."""
    head_url = head_url.rstrip("/")
    try:
        response = httpx.get(f"{head_url}/servers", timeout=timeout)
    except httpx.HTTPError as exc:
        raise HeadError(
            f"cannot reach the head server at {head_url} ({type(exc).__name__}: {exc}); start the servers with "
            f"`ngt run -c ...`, or point --head-url / ${HEAD_URL_ENV} at the running head"
        ) from None
    if response.status_code != 200:
        raise HeadError(f"head server at {head_url} answered GET /servers with HTTP {response.status_code}: "
                        f"{error_message(response)}")
    try:
        servers = response.json()
    except ValueError:
        servers = None
    if not isinstance(servers, dict):
        raise HeadError(f"head server at {head_url} answered GET /servers with something other than a JSON object "
                        "of {name: url}; is --head-url really the head server?")
    if agent not in servers:
        known = ", ".join(sorted(servers)) or "none"
        raise HeadError(f"no server named {agent!r} on the head server at {head_url} (known: {known})")
    return str(servers[agent]).rstrip("/")


def read_rows(input_path: str | os.PathLike[str], limit: int | None = None) -> list[dict[str, Any]]:
    """The input's non-empty lines as JSON objects (the first `limit` of them); any other line is an InputError."""
    path = Path(input_path)
    rows: list[dict[str, Any]] = []
    try:
        handle = path.open("rb")
    except FileNotFoundError:
        raise InputError(f"input file not found: {path}") from None
    except OSError as exc:
        raise InputError(f"cannot read input file {path}: {exc.strerror or exc}") from None
    with handle:
        for line_number, raw in enumerate(handle, start=1):
            if limit is not None and len(rows) >= limit:
                break  # rows past --limit are neither run nor validated
            if not raw.strip():
                continue
            try:
                row = json.loads(raw)
            except (UnicodeDecodeError, ValueError) as exc:
                raise InputError(f"{path}:{line_number}: not valid JSON ({exc})") from None
            if not isinstance(row, dict):
                raise InputError(f"{path}:{line_number}: expected a JSON object, got {type(row).__name__}")
            rows.append(row)
    return rows


def repair_output(output_path: str | os.PathLike[str]) -> tuple[set[RolloutKey], bool]:
    """Rollout ids of the output's complete lines; truncates a torn last line (a kill mid-write) away.

    Returns (done ids, whether the file was truncated). A bad line that is not the last one was not written by a
    killed collector, so it is an error rather than something to drop.
    """
    path = Path(output_path)
    if not path.exists():
        return set(), False
    done: set[RolloutKey] = set()
    good_end = 0  # byte offset just past the last complete, parseable line
    bad: tuple[int, str] | None = None  # (line number, why) of the first bad line
    with path.open("rb") as handle:
        for line_number, raw in enumerate(handle, start=1):
            if bad is not None:
                raise CollectError(f"{path}:{bad[0]}: {bad[1]}; this is not a torn last line, so the output file was "
                                   "edited or written by something else: fix or remove that line")
            why = _record_problem(raw)
            if why is None:
                done.add(_rollout_key(json.loads(raw)["rollout_id"]))
                good_end += len(raw)
            else:
                bad = (line_number, why)
    if bad is None:
        return done, False
    os.truncate(path, good_end)
    return done, True


def _record_problem(raw: bytes) -> str | None:
    """Why `raw` is not a complete output line, or None when it is one."""
    if not raw.endswith(b"\n"):
        return "line has no newline (cut short)"
    try:
        record = json.loads(raw)
    except (UnicodeDecodeError, ValueError) as exc:
        return f"not valid JSON ({exc})"
    if not isinstance(record, dict) or "rollout_id" not in record:
        return "not a rollout record (no rollout_id)"
    try:
        _rollout_key(record["rollout_id"])
    except (KeyError, TypeError, ValueError):
        return f"rollout_id is not {{'row': int, 'repeat': int}}: {record['rollout_id']!r}"
    return None


def _rollout_key(rollout_id: Any) -> RolloutKey:
    row, repeat = rollout_id["row"], rollout_id["repeat"]
    if not isinstance(row, int) or not isinstance(repeat, int):
        raise TypeError("row and repeat must be integers")
    return row, repeat


def _rollout_id(key: RolloutKey) -> dict[str, int]:
    return {"row": key[0], "repeat": key[1]}


def read_failures(failures_path: str | os.PathLike[str]) -> dict[RolloutKey, dict[str, Any]]:
    """The failures file as {rollout key: entry}; a later entry for the same rollout wins (its latest reason)."""
    path = Path(failures_path)
    entries: dict[RolloutKey, dict[str, Any]] = {}
    if not path.exists():
        return entries
    with path.open("rb") as handle:
        for raw in handle:
            # A side file: a line torn by a kill, or otherwise unreadable, only loses a reason, never a rollout.
            try:
                entry = json.loads(raw)
                entries[_rollout_key(entry["rollout_id"])] = entry
            except (UnicodeDecodeError, ValueError, KeyError, TypeError):
                continue
    return entries


def write_failures(failures_path: str | os.PathLike[str], entries: dict[RolloutKey, dict[str, Any]]) -> None:
    """Atomically replace the failures file with `entries` (temp file + os.replace); no entries removes it."""
    path = Path(failures_path)
    if not entries:
        path.unlink(missing_ok=True)
        return
    data = b"".join(_json_line(entries[key]) for key in sorted(entries))
    fd, temp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
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


def _json_line(obj: Any) -> bytes:
    # json.dumps escapes newlines inside strings, so one object is always exactly one line.
    return (json.dumps(obj, ensure_ascii=False) + "\n").encode("utf-8")


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


class _AppendLog:
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
        start = os.fstat(self.fd).st_size  # we hold the only writer (see _lock_output), so this is where we append
        try:
            written = os.write(self.fd, line)
            if written < len(line):  # a short write (e.g. disk nearly full): finish it, or undo it below
                _write_all(self.fd, line[written:])
        except BaseException:
            # Never leave half a line followed by later lines: that would corrupt the middle of the file.
            os.ftruncate(self.fd, start)
            raise

    def close(self) -> None:
        try:
            os.fsync(self.fd)
        finally:
            os.close(self.fd)


def _lock_output(output_path: Path) -> int:
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


class _RolloutFailed(Exception):
    """One rollout failed; the message is the reason recorded in the failures file."""


async def _run_one(
    http: httpx.AsyncClient, run_url: str, row: dict[str, Any], timeout: float
) -> dict[str, Any]:
    """POST the row to the agent's `/run` and return its rollout record, or raise _RolloutFailed with a reason."""
    session = str(uuid.uuid4())  # a fresh episode per attempt: a retry must not land in a failed attempt's state
    try:
        async with asyncio.timeout(timeout):  # total time; httpx's own timeouts are per read / per connect
            response = await http.post(run_url, json=row, headers={SESSION_HEADER: session})
    except (TimeoutError, httpx.TimeoutException):
        raise _RolloutFailed(f"timed out after {timeout:g}s waiting for POST {run_url} (session {session})") from None
    except httpx.HTTPError as exc:
        raise _RolloutFailed(f"transport error on POST {run_url}: {type(exc).__name__}: {exc}") from None
    if response.status_code != 200:
        raise _RolloutFailed(
            f"agent answered HTTP {response.status_code} on POST {run_url}: {error_message(response)} (session {session})"
        )
    try:
        record = response.json()
    except ValueError:
        raise _RolloutFailed(f"agent answered HTTP 200 with a body that is not JSON: {error_message(response)}") from None
    if not isinstance(record, dict):
        raise _RolloutFailed(f"agent answered HTTP 200 with JSON {type(record).__name__}, not a rollout record object")
    if "response" not in record:
        keys = ", ".join(sorted(record)) or "none"
        raise _RolloutFailed(f"agent answered HTTP 200 with an object that has no `response` field (keys: {keys})")
    return record


def _pending(rows: list[dict[str, Any]], repeats: int, done: set[RolloutKey]) -> Iterator[RolloutKey]:
    # Row-major order, so a partial run has finished whole rows rather than one repeat of every row.
    for row in range(len(rows)):
        for repeat in range(repeats):
            if (row, repeat) not in done:
                yield row, repeat


async def collect(
    input_path: str | os.PathLike[str],
    output_path: str | os.PathLike[str],
    agent_url: str,
    *,
    concurrency: int = 8,
    limit: int | None = None,
    repeats: int = 1,
    timeout: float = 1800.0,
    progress: bool = True,
) -> CollectSummary:
    """Run every rollout of the input not yet in the output; append records; keep failures in the side file.

    Safe to kill at any moment (SIGKILL included) and rerun with the same arguments: each rollout ends up in
    the output exactly once. Raises InputError / CollectError before any rollout runs if the files are unusable.
    """
    if concurrency < 1 or repeats < 1 or (limit is not None and limit < 0) or timeout <= 0:
        raise ValueError("concurrency and repeats must be >= 1, limit >= 0, timeout > 0")
    output = Path(output_path)
    failures_file = failures_path_for(output)
    rows = read_rows(input_path, limit)
    if output.exists() and Path(input_path).resolve() == output.resolve():
        raise InputError(f"--input and --output are the same file: {output}")
    output.parent.mkdir(parents=True, exist_ok=True)

    lock_fd = _lock_output(output)
    try:
        done, repaired = repair_output(output)
        if repaired:
            print(f"ngt collect: {output} ended in a torn line (an earlier run was killed mid-write); "
                  "truncated it back to the last complete line", file=sys.stderr)
        failures = {key: entry for key, entry in read_failures(failures_file).items() if key not in done}
        write_failures(failures_file, failures)

        total = len(rows) * repeats
        already_done = sum(1 for row in range(len(rows)) for repeat in range(repeats) if (row, repeat) in done)
        summary = await _collect_pending(rows, repeats, done, output, failures_file, failures, agent_url,
                                         concurrency=concurrency, timeout=timeout, progress=progress,
                                         total=total, already_done=already_done)
    finally:
        os.close(lock_fd)
    return summary


async def _collect_pending(
    rows: list[dict[str, Any]],
    repeats: int,
    done: set[RolloutKey],
    output: Path,
    failures_file: Path,
    failures: dict[RolloutKey, dict[str, Any]],
    agent_url: str,
    *,
    concurrency: int,
    timeout: float,
    progress: bool,
    total: int,
    already_done: int,
) -> CollectSummary:
    run_url = f"{agent_url.rstrip('/')}/run"
    semaphore = asyncio.Semaphore(concurrency)
    done_now = 0
    failed_now: set[RolloutKey] = set()
    log = _AppendLog(output)
    failure_log: _AppendLog | None = None  # opened on the first failure, so a clean run never creates the file
    bar = tqdm(total=total, initial=already_done, desc="rollouts", unit="rollout", file=sys.stderr,
               disable=None if progress else True, dynamic_ncols=True)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)

    async def one(key: RolloutKey, http: httpx.AsyncClient) -> None:
        nonlocal done_now, failure_log
        try:
            record = await _run_one(http, run_url, rows[key[0]], timeout)
        except _RolloutFailed as exc:
            entry = {"rollout_id": _rollout_id(key), "reason": str(exc), "row": rows[key[0]]}
            failures[key] = entry
            failed_now.add(key)
            # Appended now so a killed run still shows why; the end-of-run rewrite drops superseded entries.
            if failure_log is None:
                failure_log = _AppendLog(failures_file)
            failure_log.append(_json_line(entry))
            if len(failed_now) <= _SHOWN_FAILURES:
                bar.write(f"ngt collect: rollout row={key[0]} repeat={key[1]} failed: {exc}", file=sys.stderr)
                if len(failed_now) == _SHOWN_FAILURES:
                    bar.write(f"ngt collect: any further failures are reported only in {failures_file}",
                              file=sys.stderr)
            bar.set_postfix(failed=len(failed_now), refresh=False)
        else:
            record["rollout_id"] = _rollout_id(key)
            log.append(_json_line(record))
            done.add(key)
            failures.pop(key, None)
            done_now += 1
        finally:
            bar.update(1)
            semaphore.release()

    tasks: set[asyncio.Task[None]] = set()
    try:
        async with httpx.AsyncClient(timeout=httpx.Timeout(timeout), limits=limits) as http:
            for key in _pending(rows, repeats, done):
                # Acquire before creating the task: at most `concurrency` tasks exist, however long the input.
                await semaphore.acquire()
                task = asyncio.create_task(one(key, http))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            if tasks:
                await asyncio.gather(*tasks)
    finally:
        # After an error or Ctrl-C: stop the in-flight rollouts before closing the files they would write to.
        unfinished = list(tasks)
        for task in unfinished:
            task.cancel()
        await asyncio.gather(*unfinished, return_exceptions=True)
        bar.close()
        if failure_log is not None:
            failure_log.close()
        log.close()
        # Rewritten even after Ctrl-C: it then holds only rollouts that are still missing from the output.
        write_failures(failures_file, {key: entry for key, entry in failures.items() if key not in done})
    return CollectSummary(
        done_now=done_now,
        already_done=already_done,
        failed=len(failed_now),
        total=total,
        output_path=output,
        failures_path=failures_file,
    )
