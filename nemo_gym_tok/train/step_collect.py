"""One training step's episodes through the gym's collector: the rows to an input file, `ngt collect`'s loop against
the agent's /run, the records back in the rows' order."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from nemo_gym_tok.collect import collect, failures_path_for, read_failures
from nemo_gym_tok.common.jsonl import read_jsonl

INPUT_SUFFIX = ".input.jsonl"


class CollectFailedError(RuntimeError):
    """Some of a step's rollouts failed: a step is trained on all its episodes or none."""


def collect_step(
    rows: Sequence[dict[str, Any]],
    output: Path,
    agent_url: str,
    *,
    agent: str | None = None,
    concurrency: int | None = None,
    timeout: float = 600.0,
    auth_token: str | None = None,
) -> list[dict[str, Any]]:
    """One rollout record per row, in the rows' order (a row may repeat: each occurrence is its own episode), written
    to `output` (a new JSONL file; its input rows beside it). Raises CollectFailedError with the failures' reasons."""
    if output.exists():
        raise FileExistsError(f"{output} exists: each step collects into a new file")
    output.parent.mkdir(parents=True, exist_ok=True)
    input_path = output.with_name(output.name.removesuffix(".jsonl") + INPUT_SUFFIX)
    input_path.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows), encoding="utf-8")
    summary = asyncio.run(
        collect(
            input_path,
            output,
            agent_url,
            agent=agent,
            concurrency=concurrency or len(rows),
            timeout=timeout,
            progress=False,
            auth_token=auth_token,
        )
    )
    if summary.failed:
        reasons = [str(entry.get("reason") or entry) for entry in read_failures(failures_path_for(output)).values()]
        raise CollectFailedError(
            f"{summary.failed} of {len(rows)} rollouts failed (see {failures_path_for(output)}): "
            + " | ".join(reasons[:3])
        )
    records = read_jsonl(output)
    records.sort(key=lambda record: int(record["rollout_id"]["row"]))
    if [record["rollout_id"]["row"] for record in records] != list(range(len(rows))):
        raise CollectFailedError(f"{output} holds {len(records)} records for {len(rows)} rows")
    return records
