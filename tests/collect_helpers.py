"""What the `ngt collect` tests share: input rows written, output records read back, and a collection run."""

from __future__ import annotations

import asyncio
import json
import sys
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from nemo_gym_tok.collect import CollectSummary, RolloutId, RolloutKey, collect, row_hash

NGT = [sys.executable, "-m", "nemo_gym_tok"]


def write_rows(path: Path, rows: list[Any], *, blank_lines: bool = False) -> Path:
    lines = [json.dumps(row) for row in rows]
    if blank_lines:  # blank lines do not count as rows
        lines = [line for pair in zip(lines, [""] * len(lines)) for line in pair]
    path.write_text("\n".join(lines) + "\n")
    return path


def read_records(path: Path) -> list[dict[str, Any]]:
    data = path.read_bytes()
    assert not data or data.endswith(b"\n"), "output must end with a complete line"
    return [json.loads(line) for line in data.splitlines()]


def rollout_ids(records: list[dict[str, Any]]) -> Counter[tuple[int, int]]:
    return Counter((r["rollout_id"]["row"], r["rollout_id"]["repeat"]) for r in records)


def rollout_keys(records: list[dict[str, Any]]) -> Counter[RolloutKey]:
    return Counter(RolloutId.from_json(r["rollout_id"]).key for r in records)


def id_of(row: dict[str, Any], index: int, repeat: int = 0, agent: str | None = None) -> dict[str, Any]:
    """The rollout_id `ngt collect` writes for the first occurrence of `row`, at `index` in the input."""
    return RolloutId(RolloutKey(row_hash(row), 0, repeat), index, agent).to_json()


def run_collect(tmp_path: Path, agent_url: str, **kwargs: Any) -> CollectSummary:
    options = {"concurrency": 8, "limit": None, "repeats": 1, "timeout": 30.0, "progress": False, **kwargs}
    return asyncio.run(collect(tmp_path / "rows.jsonl", tmp_path / "out.jsonl", agent_url, **options))


def collect_argv(
    rows: Path, output: Path, *, agent: str = "my_agent", head_url: str | None = None, more: Sequence[str] = ()
) -> list[str]:
    """`ngt collect`'s arguments: `rows` into `output` by `agent`, looked up through `head_url` when one is given."""
    head = ["--head-url", head_url] if head_url else []
    return ["collect", "--input", str(rows), "--output", str(output), "--agent", agent, *head, *more]
