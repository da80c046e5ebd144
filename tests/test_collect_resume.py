"""`ngt collect` resuming over real HTTP against a stand-in agent: a torn last line repaired, SIGKILL and SIGINT at any
moment then a rerun leave each rollout once, one collector per output, rollouts named by row content, and refusing to
resume another input's or agent's output."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from nemo_gym_tok.cli.main import main
from nemo_gym_tok.collect import (
    CollectError,
    ResumeError,
    RolloutId,
    RolloutKey,
    collect,
    failures_path_for,
    repair_output,
    row_hash,
)
from nemo_gym_tok.collect.files import lock_output
from tests.collect_helpers import (
    NGT,
    collect_argv,
    id_of,
    read_records,
    rollout_ids,
    rollout_keys,
    run_collect,
    write_rows,
)
from tests.fixtures.collect_agent import AgentBehaviour


def test_truncated_last_line_is_repaired_on_start(
    tmp_path: Path, agent_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    write_rows(tmp_path / "rows.jsonl", [{"id": i} for i in range(4)])
    output = tmp_path / "out.jsonl"
    complete = [{"id": i, "response": {}, "rollout_id": id_of({"id": i}, i)} for i in (0, 1)]
    torn = json.dumps({"id": 2, "response": {}, "rollout_id": id_of({"id": 2}, 2)})[:25]
    output.write_text("".join(json.dumps(r) + "\n" for r in complete) + torn)

    summary = run_collect(tmp_path, agent_url)

    assert "truncated it back to the last complete line" in capsys.readouterr().err
    assert (summary.done_now, summary.already_done) == (2, 2)
    records = read_records(output)
    assert records[:2] == complete
    assert rollout_ids(records) == Counter({(i, 0): 1 for i in range(4)})


def test_repair_output_cuts_only_the_torn_tail_and_rejects_a_bad_middle_line(tmp_path: Path) -> None:
    output = tmp_path / "out.jsonl"
    first = id_of({"id": 0}, 0)
    good = (json.dumps({"rollout_id": first, "response": {}}) + "\n").encode()
    output.write_bytes(good + b'{"rollout_id": {"row": 1, "repeat": 0}, "resp')
    assert repair_output(output) == ([RolloutId.from_json(first)], True)
    assert output.read_bytes() == good
    assert repair_output(output) == ([RolloutId.from_json(first)], False)

    output.write_bytes(good + b"garbage\n" + good)
    with pytest.raises(CollectError, match=r"out.jsonl:2: not valid JSON"):
        repair_output(output)

    # A complete last line is never a torn one: a record of an older, index-only collector is refused, not cut.
    output.write_bytes(good + b'{"rollout_id": {"row": 1, "repeat": 0}, "response": {}}\n')
    with pytest.raises(CollectError, match=r"out.jsonl:2: .*older ngt collect"):
        repair_output(output)


def test_sigkill_at_any_moment_then_rerun_leaves_every_rollout_exactly_once(
    tmp_path: Path, head_url: str, behaviour: AgentBehaviour
) -> None:
    total = 12 * 2
    write_rows(tmp_path / "rows.jsonl", [{"id": i, "pad": "x" * 20_000 * (i % 3)} for i in range(12)])
    output = tmp_path / "out.jsonl"
    behaviour.delay = 0.15
    command = [
        *NGT,
        *collect_argv(
            tmp_path / "rows.jsonl", output, head_url=head_url, more=["--repeats", "2", "--concurrency", "3"]
        ),
    ]

    seen_before_kill = []
    for _ in range(2):  # two kill / rerun cycles, each killed after some but not all lines
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                lines = output.read_bytes().count(b"\n") if output.exists() else 0
                if lines >= 2 + len(seen_before_kill) * 2 or process.poll() is not None:
                    break
                time.sleep(0.005)
            assert process.poll() is None, "collect finished before it could be killed"
            process.send_signal(signal.SIGKILL)
            process.wait(timeout=10)
        finally:
            if process.poll() is None:
                process.kill()
        data = output.read_bytes()
        seen_before_kill.append(data.count(b"\n"))
        assert 2 <= seen_before_kill[-1] < total

    finished = subprocess.run(command, capture_output=True, text=True, timeout=60)

    assert finished.returncode == 0, finished.stderr
    assert f"0 failed, {total} total" in finished.stdout
    records = read_records(output)  # every line parses
    assert rollout_ids(records) == Counter({(r, p): 1 for r in range(12) for p in range(2)})
    assert all(rec["pad"] == "x" * 20_000 * (rec["id"] % 3) for rec in records)


def test_a_second_collector_on_the_same_output_is_refused(tmp_path: Path, agent_url: str) -> None:
    write_rows(tmp_path / "rows.jsonl", [{"id": 0}])
    lock = lock_output(tmp_path / "out.jsonl")
    try:
        with pytest.raises(CollectError, match="another `ngt collect` is writing"):
            run_collect(tmp_path, agent_url)
    finally:
        os.close(lock)


def test_sigint_drops_the_rollouts_in_flight_and_a_resume_runs_each_rollout_once(
    tmp_path: Path, head_url: str, behaviour: AgentBehaviour
) -> None:
    rows = 24  # about 5 s of work at this delay and concurrency: the interrupt lands mid-run even on a loaded machine
    total = rows * 2
    write_rows(tmp_path / "rows.jsonl", [{"id": i} for i in range(rows)])
    output = tmp_path / "out.jsonl"
    behaviour.delay = 0.3
    command = [
        *NGT,
        *collect_argv(
            tmp_path / "rows.jsonl", output, head_url=head_url, more=["--repeats", "2", "--concurrency", "3"]
        ),
    ]

    # As from a terminal: a shell that starts a job in the background (CI's does) has it ignore SIGINT, and Python
    # keeps an inherited SIG_IGN instead of raising KeyboardInterrupt.
    process = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        deadline = time.monotonic() + 30
        # Interrupt once some rollouts are written and others are in flight at the agent.
        while not (output.exists() and output.read_bytes().count(b"\n") >= 2 and behaviour.in_flight >= 2):
            assert process.poll() is None and time.monotonic() < deadline, "no moment with rollouts in flight"
            time.sleep(0.005)
        process.send_signal(signal.SIGINT)
        _, stderr = process.communicate(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()

    assert process.returncode == 130, stderr
    assert "in flight were dropped (not failures)" in stderr
    assert not failures_path_for(output).exists()  # an interrupted rollout is no failure
    interrupted = read_records(output)
    assert 2 <= len(interrupted) < total and max(rollout_ids(interrupted).values()) == 1

    finished = subprocess.run(command, capture_output=True, text=True, timeout=60)

    assert finished.returncode == 0, finished.stderr
    assert f"{total - len(interrupted)} done now, {len(interrupted)} already done, 0 failed" in finished.stdout
    assert rollout_ids(read_records(output)) == Counter({(r, p): 1 for r in range(rows) for p in range(2)})
    assert not failures_path_for(output).exists()


def test_a_cancelled_collect_records_its_rollouts_in_flight_nowhere(
    tmp_path: Path, agent_url: str, behaviour: AgentBehaviour
) -> None:
    write_rows(tmp_path / "rows.jsonl", [{"id": i} for i in range(4)])
    behaviour.delay = 5.0
    options: dict[str, Any] = {"agent": "my_agent", "concurrency": 4, "timeout": 30.0, "progress": False}

    async def cancel_while_running() -> None:
        task = asyncio.create_task(collect(tmp_path / "rows.jsonl", tmp_path / "out.jsonl", agent_url, **options))
        while behaviour.in_flight < 4:
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(cancel_while_running())

    assert (tmp_path / "out.jsonl").read_bytes() == b""
    assert not failures_path_for(tmp_path / "out.jsonl").exists()


def test_repeated_rows_stay_distinct_and_added_or_reordered_rows_resume_by_content(
    tmp_path: Path, agent_url: str, behaviour: AgentBehaviour
) -> None:
    same, other = {"question": "2+2?"}, {"question": "3+3?"}
    write_rows(tmp_path / "rows.jsonl", [same, same, other])

    first = run_collect(tmp_path, agent_url, agent="my_agent", repeats=2)

    assert (first.done_now, first.total) == (6, 6)
    records = read_records(tmp_path / "out.jsonl")
    assert rollout_keys(records) == Counter(
        {
            RolloutKey(row_hash(row), occurrence, repeat): 1
            for row, occurrence in ((same, 0), (same, 1), (other, 0))
            for repeat in (0, 1)
        }
    )
    assert {r["rollout_id"]["agent"] for r in records} == {"my_agent"}

    # A row inserted at the top and the others reordered: only the new row runs.
    new = {"question": "4+4?"}
    write_rows(tmp_path / "rows.jsonl", [new, other, same, same])
    behaviour.sessions.clear()

    second = run_collect(tmp_path, agent_url, agent="my_agent", repeats=2)

    assert (second.done_now, second.already_done, second.total) == (2, 6, 8)
    records = read_records(tmp_path / "out.jsonl")
    assert sum(rollout_keys(records).values()) == 8 and max(rollout_keys(records).values()) == 1
    assert [r["question"] for r in records[-2:]] == ["4+4?", "4+4?"]
    assert [r["rollout_id"]["row"] for r in records[-2:]] == [0, 0]  # `row` is the index when written
    assert len(behaviour.sessions) == 2


def test_resuming_with_a_changed_input_or_another_agent_is_refused(
    tmp_path: Path, head_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    rows = write_rows(tmp_path / "rows.jsonl", [{"id": i, "question": f"q{i}"} for i in range(3)])
    output = tmp_path / "out.jsonl"
    argv = collect_argv(rows, output, head_url=head_url)
    assert main(argv) == 0
    capsys.readouterr()
    collected = output.read_bytes()

    write_rows(rows, [{"id": 0, "question": "q0"}, {"id": 1, "question": "edited"}, {"id": 2, "question": "q2"}])
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"ngt collect: {output} holds 1 rollout(s) of rows that are not in")
    assert "collect into another --output" in err
    assert output.read_bytes() == collected  # nothing appended, nothing truncated

    write_rows(rows, [{"id": i, "question": f"q{i}"} for i in range(3)])
    with pytest.raises(ResumeError, match=r"holds rollouts of agent 'my_agent', not 'other_agent'"):
        run_collect(tmp_path, "http://127.0.0.1:1", agent="other_agent")
    assert output.read_bytes() == collected
