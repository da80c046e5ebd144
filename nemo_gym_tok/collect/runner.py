"""The collection loop: runs every pending rollout against the agent's `/run`, `concurrency` at a time."""

from __future__ import annotations

import asyncio
import os
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from tqdm import tqdm

from nemo_gym_tok.collect.collect_errors import InputError
from nemo_gym_tok.collect.files import (
    AppendLog,
    failures_path_for,
    json_line,
    lock_output,
    read_failures,
    repair_output,
    write_failures,
)
from nemo_gym_tok.collect.identity import InputRow, InputRows, RolloutKey, read_input
from nemo_gym_tok.collect.resume import belongs, done_keys
from nemo_gym_tok.common.exact_json import loads_exact
from nemo_gym_tok.common.remote_errors import error_message
from nemo_gym_tok.records.rollout_record import UnknownSchemaVersionError, record_schema_version
from nemo_gym_tok.servers.client import SESSION_HEADER, auth_headers
from nemo_gym_tok.servers.http_pool import DEFAULT_MAX_CONNECTIONS, pool_limits

_SHOWN_FAILURES = 3  # failures echoed to stderr while running; the rest are only in the failures file
PROGRESS_LINE_SECONDS = 30.0
"""Without a terminal, a progress line at least this often while rollouts finish (and at every tenth of the run)."""


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


class _RolloutFailed(Exception):
    """One rollout failed; the message is the reason recorded in the failures file, with what kind of failure it was
    and the agent's HTTP status when it answered (what NeMo Gym's failures sidecar classifies by)."""

    def __init__(self, reason: str, kind: str, http_status: int | None = None) -> None:
        super().__init__(reason)
        self.kind = kind
        self.http_status = http_status


async def _run_one(http: httpx.AsyncClient, run_url: str, row: dict[str, Any], timeout: float) -> dict[str, Any]:
    """POST the row to the agent's `/run` and return its rollout record, or raise _RolloutFailed with a reason."""
    session = str(uuid.uuid4())  # a fresh episode per attempt: a retry must not land in a failed attempt's state
    try:
        async with asyncio.timeout(timeout):  # total time; httpx's own timeouts are per read / per connect
            response = await http.post(run_url, json=row, headers={SESSION_HEADER: session})
    except (TimeoutError, httpx.TimeoutException):
        raise _RolloutFailed(
            f"timed out after {timeout:g}s waiting for POST {run_url} (session {session})", "timeout"
        ) from None
    except httpx.HTTPError as exc:
        raise _RolloutFailed(f"transport error on POST {run_url}: {type(exc).__name__}: {exc}", "transport") from None
    if response.status_code != 200:
        raise _RolloutFailed(
            f"agent answered HTTP {response.status_code} on POST {run_url}: {error_message(response)} "
            f"(session {session})",
            "http_status",
            response.status_code,
        )
    try:
        record = loads_exact(response.content)
    except ValueError:
        raise _RolloutFailed(
            f"agent answered HTTP 200 with a body that is not JSON: {error_message(response)}", "bad_answer", 200
        ) from None
    if not isinstance(record, dict):
        raise _RolloutFailed(
            f"agent answered HTTP 200 with JSON {type(record).__name__}, not a rollout record object", "bad_answer", 200
        )
    if "response" not in record:
        keys = ", ".join(sorted(record)) or "none"
        raise _RolloutFailed(
            f"agent answered HTTP 200 with an object that has no `response` field (keys: {keys})", "bad_answer", 200
        )
    try:
        record_schema_version(record)
    except UnknownSchemaVersionError as exc:
        # Written, it would stop every later resume of this output (which reads each record back): fail it instead.
        raise _RolloutFailed(
            f"agent answered a record this ngt collect cannot read back: {exc}", "bad_answer", 200
        ) from None
    return record


def _pending(inputs: InputRows, repeats: int, done: set[RolloutKey]) -> Iterator[tuple[InputRow, int]]:
    # Row-major order, so a partial run has finished whole rows rather than one repeat of every row.
    for row in inputs.rows:
        for repeat in range(repeats):
            if row.key(repeat) not in done:
                yield row, repeat


async def collect(
    input_path: str | os.PathLike[str],
    output_path: str | os.PathLike[str],
    agent_url: str,
    *,
    agent: str | None = None,
    concurrency: int = 8,
    limit: int | None = None,
    repeats: int = 1,
    timeout: float = 1800.0,
    progress: bool = True,
    auth_token: str | None = None,
) -> CollectSummary:
    """Run every rollout of the input not yet in the output; append records; keep failures in the side file.

    `agent` is the agent's instance name: written into each `rollout_id`, and an output holding another agent's
    rollouts is refused (ResumeError), as is one holding rows the input does not have. Safe to kill at any moment
    (SIGKILL included) and rerun with the same arguments: each rollout ends up in the output exactly once. A
    cancelled run (Ctrl-C) drops its in-flight rollouts, recording them nowhere, so the next run runs them.
    `auth_token` is the gym's bearer token, sent with every `/run`.
    Raises InputError / CollectError before any rollout runs if the files are unusable.
    """
    if concurrency < 1 or repeats < 1 or (limit is not None and limit < 0) or timeout <= 0:
        raise ValueError("concurrency and repeats must be >= 1, limit >= 0, timeout > 0")
    output = Path(output_path)
    failures_file = failures_path_for(output)
    inputs = read_input(input_path, limit)
    if output.exists() and Path(input_path).resolve() == output.resolve():
        raise InputError(f"--input and --output are the same file: {output}")
    output.parent.mkdir(parents=True, exist_ok=True)

    lock_fd = lock_output(output)
    try:
        written, repaired = repair_output(output)
        if repaired:
            print(
                f"ngt collect: {output} ended in a torn line (an earlier run was killed mid-write); "
                "truncated it back to the last complete line",
                file=sys.stderr,
            )
        done = done_keys(output, inputs, agent, written)
        failures = {
            key: entry
            for key, entry in read_failures(failures_file).items()
            if key not in done and belongs(entry, inputs, agent)
        }
        write_failures(failures_file, failures)

        total = len(inputs.rows) * repeats
        already_done = sum(1 for row in inputs.rows for repeat in range(repeats) if row.key(repeat) in done)
        run = _Run(
            inputs,
            agent,
            output,
            failures_file,
            failures,
            done,
            concurrency=concurrency,
            timeout=timeout,
            auth_token=auth_token,
        )
        await run.rollouts(agent_url, repeats, progress=progress, total=total, already_done=already_done)
    finally:
        os.close(lock_fd)
    return CollectSummary(
        done_now=run.done_now,
        already_done=already_done,
        failed=len(run.failed_now),
        total=total,
        output_path=output,
        failures_path=failures_file,
    )


class _Run:
    """One run's pending rollouts: writes each finished one to the output or the failures file, never both."""

    def __init__(
        self,
        inputs: InputRows,
        agent: str | None,
        output: Path,
        failures_file: Path,
        failures: dict[RolloutKey, dict[str, Any]],
        done: set[RolloutKey],
        *,
        concurrency: int,
        timeout: float,
        auth_token: str | None = None,
    ) -> None:
        self.inputs = inputs
        self.agent = agent
        self.output = output
        self.failures_file = failures_file
        self.failures = failures
        self.done = done
        self.concurrency = concurrency
        self.timeout = timeout
        self.auth_token = auth_token
        self.done_now = 0
        self.failed_now: set[RolloutKey] = set()
        self.stopping = False
        """Set once the run is being cancelled: from then on an error is the shutdown's doing, not the rollout's."""

    async def rollouts(self, agent_url: str, repeats: int, *, progress: bool, total: int, already_done: int) -> None:
        """Run every pending rollout; on cancellation stop those in flight before any file is closed."""
        run_url = f"{agent_url.rstrip('/')}/run"
        semaphore = asyncio.Semaphore(self.concurrency)
        log = AppendLog(self.output)
        self._failure_log: AppendLog | None = None  # opened on the first failure: a clean run never creates the file
        self._progress = _Progress(enabled=progress, total=total, already_done=already_done)
        # The gym's pool (http_pool), never below --concurrency: no rollout waits for a connection to the agent.
        limits = pool_limits(max(self.concurrency, DEFAULT_MAX_CONNECTIONS))
        tasks: set[asyncio.Task[None]] = set()
        try:
            async with httpx.AsyncClient(
                timeout=httpx.Timeout(self.timeout), limits=limits, headers=auth_headers(self.auth_token)
            ) as http:
                try:
                    for row, repeat in _pending(self.inputs, repeats, self.done):
                        # Acquire before creating the task: at most `concurrency` tasks exist, however long the input.
                        await semaphore.acquire()
                        task = asyncio.create_task(self._one(http, run_url, row, repeat, log, semaphore))
                        tasks.add(task)
                        task.add_done_callback(tasks.discard)
                    if tasks:
                        await asyncio.gather(*tasks)
                finally:
                    # Cancel what is in flight while the HTTP client is still open: closing it first would fail
                    # those requests with transport errors, which would be recorded as the rollouts' failures.
                    self.stopping = True
                    unfinished = list(tasks)
                    for task in unfinished:
                        task.cancel()
                    await asyncio.gather(*unfinished, return_exceptions=True)
        finally:
            self._progress.close()
            if self._failure_log is not None:
                self._failure_log.close()
            log.close()
            # Rewritten even after Ctrl-C: it then holds only rollouts that are still missing from the output.
            write_failures(
                self.failures_file, {key: entry for key, entry in self.failures.items() if key not in self.done}
            )

    async def _one(
        self,
        http: httpx.AsyncClient,
        run_url: str,
        row: InputRow,
        repeat: int,
        log: AppendLog,
        semaphore: asyncio.Semaphore,
    ) -> None:
        key = row.key(repeat)
        rollout_id = row.rollout_id(repeat, self.agent).to_json()
        try:
            record = await _run_one(http, run_url, row.fields, self.timeout)
        except _RolloutFailed as exc:
            if self.stopping:
                return  # interrupted, not failed: the next run runs it
            entry = {
                "rollout_id": rollout_id,
                "reason": str(exc),
                "kind": exc.kind,
                "http_status": exc.http_status,
                "row": row.fields,
            }
            self._record_failure(key, entry, exc)
        else:
            record["rollout_id"] = rollout_id
            log.append(json_line(record))
            self.done.add(key)
            self.failures.pop(key, None)
            self.done_now += 1
            self._progress.finished(failed=False)
        finally:
            # A cancelled rollout (CancelledError passes through) is written nowhere: the next run runs it.
            semaphore.release()

    def _record_failure(self, key: RolloutKey, entry: dict[str, Any], exc: _RolloutFailed) -> None:
        self.failures[key] = entry
        self.failed_now.add(key)
        # Appended now so a killed run still shows why; the end-of-run rewrite drops superseded entries.
        if self._failure_log is None:
            self._failure_log = AppendLog(self.failures_file)
        self._failure_log.append(json_line(entry))
        if len(self.failed_now) <= _SHOWN_FAILURES:
            row_id = entry["rollout_id"]
            self._progress.write(f"ngt collect: rollout row={row_id['row']} repeat={row_id['repeat']} failed: {exc}")
            if len(self.failed_now) == _SHOWN_FAILURES:
                self._progress.write(f"ngt collect: any further failures are reported only in {self.failures_file}")
        self._progress.finished(failed=True)


class _Progress:
    """Progress on stderr: tqdm's bar on a terminal; plain lines otherwise, since a log shows a bar as nothing at all.

    Lines come at each tenth of the run and at least every PROGRESS_LINE_SECONDS while rollouts finish, plus one at
    the start and one at the end, so `ngt collect ... 2>collect.log` can be followed with `tail -f`.
    """

    def __init__(self, *, enabled: bool, total: int, already_done: int) -> None:
        self.total = total
        self.finished_count = already_done  # counts failed rollouts too: they are finished for this run
        self.finished_now = 0
        self.failed = 0
        self.started = self.last_line_at = time.monotonic()
        self.lines = enabled and not _is_terminal(sys.stderr)
        self.bar = tqdm(
            total=total,
            initial=already_done,
            desc="rollouts",
            unit="rollout",
            file=sys.stderr,
            disable=not enabled or self.lines,
            dynamic_ncols=True,
        )
        self.tenth = self._tenth()
        self.shown = already_done
        if self.lines:
            print(
                f"ngt collect: {total - already_done} rollouts to run ({already_done} of {total} already done)",
                file=sys.stderr,
                flush=True,
            )

    def _tenth(self) -> int:
        return self.finished_count * 10 // self.total if self.total else 10

    def finished(self, *, failed: bool) -> None:
        """One rollout finished (written to the output, or to the failures file when `failed`)."""
        self.finished_count += 1
        self.finished_now += 1
        self.bar.update(1)
        if failed:
            self.failed += 1
            self.bar.set_postfix(failed=self.failed, refresh=False)
        if self.lines:
            tenth = self._tenth()
            if tenth > self.tenth or time.monotonic() - self.last_line_at >= PROGRESS_LINE_SECONDS:
                self.tenth = tenth
                self._line()

    def write(self, text: str) -> None:
        """A message on its own line, without breaking the bar."""
        self.bar.write(text, file=sys.stderr)

    def close(self) -> None:
        self.bar.close()
        if self.lines and self.shown != self.finished_count:
            self._line()

    def _line(self) -> None:
        now = time.monotonic()
        elapsed = now - self.started
        rate = self.finished_now / elapsed if elapsed > 0 else 0.0
        percent = 100 * self.finished_count // self.total if self.total else 100
        print(
            f"ngt collect: {self.finished_count}/{self.total} rollouts finished ({percent}%), {self.failed} failed, "
            f"{rate:.2f} rollouts/s, {elapsed:.0f}s elapsed",
            file=sys.stderr,
            flush=True,
        )
        self.last_line_at = now
        self.shown = self.finished_count


def _is_terminal(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream: not a terminal
        return False
