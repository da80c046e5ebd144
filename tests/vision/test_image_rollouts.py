"""An environment whose tool answers a picture (grid_navigation's `look` with `look_shows_picture`), collected with
`ngt collect`'s loop through the simple agent and the adapter on the hooked tiny VLM: every rollout exact."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest

from nemo_gym_tok.collect import collect
from nemo_gym_tok.config import ServerInstance
from nemo_gym_tok.records.contiguity import bundled_turns, check_file
from nemo_gym_tok.servers.client import ServerClient
from nemo_gym_tok.servers.inprocess import serve_in_thread
from nemo_gym_tok.servers.registry import validate_instance
from nemo_gym_tok.vllm_server import VLLMServer
from responses_api_agents.simple_agent.app import SimpleAgent, SimpleAgentConfig
from responses_api_models.vllm_model.app import VLLMModel, VLLMModelConfig
from tests.vision.server import VLM_NAME

ENVIRONMENT, AGENT = "grid_navigation", "grid_navigation_agent"
ROWS = Path(__file__).resolve().parents[2] / "resources_servers" / ENVIRONMENT / "data" / "example.jsonl"
CALLS = 3


@pytest.fixture(scope="module")
def picture_gym(vlm_server: VLLMServer) -> Iterator[dict[str, str]]:
    with ExitStack() as stack:
        adapter = VLLMModel(
            "policy_model",
            VLLMModelConfig(base_url=f"{vlm_server.base_url}/v1", model=VLM_NAME, return_token_id_information=True),
        )
        urls = {"policy_model": stack.enter_context(serve_in_thread(adapter.build_app()))}
        instance = ServerInstance(ENVIRONMENT, "resources_servers", ENVIRONMENT, {"look_shows_picture": True}, {})
        server_class, config = validate_instance(instance)
        urls[ENVIRONMENT] = stack.enter_context(serve_in_thread(server_class(ENVIRONMENT, config).build_app()))
        agent_config = SimpleAgentConfig(model_server="policy_model", resources_server=ENVIRONMENT, max_steps=CALLS)
        agent = SimpleAgent(AGENT, agent_config, ServerClient(dict(urls)))
        urls[AGENT] = stack.enter_context(serve_in_thread(agent.build_app()))
        yield urls


def look_only_rows(count: int) -> list[dict]:
    """The environment's example rows with `look` the only tool (tool_choice required: every call looks)."""
    rows = [json.loads(line) for line in ROWS.read_text().splitlines() if line.strip()][:count]
    for row in rows:
        params = row["responses_create_params"]
        params["tools"] = [tool for tool in params["tools"] if tool["name"] == "look"]
        params["max_output_tokens"] = 24
    return rows


def test_rollouts_with_pictures_in_tool_results_are_collected_exact(picture_gym, tmp_path: Path) -> None:
    rows_path, output = tmp_path / "rows.jsonl", tmp_path / "rollouts.jsonl"
    rows_path.write_text("".join(json.dumps(row) + "\n" for row in look_only_rows(2)))
    summary = asyncio.run(
        collect(rows_path, output, picture_gym[AGENT], agent=AGENT, concurrency=2, progress=False, timeout=600)
    )
    assert summary.failed == 0 and summary.done_now == 2
    report = check_file(output)
    assert report.ok and report.contiguous == 2, report.format()
    assert report.image_rollouts == 2 and report.images >= 2 * (CALLS - 1), report.format()
    for line in output.read_text().splitlines():
        turns = bundled_turns(json.loads(line))
        assert len(turns) == CALLS
        assert [len(turn.image_runs) for turn in turns] == list(range(CALLS))  # one more picture each call
