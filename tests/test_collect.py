"""`ngt collect` over real HTTP against a stand-in agent: every rollout written once, limits, failures and their
retry, bad input refused before anything runs, and the agent found through the head server.
Resuming after a crash or an interrupt is tests/test_collect_resume.py."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from nemo_gym_tok.cli.main import main
from nemo_gym_tok.collect import (
    DEFAULT_HEAD_URL,
    HeadError,
    failures_path_for,
    resolve_agent_url,
)
from nemo_gym_tok.common.net import free_port
from tests.collect_helpers import collect_argv, id_of, read_records, rollout_ids, run_collect, write_rows
from tests.fixtures.collect_agent import AgentBehaviour


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
    argv = collect_argv(tmp_path / "rows.jsonl", output, head_url=head_url, more=["--repeats", "2"])
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


def test_input_errors_exit_2_before_anything_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    unreachable = f"http://127.0.0.1:{free_port()}"  # input errors come first, so no head is needed
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"id": 0}\n\n[1, 2]\n')
    argv = collect_argv(rows, tmp_path / "out.jsonl", agent="a", head_url=unreachable)

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
    argv = collect_argv(tmp_path / "rows.jsonl", tmp_path / "o.jsonl", agent="nope", head_url=head_url)
    assert main(argv) == 2
    assert "known: my_agent, policy_model" in capsys.readouterr().err


def test_unreachable_head_is_a_clear_error_and_the_env_var_sets_the_default(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    unreachable = f"http://127.0.0.1:{free_port()}"
    monkeypatch.setenv("NGT_HEAD_URL", unreachable)
    write_rows(tmp_path / "rows.jsonl", [{"id": 0}])

    code = main(collect_argv(tmp_path / "rows.jsonl", tmp_path / "o.jsonl"))

    assert code == 2
    err = capsys.readouterr().err
    assert f"cannot reach the head server at {unreachable}" in err and "ngt run" in err


def test_default_head_url_matches_the_launcher() -> None:
    from nemo_gym_tok.servers.launcher import DEFAULT_HEAD_PORT

    assert DEFAULT_HEAD_URL == f"http://127.0.0.1:{DEFAULT_HEAD_PORT}"
