"""NeMo Gym 0.7.0's own vllm_model, simple_agent and resources servers on `ngt vllm-serve`: contiguous rollouts.

Run by `make test-nemo-gym` only (tests/nemo_gym is in pyproject's norecursedirs): it needs .venv-nemo-gym.
Two token modes: bundles on every assistant message (`return_token_id_information`), and NeMo Gym's
`supply_prefix_token_ids` with training-token capture (a rollout id per row), where NeMo Gym sends the parent call's
ids as `required_prefix_token_ids` and checks the answer starts with them.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.nemo_gym import gym
from tests.nemo_gym.nemo_rl_rule import check_collection

pytestmark = pytest.mark.vllm

MODEL_CONFIG = "responses_api_models/vllm_model/configs/vllm_model_for_training.yaml"
SUPPLY_CONFIG = "responses_api_models/vllm_model/configs/vllm_model_supply_prefix.yaml"
ROWS_PER_CASE = 16
SEED_BASE = 1000
MAX_STEPS = 4  # simple_agent's own cap on model calls per rollout
# A city name longer than max_output_tokens: a call that picks it is cut by max_tokens (and simple_agent then ends
# the rollout, as it does on any incomplete answer).
LONG_CITY = "Llanfairpwllgwyngyllgogerychwyrndrobwllllantysiliogogogoch " * 3


def _single_tool_call_rows(root: Path) -> list[dict[str, Any]]:
    rows = _shipped_rows(root, "example_single_tool_call")
    out = []
    for row in rows:
        params = copy.deepcopy(row["responses_create_params"])
        # The random tiny model writes free strings until max_tokens; an enum keeps the call a real, short one.
        for tool in params["tools"]:
            tool["parameters"]["properties"]["city"]["enum"] = ["sf", "nyc", "paris", LONG_CITY]
        out.append({**row, "responses_create_params": params})
    return out


def _multi_step_rows(root: Path) -> list[dict[str, Any]]:
    out = []
    for row in _shipped_rows(root, "example_multi_step"):
        params = copy.deepcopy(row["responses_create_params"])
        for tool in params["tools"]:
            if tool["name"] == "get_synonym_value":
                choices = [*row["expected_synonyms"], row["minefield_label"]]
                tool["parameters"]["properties"]["synonym"]["enum"] = choices
        # extract_synonym_values keeps its free integer list: the random model's lists run past max_tokens at times.
        out.append({**row, "responses_create_params": params})
    return out


def _shipped_rows(root: Path, server: str) -> list[dict[str, Any]]:
    path = root / "resources_servers" / server / "data" / "example.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# name -> (shipped config, agent instance key, row builder, max_output_tokens)
ENVIRONMENTS = {
    "example_single_tool_call": (
        "resources_servers/example_single_tool_call/configs/example_single_tool_call.yaml",
        "example_single_tool_call_simple_agent",
        _single_tool_call_rows,
        40,
    ),
    # Multi-step tool calling (get_synonym_value per synonym, then extract_synonym_values); pure Python, no hub data.
    "example_multi_step": (
        "resources_servers/example_multi_step/configs/example_multi_step.yaml",
        "example_multi_step_simple_agent",
        _multi_step_rows,
        48,
    ),
}


def seeded(index: int) -> dict[str, str]:
    """A per-row sampling seed the way NeMo Gym sends one (its `num_repeats_add_seed`): `metadata.extra_body`, a JSON
    string its vllm_model merges into the vLLM request. Seeded rows sample the same every run, so the counts this
    test asserts on (long rollouts, cut calls) do not move from run to run."""
    return {"extra_body": json.dumps({"seed": SEED_BASE + index})}


def vllm_metrics(base_url: str) -> dict[str, float]:
    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    return {
        line.split()[0]: float(line.split()[1])
        for line in text.splitlines()
        if line.startswith("nemo_gym_tok_prefix_splice") and "_total " in line
    }


def _overrides(vllm_server: Any, agent_key: str, mode: str, capture_dir: Path) -> dict[str, Any]:
    agent = {"max_steps": MAX_STEPS}
    overrides: dict[str, Any] = {
        "policy_base_url": f"{vllm_server.base_url}/v1",
        "policy_api_key": "unused",
        "policy_model_name": vllm_server.served_model_name,
    }
    if mode == "supply_prefix":
        agent["token_id_capture"] = True
        overrides["token_id_capture"] = {"enabled": True, "dir": str(capture_dir)}
    overrides[agent_key] = {"responses_api_agents": {"simple_agent": agent}}
    return overrides


def _transport_events(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.mark.parametrize("mode", ["bundles", "supply_prefix"])
@pytest.mark.parametrize("environment", list(ENVIRONMENTS))
def test_rollouts_contiguous(vllm_server: Any, environment: str, mode: str, tmp_path: Path) -> None:
    config, agent_key, build_rows, max_output_tokens = ENVIRONMENTS[environment]
    root = gym.package_root()
    base = build_rows(root)
    rows = []
    for index in range(ROWS_PER_CASE):
        row = copy.deepcopy(base[index % len(base)])
        row["responses_create_params"].update(
            tool_choice="required",
            parallel_tool_calls=False,
            max_output_tokens=max_output_tokens,
            temperature=1.0,
            metadata=seeded(index),
        )
        if mode == "supply_prefix":
            row.update(_ng_task_index=index % len(base), _ng_rollout_index=index // len(base))
        rows.append(row)
    configs = [MODEL_CONFIG, *([SUPPLY_CONFIG] if mode == "supply_prefix" else []), config]
    transport_log = tmp_path / "transport.jsonl"
    before = vllm_metrics(vllm_server.base_url)
    with gym.running_gym(
        configs,
        _overrides(vllm_server, agent_key, mode, tmp_path / "capture"),
        env={"NEMO_GYM_VLLM_TRANSPORT_LOG": str(transport_log)},
    ) as running:
        results = gym.run_rows(running.url(agent_key), rows)
    after = vllm_metrics(vllm_server.base_url)
    delta = {
        name.removeprefix("nemo_gym_tok_prefix_splice").strip("_"): after[name] - before.get(name, 0.0)
        for name in after
    }

    rollouts = check_collection(results)
    events = _transport_events(transport_log)
    requests = [e["request_payload"] for e in events if e["event"] == "transport_request"]
    answers = [e["raw_response"] for e in events if e["event"] == "transport_response"]
    with_prefix = sum("required_prefix_token_ids" in body for body in requests)
    differed = sum(bool((a.get("prefix_splice") or {}).get("template_differed")) for a in answers)
    print(
        f"\n[nemo-gym {environment} {mode}] rollouts {len(results)}, contiguous by NeMo RL's rule "
        f"{len(results) - len(rollouts.broken)}, with >= 3 model calls {rollouts.long_rollouts}, model calls "
        f"{rollouts.model_calls}, ended by max_tokens {rollouts.cut}, requests with required_prefix_token_ids "
        f"{with_prefix}, template_differed {differed}, hook splices {delta['s_total']:.0f}, repaired turns "
        f"{delta['drifted_turns_total']:.0f}, refused {delta['rejected_total']:.0f}, "
        f"rewards {rollouts.rewards:.0f}/{len(results)}"
    )
    assert not rollouts.broken, rollouts.broken
    assert rollouts.long_rollouts >= 10
    assert rollouts.cut > 0  # some calls cut by max_tokens: the splice after an unclosed turn ran too
    assert delta["drifted_turns_total"] > 0 and differed > 0
    assert delta["rejected_total"] == 0
    if mode == "supply_prefix":
        # Every call after a rollout's first has a verified parent, so NeMo Gym must have sent its ids.
        assert with_prefix >= sum(c.model_calls - 1 for c in rollouts.checks) > 0
        assert not any(r.body.get("mask_sample") for r in results)
    else:
        assert with_prefix == 0


def test_refusal_reaches_nemo_gym_user(vllm_server: Any, tmp_path: Path) -> None:
    """An edited earlier message under a kept bundle: the hook's 400 and what NeMo Gym's servers make of it."""
    config, agent_key, build_rows, max_output_tokens = ENVIRONMENTS["example_single_tool_call"]
    row = build_rows(gym.package_root())[0]
    params = row["responses_create_params"]
    params.update(tool_choice="required", parallel_tool_calls=False, max_output_tokens=max_output_tokens)
    params["tools"][0]["parameters"]["properties"]["city"]["enum"] = ["sf", "nyc"]
    with gym.running_gym([MODEL_CONFIG, config], _overrides(vllm_server, agent_key, "bundles", tmp_path)) as running:
        first = httpx.post(f"{running.url('policy_model')}/v1/responses", json=params, timeout=120)
        assert first.status_code == 200, first.text
        edited = copy.deepcopy(params)
        edited["input"] = [*params["input"], *first.json()["output"]]
        edited["input"][0]["content"] = "You are a terse assistant."
        model_answer = httpx.post(f"{running.url('policy_model')}/v1/responses", json=edited, timeout=120)
        agent_answer = httpx.post(
            f"{running.url(agent_key)}/run", json={**row, "responses_create_params": edited}, timeout=120
        )
    print(
        f"\n[nemo-gym refusal] vllm_model /v1/responses -> {model_answer.status_code}: {model_answer.text[:300]}"
        f"\n[nemo-gym refusal] simple_agent /run -> {agent_answer.status_code}: {agent_answer.text[:200]}"
    )
    # What NeMo Gym 0.7.0 does today: every upstream error becomes a 500 at each hop, with the body quoted inside.
    # The hook's reason survives as text; if NeMo Gym starts passing 4xx through, this assertion tells us.
    for answer in (model_answer, agent_answer):
        assert answer.status_code == 500
        assert "does not belong to these messages" in answer.text
        assert "required_prefix_token_ids" in answer.text
