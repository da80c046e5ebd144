"""Writes an `ngt collect` output as NeMo Gym rollout files: the rows file and its `<stem>_failures.jsonl` sidecar."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nemo_gym_tok.collect.collect_errors import CollectError
from nemo_gym_tok.collect.files import failures_path_for, json_line, read_failures, write_atomically
from nemo_gym_tok.collect.nemo_gym_rows import ExportError, nemo_gym_export
from nemo_gym_tok.common.jsonl import scan_jsonl


def nemo_gym_failures_path_for(rows_path: str | os.PathLike[str]) -> Path:
    """`rollouts.jsonl` -> `rollouts_failures.jsonl`: where NeMo Gym's collection puts a rows file's failures."""
    path = Path(rows_path)
    return path.with_name(path.stem + "_failures.jsonl")


@dataclass(frozen=True)
class ExportSummary:
    """What one export wrote."""

    rows: int
    failures: int
    rows_path: Path
    failures_path: Path

    def line(self) -> str:
        """The one-line summary `ngt export-nemo-gym` prints."""
        text = f"export-nemo-gym: {self.rows} rollout rows -> {self.rows_path}"
        if self.failures:
            text += f"; {self.failures} failed rollouts -> {self.failures_path}"
        return text


def export_nemo_gym(
    input_path: str | os.PathLike[str],
    output_path: str | os.PathLike[str],
    *,
    agent: str | None = None,
    repeats: int | None = None,
) -> ExportSummary:
    """Convert `input_path` (an `ngt collect` output) and its `.failures.jsonl` into NeMo Gym's rows + sidecar.

    Both files are replaced whole (temp file + rename), after every record converted: a bad record leaves nothing
    written. A sidecar left from an earlier export is removed when no rollout failed. Raises CollectError saying
    which file and line to fix.
    """
    source, target = Path(input_path), Path(output_path)
    ours = failures_path_for(source)
    sidecar = nemo_gym_failures_path_for(target)
    for path in (target, sidecar):
        if path.exists() and path.resolve() in (source.resolve(), ours.resolve()):
            raise CollectError(f"the export would overwrite its input {path}: choose another output")
    records, labels = _read_records(source)
    failures = list(read_failures(ours).values())
    failure_labels = [
        f"{ours} (row {e['rollout_id'].get('row')}, repeat {e['rollout_id'].get('repeat')})" for e in failures
    ]
    try:
        export = nemo_gym_export(
            records, failures, agent=agent, repeats=repeats, record_labels=labels, failure_labels=failure_labels
        )
    except ExportError as exc:
        raise CollectError(str(exc)) from None
    target.parent.mkdir(parents=True, exist_ok=True)
    # The sidecar first: a kill between the two renames leaves new failures beside old rows, which a rerun mends,
    # rather than new rows beside a sidecar that still lists rollouts they hold.
    if export.failure_rows:
        write_atomically(sidecar, b"".join(json_line(row) for row in export.failure_rows))
    else:
        sidecar.unlink(missing_ok=True)
    write_atomically(target, b"".join(json_line(row) for row in export.rows))
    return ExportSummary(len(export.rows), len(export.failure_rows), target, sidecar)


def _read_records(path: Path) -> tuple[list[dict[str, Any]], list[str]]:
    records: list[dict[str, Any]] = []
    labels: list[str] = []
    try:
        lines = scan_jsonl(path)
    except FileNotFoundError:
        raise CollectError(f"input file not found: {path}") from None
    except OSError as exc:
        raise CollectError(f"cannot read {path}: {exc.strerror or exc}") from None
    for line in lines:
        if not line.terminated:  # a collector's output ends in whole lines once its `ngt collect` has resumed
            raise CollectError(
                f"{path}:{line.number}: the last line is incomplete (a collection killed "
                "mid-write): rerun its `ngt collect`, which repairs the file, then export"
            )
        if line.value is None:
            raise CollectError(str(line.error()))
        records.append(line.value)
        labels.append(f"{path}:{line.number}")
    return records, labels
