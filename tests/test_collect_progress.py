"""`ngt collect` progress without a terminal: plain lines on stderr (done/total, failures, rate), none when disabled."""

from __future__ import annotations

import asyncio
import io
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from nemo_gym_tok.collect import collect, runner
from nemo_gym_tok.servers.inprocess import serve_in_thread
from tests.fixtures.collect_agent import AgentBehaviour, create_head_app

LINE = re.compile(
    r"^ngt collect: (\d+)/(\d+) rollouts finished \((\d+)%\), (\d+) failed, [\d.]+ rollouts/s, \d+s elapsed$"
)


def write_rows(path: Path, count: int) -> Path:
    path.write_text("".join(json.dumps({"id": i, "question": f"q{i}"}) + "\n" for i in range(count)))
    return path


def progress_lines(err: str) -> list[tuple[int, int, int, int]]:
    return [tuple(int(g) for g in match.groups()) for line in err.splitlines() if (match := LINE.match(line))]


def run(tmp_path: Path, agent_url: str, **options: object) -> None:
    asyncio.run(
        collect(tmp_path / "rows.jsonl", tmp_path / "out.jsonl", agent_url, concurrency=1, timeout=30.0, **options)
    )


def test_without_a_terminal_each_tenth_of_the_run_is_a_plain_line(
    tmp_path: Path, agent_url: str, behaviour: AgentBehaviour, capsys: pytest.CaptureFixture[str]
) -> None:
    write_rows(tmp_path / "rows.jsonl", 20)
    behaviour.fail_ids = {3}

    run(tmp_path, agent_url)

    err = capsys.readouterr().err
    assert "ngt collect: 20 rollouts to run (0 of 20 already done)" in err
    assert "\r" not in err  # no bar redrawn in place: a log would hold it as one unreadable line
    lines = progress_lines(err)
    # concurrency 1: every second rollout is a new tenth, so one line each, the last one the complete run
    assert [done for done, *_ in lines] == list(range(2, 21, 2))
    assert lines[-1] == (20, 20, 100, 1)
    assert [failed for *_, failed in lines][:2] == [0, 1]  # row 3 failed while the 4th rollout finished


def test_lines_come_at_least_every_interval_between_tenths(
    tmp_path: Path, agent_url: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    write_rows(tmp_path / "rows.jsonl", 100)
    write_rows(tmp_path / "first.jsonl", 50)
    # Half of the rows already done: the count starts there, and the rate counts only this run's rollouts.
    asyncio.run(collect(tmp_path / "first.jsonl", tmp_path / "half.jsonl", agent_url, progress=False))
    (tmp_path / "out.jsonl").write_bytes((tmp_path / "half.jsonl").read_bytes())
    monkeypatch.setattr(runner, "PROGRESS_LINE_SECONDS", 0.0)

    run(tmp_path, agent_url)

    err = capsys.readouterr().err
    assert "ngt collect: 50 rollouts to run (50 of 100 already done)" in err
    assert [done for done, *_ in progress_lines(err)] == list(range(51, 101))


def test_no_lines_when_progress_is_off(tmp_path: Path, agent_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    write_rows(tmp_path / "rows.jsonl", 5)

    run(tmp_path, agent_url, progress=False)

    assert capsys.readouterr().err == ""


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_on_a_terminal_it_is_the_bar_not_lines(tmp_path: Path, agent_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    write_rows(tmp_path / "rows.jsonl", 5)
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)

    run(tmp_path, agent_url)

    shown = terminal.getvalue()
    assert "5/5" in shown and "rollouts" in shown and "\r" in shown  # tqdm's bar, redrawn in place
    assert not progress_lines(shown) and "rollouts to run" not in shown


def test_ngt_collect_with_stderr_to_a_file_logs_progress(tmp_path: Path, agent_url: str) -> None:
    rows = write_rows(tmp_path / "rows.jsonl", 4)
    with serve_in_thread(create_head_app({"my_agent": agent_url})) as head_url:
        finished = subprocess.run(
            [
                sys.executable,
                "-m",
                "nemo_gym_tok",
                "collect",
                "--input",
                str(rows),
                "--output",
                str(tmp_path / "out.jsonl"),
                "--agent",
                "my_agent",
                "--head-url",
                head_url,
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert finished.returncode == 0, finished.stderr
    assert progress_lines(finished.stderr)[-1] == (4, 4, 100, 0)
