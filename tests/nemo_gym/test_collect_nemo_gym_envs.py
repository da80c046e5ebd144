"""`ngt collect` on NeMo Gym 0.7.0's shipped resources servers, and the same rows through NeMo Gym's own simple agent.

NeMo Gym's resources servers run from its installed package (tests/nemo_gym/gym.py); `ngt run`'s launcher points at
each one through an instance with a `url` (a server running elsewhere), beside this project's adapter and simple
agent with `environment_protocol: nemo_gym`; `ngt collect` (the CLI, as a subprocess) collects the rows. Then NeMo
Gym's simple agent, with the same adapter as its model server, runs the same rows against the same resources server.
At temperature 0 both must give each row the same reward, the same model calls and the same output items (text,
tool calls, tool outputs): the model read the same prompts under both agents. Run by `make test-nemo-gym` only.
"""

from __future__ import annotations

import copy
import json
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from nemo_gym_tok.config import load_config
from nemo_gym_tok.records.contiguity import bundled_turns, check_contiguous
from nemo_gym_tok.servers.launcher import Gym
from nemo_gym_tok.vllm_server import VLLMServer
from tests.nemo_gym import gym
from tests.nemo_gym.test_nemo_gym_prefix_backend import ENVIRONMENTS as BACKEND_ENVIRONMENTS

pytestmark = pytest.mark.vllm

ROWS = 15
MAX_STEPS = 4
MODEL_KEY = "policy_model"  # the model instance NeMo Gym's shipped agent configs name
AGENT_KEY = "ngt_agent"
ENV_KEY = "nemo_gym_env"


TABLE: list[str] = []


@pytest.fixture(scope="module", autouse=True)
def print_table() -> Iterator[None]:
    """The per-environment figures as one table once every environment ran (shown with -s, as make runs it)."""
    yield
    header = (
        "| environment | NeMo Gym server | rows | contiguous | model calls (ngt / NeMo Gym's agent) | "
        "rewards equal | verifier fields equal | output items equal |"
    )
    print("\n[ngt collect on NeMo Gym]\n" + "\n".join([header, "|---" * 8 + "|", *TABLE]))


def _session_state_rows(root: Path) -> list[dict[str, Any]]:
    """The counter environment: state under the session cookie, so a lost cookie shows in the counts and rewards."""
    path = root / "resources_servers" / "example_session_state_mgmt" / "data" / "example.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    for row in rows:
        for tool in row["responses_create_params"]["tools"]:
            if tool["name"] == "increment_counter":  # the random model's free integers run to max_tokens
                tool["parameters"]["properties"]["count"]["enum"] = [1, 2, 3, 4, 5]
    # At temperature 0 the model picks increment_counter every time; rows offering only get_counter_value read the
    # seeded count back, which only the session cookie connects to the seed.
    readers = copy.deepcopy(rows[:2])
    for row in readers:
        params = row["responses_create_params"]
        params["tools"] = [tool for tool in params["tools"] if tool["name"] == "get_counter_value"]
    return [*rows[:3], *readers]


def _multi_step_rows(root: Path) -> list[dict[str, Any]]:
    """The synonym environment's rows (enum on the synonym, as the backend test sets it) with the extracted list
    bounded too: at temperature 0 the random model's free integer list runs to max_tokens on every first call."""
    _, _, build_rows, _ = BACKEND_ENVIRONMENTS["example_multi_step"]
    rows = build_rows(root)
    for row in rows:
        for tool in row["responses_create_params"]["tools"]:
            if tool["name"] == "extract_synonym_values":
                values = tool["parameters"]["properties"]["synonym_values"]
                values["items"]["enum"] = [*row["expected_synonym_values"], row["minefield_label_value"]]
                values["maxItems"] = 3
    return rows


# name -> (shipped config, NeMo Gym agent key, row builder, max_output_tokens)
ENVIRONMENTS = {
    **BACKEND_ENVIRONMENTS,
    "example_multi_step": (*BACKEND_ENVIRONMENTS["example_multi_step"][:2], _multi_step_rows, 48),
    "example_session_state_mgmt": (
        "resources_servers/example_session_state_mgmt/configs/example_session_state_mgmt.yaml",
        "example_session_state_mgmt_simple_agent",
        _session_state_rows,
        32,
    ),
}


# Environments `ngt run` starts from NeMo Gym's package (an instance with `nemo_gym_python`), by the key of their
# resources server in NeMo Gym's config (NeMo Gym's agent then reaches that server at the port ngt run gives it);
# the others run under tests/nemo_gym/gym.py and `ngt run` points at them by `url`.
STARTED_BY_NGT = {"example_session_state_mgmt": "example_session_state_mgmt_resources_server"}


def _rows(environment: str) -> list[dict[str, Any]]:
    """ROWS rows: the shipped ones, again with each enum rotated (another prompt, so greedy decoding differs)."""
    _, _, build_rows, max_output_tokens = ENVIRONMENTS[environment]
    base = build_rows(gym.package_root())
    rows = []
    for index in range(ROWS):
        row = copy.deepcopy(base[index % len(base)])
        turn = index // len(base)
        params = row["responses_create_params"]
        for tool in params["tools"]:
            for spec in tool["parameters"]["properties"].values():
                if "enum" in spec:
                    spec["enum"] = spec["enum"][turn:] + spec["enum"][:turn]
        # Every third row leaves the choice to the model: the random model then writes text (no tool call), which
        # NeMo Gym's agent ends the rollout on and the verifiers score apart.
        params.update(
            tool_choice="auto" if index % 3 == 2 else "required",
            parallel_tool_calls=False,
            max_output_tokens=max_output_tokens,
            temperature=0.0,
        )
        rows.append({**row, "row_index": index})
    return rows


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _ngt_config(
    path: Path, server: VLLMServer, impl: str, env: dict[str, Any], adapter_port: int, head_port: int
) -> Path:
    """`ngt run`'s config: our adapter and agent, and the NeMo Gym resources server's instance (`env`: its fields)."""
    config = {
        "head_server": {"host": "127.0.0.1", "port": head_port},
        MODEL_KEY: {
            "responses_api_models": {
                "vllm_model": {
                    "base_url": f"{server.base_url}/v1",
                    "model": server.served_model_name,
                    "return_token_id_information": True,
                    "port": adapter_port,
                }
            }
        },
        ENV_KEY: {"resources_servers": {impl: env}},
        AGENT_KEY: {
            "responses_api_agents": {
                "simple_agent": {
                    "model_server": MODEL_KEY,
                    "resources_server": ENV_KEY,
                    "environment_protocol": "nemo_gym",
                    "max_steps": MAX_STEPS,
                }
            }
        },
    }
    path.write_text(yaml.safe_dump(config))
    return path


def _nemo_gym_overrides(agent_key: str, adapter_port: int) -> dict[str, Any]:
    model = {"entrypoint": "app.py", "host": "127.0.0.1", "port": adapter_port}
    return {
        MODEL_KEY: {"responses_api_models": {"vllm_model": model}},
        agent_key: {"responses_api_agents": {"simple_agent": {"max_steps": MAX_STEPS}}},
    }


def _env_instance(environment: str, overrides: dict[str, Any]) -> tuple[list[str], dict[str, Any]]:
    """The NeMo Gym instances left to `ngt run` and the fields of `ngt run`'s instance for the environment, when
    `ngt run` starts it from the package: NeMo Gym's config then names the port `ngt run` will serve it on."""
    if environment not in STARTED_BY_NGT:
        return [MODEL_KEY], {}
    port = _free_port()
    overrides[STARTED_BY_NGT[environment]] = {"resources_servers": {environment: {"host": "127.0.0.1", "port": port}}}
    return [MODEL_KEY, STARTED_BY_NGT[environment]], {
        "nemo_gym_python": str(gym.NEMO_GYM_PYTHON),
        "domain": "agent",
        "port": port,
    }


def _items(output: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
    """What the model wrote and read, item by item, without ids or token fields."""
    seen: list[tuple[Any, ...]] = []
    for item in output:
        kind = item.get("type", "message")
        if kind == "function_call":
            seen.append((kind, item["name"], item["arguments"]))
        elif kind == "function_call_output":
            seen.append((kind, item["output"]))
        elif kind in ("message", "reasoning"):
            parts = item.get("content") or item.get("summary") or []
            seen.append((kind, "".join(part.get("text", "") for part in parts if isinstance(part, dict))))
        else:
            seen.append((kind,))
    return seen


def _collect(tmp_path: Path, head_url: str, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows_path, output = tmp_path / "rows.jsonl", tmp_path / "rollouts.jsonl"
    rows_path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    finished = subprocess.run(
        [
            sys.executable,
            "-m",
            "nemo_gym_tok",
            "collect",
            "--input",
            str(rows_path),
            "--output",
            str(output),
            "--agent",
            AGENT_KEY,
            "--head-url",
            head_url,
            "--concurrency",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert finished.returncode == 0, finished.stderr[-3000:]
    records = [json.loads(line) for line in output.read_text().splitlines() if line.strip()]
    return sorted(records, key=lambda record: record["row_index"])


@pytest.mark.parametrize("environment", list(ENVIRONMENTS))
def test_collect_nemo_gym_environment(vllm_server: VLLMServer, environment: str, tmp_path: Path) -> None:
    config, agent_key, _, _ = ENVIRONMENTS[environment]
    rows = _rows(environment)
    adapter_port, head_port = _free_port(), _free_port()
    overrides = _nemo_gym_overrides(agent_key, adapter_port)
    external, env = _env_instance(environment, overrides)
    with gym.running_gym([config], overrides, external=external) as nemo:
        if not env:  # a NeMo Gym server running elsewhere: ngt run only gets its URL
            env = {"url": next(s.url for s in nemo.servers.values() if s.kind == "resources_servers")}
        ngt_config = _ngt_config(tmp_path / "ngt.yaml", vllm_server, environment, env, adapter_port, head_port)
        with Gym(load_config([ngt_config])) as ours:
            how = "started by ngt run" if ours.nemo_gym_children else "running elsewhere (url)"
            records = _collect(tmp_path, ours.head_url, rows)
            # NeMo Gym's own agent, one row at a time as the collector ran them, through the same adapter.
            theirs = gym.run_rows(nemo.url(agent_key), rows, concurrency=1)

    assert [r["row_index"] for r in records] == list(range(ROWS))
    broken = []
    for record in records:
        try:
            check_contiguous(bundled_turns(record))
        except ValueError as exc:
            broken.append(f"row {record['row_index']}: {exc}")
    failed = [(r.status, str(r.body)[:300]) for r in theirs if r.status != 200]
    assert not failed, failed
    calls = [len(bundled_turns(record)) for record in records]
    their_calls = [sum(bool(i.get("generation_token_ids")) for i in r.body["response"]["output"]) for r in theirs]
    rewards_equal = sum(record["reward"] == r.body["reward"] for record, r in zip(records, theirs))
    items_equal = sum(
        _items(record["response"]["output"]) == _items(r.body["response"]["output"])
        for record, r in zip(records, theirs)
    )
    # The verifier's own fields (reward, mask_sample, set_overlap, ...): what /verify added to the row and response.
    verdict_keys = set(theirs[0].body) - set(rows[0]) - {"response"}
    verdicts_equal = sum(
        {k: record.get(k) for k in verdict_keys} == {k: r.body.get(k) for k in verdict_keys}
        for record, r in zip(records, theirs)
    )
    tool_outputs = sum(
        item.get("type") == "function_call_output" for record in records for item in record["response"]["output"]
    )
    print(
        f"\n[ngt collect on NeMo Gym {environment}, {how}] rows {ROWS}, contiguous {ROWS - len(broken)}, model calls "
        f"{sum(calls)} (NeMo Gym's agent {sum(their_calls)}), with >= 3 calls {sum(c >= 3 for c in calls)}, "
        f"tool outputs {tool_outputs}, rewards equal {rewards_equal}/{ROWS} (rewards "
        f"{sorted(set(r['reward'] for r in records))}, sum {sum(r['reward'] for r in records):.1f}), "
        f"verifier fields {sorted(verdict_keys)} equal {verdicts_equal}/{ROWS}, output items equal {items_equal}/{ROWS}"
    )
    TABLE.append(
        f"| {environment} | {how} | {ROWS} | {ROWS - len(broken)} | {sum(calls)} / {sum(their_calls)} | "
        f"{rewards_equal} / {ROWS} | {verdicts_equal} / {ROWS} | {items_equal} / {ROWS} |"
    )
    assert not broken, broken
    assert all(record["schema_version"] == 2 and isinstance(record["reward"], float) for record in records)
    # The record keeps the row as it came (NeMo Gym's /verify echoes it re-serialized) and the verifier's fields.
    assert all(
        record["responses_create_params"] == row["responses_create_params"] for record, row in zip(records, rows)
    )
    assert sum(calls) > ROWS and tool_outputs > 0  # tool calls were answered and the episodes went on
    assert calls == their_calls
    assert rewards_equal == ROWS
    assert verdicts_equal == ROWS
    assert items_equal == ROWS
    if environment == "example_single_tool_call":  # rows with and without a tool call: the rewards tell them apart
        assert {record["reward"] for record in records} == {0.0, 1.0}
    if environment == "example_session_state_mgmt":
        checked = [_counter_reads(record) for record in records]
        print(
            f"[ngt collect on NeMo Gym {environment}] counter reads that match the session's seed + increments: "
            f"{sum(len(c) for c in checked)}"
        )
        assert sum(len(c) for c in checked) > 0


def _counter_reads(record: dict[str, Any]) -> list[int]:
    """Each counter value the environment reported, asserted equal to the row's initial_count plus the increments
    before it: the session cookie /seed_session set reached every tool call (without it the count starts at 0)."""
    counter, reads, pending = record["initial_count"], [], None
    for item in record["response"]["output"]:
        if item.get("type") == "function_call":
            pending = item
        elif item.get("type") == "function_call_output" and pending is not None:
            answer = json.loads(item["output"])
            if pending["name"] == "increment_counter" and answer == {"success": True}:
                counter += json.loads(pending["arguments"])["count"]
            elif pending["name"] == "get_counter_value":
                assert answer == {"count": counter}, (record["row_index"], answer, counter)
                reads.append(counter)
    return reads
