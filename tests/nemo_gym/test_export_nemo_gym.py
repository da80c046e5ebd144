"""Point 5 of issue 20, live: `ngt collect --nemo-gym-output` over the demo environments on the hooked vLLM gives rows
that NeMo RL's contiguity rule accepts (the schema-2 records it refuses with KeyError 'prompt_token_ids') and that
NeMo Gym 0.7.0's own models validate, 100%, with a failures sidecar NeMo Gym reads. Run by `make test-nemo-gym`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from nemo_gym_tok.collect import failures_path_for, nemo_gym_failures_path_for
from nemo_gym_tok.records.contiguity import check_file
from nemo_gym_tok.vllm_server import VLLMServer
from tests.nemo_gym import gym
from tests.nemo_gym.nemo_rl_rule import check_rollout

REPO = Path(__file__).resolve().parents[2]
NGT = [sys.executable, "-m", "nemo_gym_tok"]
VALIDATOR = Path(__file__).with_name("validate_rows.py")
ENVIRONMENTS = ("capital_lookup", "grid_navigation", "number_guess")
LIMIT, REPEATS = 3, 2
BAD_ROW = {"responses_create_params": {"tools": []}}
"""A row without `input`: the agent answers 400, so the collection has a failure for the sidecar."""


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def start_gym(vllm_url: str) -> tuple[subprocess.Popen[str], str]:
    """`ngt run` on configs/demo.yaml as a user starts it; returns the process and the head URL."""
    process = subprocess.Popen(
        [
            *NGT,
            "run",
            "-c",
            str(REPO / "configs" / "demo.yaml"),
            "--set",
            f"policy_base_url={vllm_url}/v1",
            "--set",
            "policy_model_name=tiny-qwen3",
            "--set",
            "head_server.port=0",
        ],
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    assert process.stdout is not None
    urls: dict[str, str] = {}
    for line in process.stdout:
        if line.startswith("all servers healthy"):
            return process, urls["head"]
        name, _, url = line.strip().partition(": ")
        urls[name] = url
    raise AssertionError(f"ngt run exited before its servers were healthy ({process.wait()})")


@pytest.fixture(scope="module")
def collection(vllm_server: VLLMServer, tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    """Each demo environment collected by `ngt collect --nemo-gym-output`: {environment: (records, rows)}."""
    folder = tmp_path_factory.mktemp("export")
    process, head = start_gym(vllm_server.base_url)
    files = {}
    try:
        for environment in ENVIRONMENTS:
            examples = read_jsonl(REPO / "resources_servers" / environment / "data" / "example.jsonl")[:LIMIT]
            rows = folder / f"{environment}_rows.jsonl"
            rows.write_text("".join(json.dumps(r) + "\n" for r in [*examples, BAD_ROW]))
            records, exported = folder / f"{environment}.jsonl", folder / f"{environment}_nemo_gym.jsonl"
            done = subprocess.run(
                [
                    *NGT,
                    "collect",
                    "--input",
                    str(rows),
                    "--output",
                    str(records),
                    "--agent",
                    f"{environment}_agent",
                    "--head-url",
                    head,
                    "--repeats",
                    str(REPEATS),
                    "--concurrency",
                    "4",
                    "--timeout",
                    "600",
                    "--nemo-gym-output",
                    str(exported),
                ],
                capture_output=True,
                text=True,
                timeout=1200,
            )
            print(done.stdout.strip())
            assert done.returncode == 1, done.stderr[-3000:]  # the bad row's rollouts failed, and only those
            assert f"{LIMIT * REPEATS} done now, 0 already done, {REPEATS} failed" in done.stdout, done.stdout
            files[environment] = (records, exported)
    finally:
        process.terminate()
        process.wait(timeout=60)
    return files


def validate_with_nemo_gym(rows: list[dict[str, Any]], failure_rows: list[dict[str, Any]]) -> dict[str, Any]:
    out = subprocess.run(
        [str(gym.NEMO_GYM_PYTHON), str(VALIDATOR)],
        capture_output=True,
        text=True,
        input=json.dumps({"rows": rows, "failure_rows": failure_rows}),
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout)


def test_nemo_rl_rule_refuses_the_records_and_accepts_every_exported_row(
    collection: dict[str, tuple[Path, Path]],
) -> None:
    rows_total = calls = long_rollouts = refused = 0
    for environment, (records_path, rows_path) in collection.items():
        records, rows = read_jsonl(records_path), read_jsonl(rows_path)
        assert len(rows) == len(records) == LIMIT * REPEATS
        for record in records:
            with pytest.raises(KeyError, match="prompt_token_ids"):  # what NeMo RL meets in a schema 2 record
                check_rollout(record)
            refused += 1
        assert check_file(records_path).ok  # contiguous as collected: the export must keep it so
        for row in rows:
            result = check_rollout(row)
            assert result.contiguous, (environment, row["rollout_id"], result.first_break)
            assert result.model_calls == row["response"]["model_calls"] >= 1
            calls += result.model_calls
            long_rollouts += result.model_calls >= 3
        assert sorted((r["_ng_task_index"], r["_ng_rollout_index"]) for r in rows) == [
            (task, repeat) for task in range(LIMIT) for repeat in range(REPEATS)
        ]
        rows_total += len(rows)
    print(
        f"\nNeMo RL's rule: {rows_total}/{rows_total} exported rows contiguous ({calls} model calls, "
        f"{long_rollouts} rollouts of 3+ calls); {refused}/{refused} schema-2 records refused with "
        "KeyError 'prompt_token_ids'"
    )
    assert long_rollouts > 0


def test_nemo_gym_validates_every_exported_row_and_reads_the_sidecar(
    collection: dict[str, tuple[Path, Path]],
) -> None:
    validated = total = 0
    for environment, (records_path, rows_path) in collection.items():
        rows = read_jsonl(rows_path)
        sidecar = read_jsonl(nemo_gym_failures_path_for(rows_path))
        report = validate_with_nemo_gym(rows, sidecar)
        assert report["failures"] == [], report["failures"][:2]
        assert report["validated"] == report["total"] == len(rows) > 0
        # NeMo Gym's own scoring over the rows: the same mean reward as the verifier gave each rollout.
        mean = sum(r["reward"] for r in rows) / len(rows)
        assert report["aggregate"]["mean/reward"] == pytest.approx(mean)
        # The bad row: one sidecar row per repeat, as an agent error NeMo Gym retries on resume.
        assert report["sidecar_valid"] == report["sidecar_total"] == REPEATS and report["sidecar_terminal"] == 0
        assert {(s["_ng_task_index"], s["_ng_failure_class"], s["_ng_failure_http_status"]) for s in sidecar} == {
            (LIMIT, "agent_run_error", 400)
        }
        assert len(read_jsonl(failures_path_for(records_path))) == REPEATS
        validated += report["validated"]
        total += report["total"]
    # The records as collected do not validate: what the export adds is what NeMo Gym needs.
    records = read_jsonl(collection[ENVIRONMENTS[0]][0])
    assert validate_with_nemo_gym(records, [])["validated"] == 0
    # And a bundle missing its log probs is caught, item by item, by NeMo Gym's training-item models.
    rows = read_jsonl(collection[ENVIRONMENTS[0]][1])
    next(item for item in rows[0]["response"]["output"] if "generation_token_ids" in item).pop("generation_log_probs")
    broken = validate_with_nemo_gym(rows, [])
    assert broken["validated"] == len(rows) - 1 and "generation_log_probs" in broken["failures"][0]["error"]
    print(
        f"\nNeMo Gym 0.7.0 validated {validated}/{total} exported rows ({100 * validated / total:.0f}%) as "
        "BaseVerifyResponse (NeMoGymResponse inside) with _ng_task_index, _ng_rollout_index and agent_ref; "
        f"its sidecars read {REPEATS * len(collection)} failures"
    )
