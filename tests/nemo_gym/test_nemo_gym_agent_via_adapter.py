"""NeMo Gym 0.7.0's own simple_agent and resources servers with this project's adapter as their model server.

The adapter (responses_api_models/vllm_model, `return_token_id_information: true`) runs in-process; NeMo Gym's
config keeps a `policy_model` instance whose host and port are the adapter's, so the agent's `model_server`
reference resolves to it and NeMo Gym's own `vllm_model` is never started. Against the suite's hooked vLLM (the hook
splices) and its stock vLLM (`splice: adapter`). Every rollout is checked by NeMo RL's rule, and
every request NeMo Gym's agent sent the adapter is recorded (path, headers, cookies, fields) and printed.
Run by `make test-nemo-gym` only.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from urllib.parse import urlsplit

import pytest
from fastapi import Request
from fastapi.responses import Response as HTTPResponse

from nemo_gym_tok.servers.inprocess import serve_in_thread
from nemo_gym_tok.vllm_server import VLLMServer
from responses_api_models.vllm_model.app import VLLMModel, VLLMModelConfig
from tests.nemo_gym import gym
from tests.nemo_gym.nemo_rl_rule import check_collection
from tests.nemo_gym.test_nemo_gym_prefix_backend import ENVIRONMENTS, MAX_STEPS, ROWS_PER_CASE, seeded, vllm_metrics

pytestmark = pytest.mark.vllm

MODEL_KEY = "policy_model"  # the name NeMo Gym's shipped environment configs give their agents' model_server


@contextmanager
def serve_adapter(server: VLLMServer, splice: str, seen: list[dict[str, Any]]) -> Iterator[str]:
    """This project's adapter in front of `server`, recording what reaches it; yields its URL."""
    config = VLLMModelConfig(
        base_url=f"{server.base_url}/v1",
        model=server.served_model_name,
        return_token_id_information=True,
        splice=splice,
    )
    app = VLLMModel(MODEL_KEY, config).build_app()

    @app.middleware("http")
    async def record(request: Request, call_next: Any) -> Any:
        body = await request.json() if request.method == "POST" else {}
        response = await call_next(request)
        answer = b"".join([chunk async for chunk in response.body_iterator])
        # The splice telemetry rides on the last output item; NeMo Gym's models drop it, so it is read here.
        splice = None
        if response.status_code == 200:
            splice = (json.loads(answer).get("output") or [{}])[-1].get("prefix_splice")
        seen.append(
            {
                "path": request.url.path,
                "status": response.status_code,
                "fields": sorted(body),
                "metadata": body.get("metadata"),
                "cookies": dict(request.cookies),
                "headers": sorted(request.headers.keys()),
                "splice": splice or {},
            }
        )
        return HTTPResponse(answer, response.status_code, dict(response.headers))

    with serve_in_thread(app) as url:
        yield url


def agent_rows(environment: str) -> list[dict[str, Any]]:
    _, _, build_rows, max_output_tokens = ENVIRONMENTS[environment]
    base = build_rows(gym.package_root())
    rows = []
    for index in range(ROWS_PER_CASE):
        row = copy.deepcopy(base[index % len(base)])
        row["responses_create_params"].update(
            tool_choice="required",
            parallel_tool_calls=False,
            max_output_tokens=max_output_tokens,
            temperature=1.0,
            metadata=seeded(index),
        )  # the adapter applies metadata.extra_body as NeMo Gym's vllm_model does
        rows.append(row)
    return rows


def agent_overrides(adapter_url: str, agent_key: str) -> dict[str, Any]:
    """The adapter as NeMo Gym's `policy_model`: an instance with its host and port, resolved but not launched."""
    address = urlsplit(adapter_url)
    model = {"entrypoint": "app.py", "host": address.hostname, "port": address.port}
    return {
        MODEL_KEY: {"responses_api_models": {"vllm_model": model}},
        agent_key: {"responses_api_agents": {"simple_agent": {"max_steps": MAX_STEPS}}},
    }


def collect(adapter_url: str, environment: str) -> list[gym.RunResult]:
    """The environment's rows through NeMo Gym's simple_agent `/run`, its model server being the adapter."""
    config, agent_key, _, _ = ENVIRONMENTS[environment]
    with gym.running_gym([config], agent_overrides(adapter_url, agent_key), external=[MODEL_KEY]) as running:
        return gym.run_rows(running.url(agent_key), agent_rows(environment))


def check(label: str, results: list[gym.RunResult], seen: list[dict[str, Any]]) -> tuple[int, list[str]]:
    """Assert the rollouts good by NeMo RL's rule and print the figures; returns the repaired turns and who spliced."""
    rollouts = check_collection(results)
    paths = sorted({entry["path"] for entry in seen})
    fields = sorted({name for entry in seen for name in entry["fields"]})
    cookies = sorted({name for entry in seen for name in entry["cookies"]})
    metadata = [entry["metadata"] for entry in seen if entry["metadata"]]
    refused = [entry for entry in seen if entry["status"] != 200]
    repaired = sum(bool(entry["splice"].get("template_differed")) for entry in seen)
    spliced_by = sorted({entry["splice"]["spliced_by"] for entry in seen if entry["splice"].get("applied")})
    print(
        f"\n[nemo-gym agent via adapter {label}] rollouts {len(results)}, contiguous by NeMo RL's rule "
        f"{len(results) - len(rollouts.broken)}, with >= 3 model calls {rollouts.long_rollouts}, model calls "
        f"{rollouts.model_calls}, ended by max_tokens {rollouts.cut}, repaired turns {repaired} "
        f"(spliced by {spliced_by}), rewards {rollouts.rewards:.0f}/{len(results)}, "
        f"adapter requests {len(seen)} (refused {len(refused)}) on {paths}, fields {fields}, cookies {cookies}, "
        f"with metadata {len(metadata)}, headers {sorted({h for entry in seen for h in entry['headers']})}"
    )
    assert not refused, refused[:3]
    assert not rollouts.broken, rollouts.broken
    assert rollouts.long_rollouts >= 10
    assert rollouts.model_calls == len(seen)  # every model call went through the adapter
    assert repaired > 0
    return repaired, spliced_by


@pytest.mark.parametrize("environment", list(ENVIRONMENTS))
def test_agent_via_adapter_on_hooked_vllm(vllm_server: VLLMServer, environment: str) -> None:
    seen: list[dict[str, Any]] = []
    before = vllm_metrics(vllm_server.base_url)
    with serve_adapter(vllm_server, "hook", seen) as adapter_url:
        results = collect(adapter_url, environment)
    after = vllm_metrics(vllm_server.base_url)
    repaired = after["nemo_gym_tok_prefix_splice_drifted_turns_total"] - before.get(
        "nemo_gym_tok_prefix_splice_drifted_turns_total", 0.0
    )
    # The adapter passed on the hook's telemetry: its count of repaired turns is the hook's own.
    assert check(f"{environment} hooked vLLM", results, seen) == (repaired, ["hook"])


@pytest.mark.parametrize("environment", list(ENVIRONMENTS))
def test_agent_via_adapter_on_stock_vllm(plain_vllm_server: VLLMServer, environment: str) -> None:
    seen: list[dict[str, Any]] = []
    with serve_adapter(plain_vllm_server, "adapter", seen) as adapter_url:
        results = collect(adapter_url, environment)
    _, spliced_by = check(f"{environment} stock vLLM, splice: adapter", results, seen)
    assert spliced_by == ["adapter"]
