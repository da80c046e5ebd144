"""`ngt collect` over real HTTP against a stand-in agent: completeness, limits, failures, resuming after SIGKILL and
SIGINT, rollouts named by row content, and refusing to resume another input's or agent's output."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from nemo_gym_tok.cli.main import main
from nemo_gym_tok.collect import (
    DEFAULT_HEAD_URL,
    CollectError,
    CollectSummary,
    HeadError,
    ResumeError,
    RolloutId,
    RolloutKey,
    collect,
    failures_path_for,
    repair_output,
    resolve_agent_url,
    row_hash,
)
from nemo_gym_tok.collect.files import lock_output
from nemo_gym_tok.common.net import free_port
from nemo_gym_tok.servers.inprocess import serve_in_thread
from tests.fixtures.collect_agent import AgentBehaviour, create_head_app

NGT = [sys.executable, "-m", "nemo_gym_tok"]


@pytest.fixture
def head_url(agent_url: str) -> Iterator[str]:
    with serve_in_thread(create_head_app({"policy_model": "http://127.0.0.1:1", "my_agent": agent_url})) as url:
        yield url


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


def test_every_row_times_repeats_is_written_once_within_the_concurrency_limit(
    tmp_path: Path, agent_url: str, behaviour: AgentBehaviour
) -> None:
    write_rows(
        tmp_path / "rows.jsonl", [{"id": f"q{i}", "question": f"what is {i}?"} for i in range(5)], blank_lines=True
    )
    behaviour.delay = 0.05

    summary = run_collect(tmp_path, agent_url, repeats=3, concurrency=4)

    assert (summary.done_now, summary.already_done, summary.failed, summary.total) == (15, 0, 0, 15)
    records = read_records(tmp_path / "out.jsonl")
    assert rollout_ids(records) == Counter({(row, repeat): 1 for row in range(5) for repeat in range(3)})
    for record in records:
        row = record["rollout_id"]["row"]
        assert record["id"] == f"q{row}" and record["question"] == f"what is {row}?"  # row index = non-empty lines
        assert record["response"]["output"][0]["content"] == f"answer to q{row}"
    assert behaviour.max_in_flight == 4
    assert len(set(behaviour.sessions)) == 15 and all(behaviour.sessions)  # a fresh session id per rollout
    assert not failures_path_for(tmp_path / "out.jsonl").exists()


def test_limit_takes_the_first_rows_and_a_rerun_without_it_adds_only_the_rest(tmp_path: Path, agent_url: str) -> None:
    write_rows(tmp_path / "rows.jsonl", [{"id": i} for i in range(6)])

    first = run_collect(tmp_path, agent_url, limit=2, repeats=2)
    assert (first.done_now, first.already_done, first.total) == (4, 0, 4)
    assert set(rollout_ids(read_records(tmp_path / "out.jsonl"))) == {(0, 0), (0, 1), (1, 0), (1, 1)}

    second = run_collect(tmp_path, agent_url, repeats=2)
    assert (second.done_now, second.already_done, second.total) == (8, 4, 12)
    ids = rollout_ids(read_records(tmp_path / "out.jsonl"))
    assert ids == Counter({(row, repeat): 1 for row in range(6) for repeat in range(2)})


def test_failed_rollout_goes_to_the_failures_file_and_is_retried_by_the_next_run(
    tmp_path: Path, head_url: str, behaviour: AgentBehaviour, capsys: pytest.CaptureFixture[str]
) -> None:
    rows = [{"id": i} for i in range(4)]
    write_rows(tmp_path / "rows.jsonl", rows)
    output = tmp_path / "out.jsonl"
    failures = failures_path_for(output)
    argv = [
        "collect",
        "--input",
        str(tmp_path / "rows.jsonl"),
        "--output",
        str(output),
        "--agent",
        "my_agent",
        "--head-url",
        head_url,
        "--repeats",
        "2",
    ]
    behaviour.fail_ids = {2}

    assert main(argv) == 1
    out = capsys.readouterr().out
    assert "6 done now, 0 already done, 2 failed, 8 total" in out and str(output) in out
    assert set(rollout_ids(read_records(output))) == {(r, p) for r in (0, 1, 3) for p in (0, 1)}
    entries = read_records(failures)
    assert sorted((e["rollout_id"]["row"], e["rollout_id"]["repeat"]) for e in entries) == [(2, 0), (2, 1)]
    for entry in entries:
        assert entry["row"] == {"id": 2}
        assert "HTTP 500" in entry["reason"] and "environment crashed on row 2" in entry["reason"]

    behaviour.fail_ids = set()
    assert main(argv) == 0
    assert "2 done now, 6 already done, 0 failed, 8 total" in capsys.readouterr().out
    assert rollout_ids(read_records(output)) == Counter({(r, p): 1 for r in range(4) for p in range(2)})
    assert not failures.exists()


def test_bad_agent_answers_and_timeouts_are_failures_with_clear_reasons(tmp_path: Path, agent_url: str) -> None:
    write_rows(
        tmp_path / "rows.jsonl",
        [
            {"id": 0},
            {"id": 1, "mode": "no_response"},
            {"id": 2, "mode": "not_object"},
            {"id": 3, "mode": "not_json"},
            {"id": 4, "sleep": 1.5},
        ],
    )

    summary = run_collect(tmp_path, agent_url, timeout=0.3)

    assert (summary.done_now, summary.failed) == (1, 4)
    reasons = {e["rollout_id"]["row"]: e["reason"] for e in read_records(failures_path_for(tmp_path / "out.jsonl"))}
    assert "no `response` field" in reasons[1] and "reward" in reasons[1]
    assert "JSON list, not a rollout record object" in reasons[2]
    assert "not JSON" in reasons[3] and "proxy error" in reasons[3]
    assert "timed out after 0.3s" in reasons[4]


def test_transport_error_is_a_failure(tmp_path: Path) -> None:
    write_rows(tmp_path / "rows.jsonl", [{"id": 0}])
    summary = run_collect(tmp_path, f"http://127.0.0.1:{free_port()}")
    assert (summary.done_now, summary.failed) == (0, 1)
    [entry] = read_records(failures_path_for(tmp_path / "out.jsonl"))
    assert "transport error" in entry["reason"] and "ConnectError" in entry["reason"]


def test_failures_file_keeps_only_rollouts_still_missing_with_their_latest_reason(
    tmp_path: Path, agent_url: str, behaviour: AgentBehaviour
) -> None:
    write_rows(tmp_path / "rows.jsonl", [{"id": i} for i in range(3)])
    failures = failures_path_for(tmp_path / "out.jsonl")
    stale = [  # from an earlier (killed) run: row 0 now succeeds; row 1 fails again; a torn line is ignored
        {"rollout_id": id_of({"id": 0}, 0), "reason": "old reason 0", "row": {"id": 0}},
        {"rollout_id": id_of({"id": 1}, 1), "reason": "old reason 1", "row": {"id": 1}},
    ]
    failures.write_text("".join(json.dumps(e) + "\n" for e in stale) + '{"rollout_id": {"ro')
    behaviour.fail_ids = {1}

    run_collect(tmp_path, agent_url)

    [entry] = read_records(failures)
    assert entry["rollout_id"] == id_of({"id": 1}, 1) and "environment crashed on row 1" in entry["reason"]


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
        "collect",
        "--input",
        str(tmp_path / "rows.jsonl"),
        "--output",
        str(output),
        "--agent",
        "my_agent",
        "--head-url",
        head_url,
        "--repeats",
        "2",
        "--concurrency",
        "3",
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


def test_input_errors_exit_2_before_anything_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    unreachable = f"http://127.0.0.1:{free_port()}"  # input errors come first, so no head is needed
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"id": 0}\n\n[1, 2]\n')
    argv = [
        "collect",
        "--input",
        str(rows),
        "--output",
        str(tmp_path / "out.jsonl"),
        "--agent",
        "a",
        "--head-url",
        unreachable,
    ]

    assert main(argv) == 2
    assert f"{rows}:3: expected a JSON object, got list" in capsys.readouterr().err

    rows.write_text('{"id": 0}\n{"id": \n')
    assert main(argv) == 2
    assert f"{rows}:2: not valid JSON" in capsys.readouterr().err

    rows.unlink()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"input file not found: {rows}" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out.jsonl").exists()


def test_unknown_agent_lists_known_names(head_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(HeadError, match=r"no server named 'nope' .* \(known: my_agent, policy_model\)"):
        resolve_agent_url(head_url, "nope")
    assert resolve_agent_url(head_url + "/", "my_agent").startswith("http://127.0.0.1:")

    write_rows(tmp_path / "rows.jsonl", [{"id": 0}])
    argv = [
        "collect",
        "--input",
        str(tmp_path / "rows.jsonl"),
        "--output",
        str(tmp_path / "o.jsonl"),
        "--agent",
        "nope",
        "--head-url",
        head_url,
    ]
    assert main(argv) == 2
    assert "known: my_agent, policy_model" in capsys.readouterr().err


def test_unreachable_head_is_a_clear_error_and_the_env_var_sets_the_default(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    unreachable = f"http://127.0.0.1:{free_port()}"
    monkeypatch.setenv("NGT_HEAD_URL", unreachable)
    write_rows(tmp_path / "rows.jsonl", [{"id": 0}])

    code = main(
        [
            "collect",
            "--input",
            str(tmp_path / "rows.jsonl"),
            "--output",
            str(tmp_path / "o.jsonl"),
            "--agent",
            "my_agent",
        ]
    )

    assert code == 2
    err = capsys.readouterr().err
    assert f"cannot reach the head server at {unreachable}" in err and "ngt run" in err


def test_default_head_url_matches_the_launcher() -> None:
    from nemo_gym_tok.servers.launcher import DEFAULT_HEAD_PORT

    assert DEFAULT_HEAD_URL == f"http://127.0.0.1:{DEFAULT_HEAD_PORT}"


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
        "collect",
        "--input",
        str(tmp_path / "rows.jsonl"),
        "--output",
        str(output),
        "--agent",
        "my_agent",
        "--head-url",
        head_url,
        "--repeats",
        "2",
        "--concurrency",
        "3",
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
    argv = ["collect", "--input", str(rows), "--output", str(output), "--agent", "my_agent", "--head-url", head_url]
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
