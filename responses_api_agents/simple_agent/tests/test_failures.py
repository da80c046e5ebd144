"""Rollouts that fail for real (model server down, environment down) land in the failures file; the rest go on."""

from __future__ import annotations

import asyncio
from pathlib import Path

from nemo_gym_tok.collect import collect, read_failures
from nemo_gym_tok.common.net import free_port
from nemo_gym_tok.servers.client import ServerClient
from nemo_gym_tok.servers.inprocess import serve_in_thread
from resources_servers.number_guess.app import SERVER as NumberGuess
from responses_api_agents.simple_agent.app import SimpleAgent, SimpleAgentConfig

ROWS = Path(__file__).resolve().parents[3] / "resources_servers" / "number_guess" / "data" / "example.jsonl"


def agent_with(servers: dict[str, str]):
    config = SimpleAgentConfig(model_server="policy_model", resources_server="number_guess")
    return serve_in_thread(SimpleAgent("agent", config, ServerClient(servers)).build_app())


def run_collect(agent_url: str, output: Path):
    return asyncio.run(collect(ROWS, output, agent_url, concurrency=2, limit=3, repeats=1, timeout=60, progress=False))


def test_model_server_down_fails_each_rollout_with_its_reason(tmp_path: Path) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    with serve_in_thread(NumberGuess("number_guess", NumberGuess.config_class()).build_app()) as env:
        with agent_with({"policy_model": dead, "number_guess": env}) as agent:
            summary = run_collect(agent, tmp_path / "out.jsonl")
    assert (summary.failed, summary.done_now) == (3, 0)
    failures = read_failures(summary.failures_path)
    assert len(failures) == 3
    assert all("policy_model is unreachable" in entry["reason"] for entry in failures.values())


def test_environment_down_fails_the_rollouts_with_its_reason(tmp_path: Path) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    with agent_with({"policy_model": dead, "number_guess": dead}) as agent:
        summary = run_collect(agent, tmp_path / "out.jsonl")
    assert summary.failed == 3
    reasons = [entry["reason"] for entry in read_failures(summary.failures_path).values()]
    assert len(reasons) == 3 and all("number_guess is unreachable" in reason for reason in reasons)
    assert (tmp_path / "out.jsonl").read_text() == ""  # nothing half-written
