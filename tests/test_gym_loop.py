"""The gym loop on the real vLLM with the hook: agent x each example environment -> token-exact training data."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from nemo_gym_tok.config import ServerInstance
from nemo_gym_tok.records.contiguity import NotContiguousError, bundled_turns, check_contiguous
from nemo_gym_tok.records.training import rollout_to_training_sequence
from nemo_gym_tok.servers.client import ServerClient
from nemo_gym_tok.servers.inprocess import serve_in_thread
from nemo_gym_tok.servers.registry import validate_instance
from nemo_gym_tok.types.tokens import BUNDLE_FIELDS
from nemo_gym_tok.vllm_server import VLLMServer
from responses_api_agents.simple_agent.app import SimpleAgent, SimpleAgentConfig
from responses_api_models.vllm_model.app import VLLMModel, VLLMModelConfig
from responses_api_models.vllm_model.tests.conftest import RecordingProxy, recording_proxy_app

REPO = Path(__file__).resolve().parents[1]
ENVIRONMENTS = ["capital_lookup", "grid_navigation", "number_guess"]
ROWS_PER_ENVIRONMENT = 2


def rows(environment: str) -> list[dict]:
    lines = (REPO / "resources_servers" / environment / "data" / "example.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()][:ROWS_PER_ENVIRONMENT]


@dataclass
class GymUnderTest:
    urls: dict[str, str]
    proxy: RecordingProxy
    """Between the adapter and vLLM: shows what vLLM received."""
    model_requests: RecordingProxy
    """Between the agents and the adapter: shows what the agents sent the model."""

    def __getitem__(self, name: str) -> str:
        return self.urls[name]


@pytest.fixture(scope="module")
def gym(vllm_server: VLLMServer) -> Iterator[GymUnderTest]:
    """Adapter (token information on) behind a recording proxy, the three environments, and two agents per
    environment: one sends bundles back (default), one strips them (stock re-tokenization)."""
    with ExitStack() as stack:
        proxy = RecordingProxy(url="")
        proxy.url = stack.enter_context(serve_in_thread(recording_proxy_app(vllm_server.base_url, proxy)))
        adapter = VLLMModel(
            "policy_model",
            VLLMModelConfig(base_url=proxy.url, model=vllm_server.served_model_name, return_token_id_information=True),
        )
        adapter_url = stack.enter_context(serve_in_thread(adapter.build_app()))
        model_requests = RecordingProxy(url="")
        model_requests.url = stack.enter_context(serve_in_thread(recording_proxy_app(adapter_url, model_requests)))
        urls = {"policy_model": model_requests.url}
        for environment in ENVIRONMENTS:
            server_class, config = validate_instance(
                ServerInstance(environment, "resources_servers", environment, {}, {})
            )
            urls[environment] = stack.enter_context(serve_in_thread(server_class(environment, config).build_app()))
        for environment in ENVIRONMENTS:
            for suffix, send in (("", True), ("_stock", False)):
                config = SimpleAgentConfig(
                    model_server="policy_model", resources_server=environment, max_steps=4, send_token_bundles=send
                )
                agent = SimpleAgent(f"{environment}_agent{suffix}", config, ServerClient(dict(urls)))
                urls[f"{environment}_agent{suffix}"] = stack.enter_context(serve_in_thread(agent.build_app()))
        yield GymUnderTest(urls, proxy, model_requests)


def run_rollouts(gym: GymUnderTest, agent: str, environment: str) -> list[dict]:
    with httpx.Client(timeout=600) as http:
        answers = [http.post(f"{gym[agent]}/run", json=row) for row in rows(environment)]
    for answer in answers:
        assert answer.status_code == 200, answer.text
    return [answer.json() for answer in answers]


@pytest.mark.parametrize("environment", ENVIRONMENTS)
def test_agent_episodes_are_token_exact_training_data(gym, environment: str) -> None:
    already_sent = len(gym.model_requests.bodies("/v1/responses"))
    already_chat = len(gym.proxy.bodies("/v1/chat/completions"))
    records = run_rollouts(gym, f"{environment}_agent", environment)
    requests = iter(gym.model_requests.bodies("/v1/responses")[already_sent:])  # the rollouts ran one after another
    answers = iter(gym.model_requests.answers("/v1/responses")[already_sent:])
    chats = iter(gym.proxy.bodies("/v1/chat/completions")[already_chat:])
    repaired = 0
    for record in records:
        assert isinstance(record["reward"], float | int)
        assert record["schema_version"] == 2
        turns = bundled_turns(record)
        previous_id = None
        for number in range(len(turns)):
            # The agent continues the adapter's kept response: the previous call's id and the new items, no ids.
            request = next(requests)
            assert request.get("previous_response_id") == previous_id
            assert not [item for item in request["input"] if any(key in item for key in BUNDLE_FIELDS)]
            # vLLM gets the previous call's bundle back, and no other: the hook takes its prefix from it alone.
            bundled = [m for m in next(chats)["messages"] if m.get("prompt_token_ids") is not None]
            expected = [turns[number - 1].prompt_token_ids] if number else []
            assert [message["prompt_token_ids"] for message in bundled] == expected
            previous_id = next(answers)["id"]
        assert len(turns) >= 3, f"only {len(turns)} model calls"
        assert record["response"]["model_calls"] == len(turns)
        repaired += sum(turn.repaired for turn in turns)
        sequence = rollout_to_training_sequence(record)  # raises if not contiguous
        generated = [token for turn in turns for token in turn.generation_token_ids]
        assert [t for t, m in zip(sequence.token_ids, sequence.loss_mask) if m] == generated
        assert [p for p, m in zip(sequence.log_probs, sequence.loss_mask) if m] == [
            lp for turn in turns for lp in turn.generation_log_probs
        ]
        assert sequence.token_ids[: len(turns[-1].prompt_token_ids)] == turns[-1].prompt_token_ids
    assert repaired >= 1, "no turn was repaired by the prefix splice"


@pytest.mark.parametrize("environment", ENVIRONMENTS)
def test_same_episodes_without_bundles_are_detected_as_not_contiguous(gym, environment: str) -> None:
    records = run_rollouts(gym, f"{environment}_agent_stock", environment)
    broken = 0
    for record in records:
        try:
            check_contiguous(bundled_turns(record))
        except NotContiguousError:
            broken += 1
    assert broken >= 1, "stock re-tokenization should drift"


def test_harness_fields_survive_harness_agent_adapter_vllm(gym, vllm_server: VLLMServer) -> None:
    proxy = gym.proxy
    agent = gym["number_guess_agent"]
    user = {"role": "user", "content": "Pick a number."}
    first = httpx.post(f"{agent}/v1/responses", json={"input": [user], "max_output_tokens": 8}, timeout=120).json()
    bundle = first["output"][-1]
    prefix = bundle["prompt_token_ids"] + bundle["generation_token_ids"]
    text = "".join(part["text"] for part in bundle["content"])
    body = {
        "input": [user, {"role": "assistant", "content": text}, {"role": "user", "content": "Again."}],
        "max_output_tokens": 4,
        "required_prefix_token_ids": prefix,
        "harness_tag": {"run": 7},
    }
    second = httpx.post(f"{agent}/v1/responses", json=body, timeout=120)
    assert second.status_code == 200, second.text
    sent = proxy.bodies("/v1/chat/completions")[-1]
    assert sent["required_prefix_token_ids"] == prefix and sent["harness_tag"] == {"run": 7}
    assert second.json()["output"][-1]["prompt_token_ids"][: len(prefix)] == prefix
    bad = httpx.post(f"{agent}/v1/responses", json={**body, "required_prefix_token_ids": [-1]}, timeout=60)
    assert bad.status_code == 400  # the adapter's 400 passes through the agent


def test_context_overflow_ends_the_episode(gym) -> None:
    row = rows("number_guess")[0]
    huge = {"role": "user", "content": "guess " * 6000}
    row = {**row, "responses_create_params": {**row["responses_create_params"], "input": [huge]}}
    answer = httpx.post(f"{gym['number_guess_agent']}/run", json=row, timeout=120)
    assert answer.status_code == 200, answer.text
    record = answer.json()
    assert record["response"]["model_calls"] == 1
    assert "maximum context length" in record["response"]["output"][-1]["context_overflow"]
    assert record["reward"] == 0.0


def test_run_requires_responses_create_params(gym) -> None:
    answer = httpx.post(f"{gym['capital_lookup_agent']}/run", json={"question": "x"}, timeout=60)
    assert answer.status_code == 400
    assert "responses_create_params" in answer.json()["error"]["message"]


def test_ngt_demo_end_to_end(vllm_server: VLLMServer, tmp_path: Path) -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "nemo_gym_tok",
            "demo",
            "--limit",
            "1",
            "--output-dir",
            str(tmp_path),
            "--vllm-url",
            vllm_server.base_url,
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "demo: 3/3 rollouts token-contiguous" in result.stdout
    assert "model calls repaired by the prefix splice" in result.stdout
    for environment in ENVIRONMENTS:
        assert len((tmp_path / f"{environment}.jsonl").read_text().splitlines()) == 1
