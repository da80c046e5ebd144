"""Exact through vLLM's router (the real vllm-router in front of the shared hooked vLLM): bundles the router strips are
recovered from the top-level prefix or refused naming it, and the demo gym that `ngt run` puts behind a router it
starts collects contiguous rollouts that say which replica served each turn."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request

from nemo_gym_tok.collect import collect
from nemo_gym_tok.config import load_config
from nemo_gym_tok.contract.provenance import FINGERPRINT_PARTS
from nemo_gym_tok.records.contiguity import check_file
from nemo_gym_tok.router import RouterProcess, RouterSpec, add_worker, list_workers, remove_worker
from nemo_gym_tok.servers.inprocess import serve_in_thread
from nemo_gym_tok.servers.launcher import Gym
from nemo_gym_tok.servers.routers import RouterConfigError, router_spec
from nemo_gym_tok.testing.gym_configs import demo_config_behind_router
from nemo_gym_tok.vllm_server import VLLMServer
from responses_api_models.vllm_model.app import VLLMModel, VLLMModelConfig
from tests.relay_worker import relay_worker

REPO = Path(__file__).resolve().parents[1]
NUMBER_GUESS_ROWS = REPO / "resources_servers" / "number_guess" / "data" / "example.jsonl"


@pytest.fixture(scope="module")
def router(vllm_server: VLLMServer) -> Iterator[RouterProcess]:
    """vllm-router (consistent_hash) with the shared hooked vLLM as its one worker."""
    with RouterProcess(RouterSpec((vllm_server.base_url,))) as running:
        yield running


def chat(url: str, body: dict[str, Any], session: str = "s-1") -> httpx.Response:
    return httpx.post(f"{url}/v1/chat/completions", json=body, headers={"x-session-id": session}, timeout=120)


def first_turn(router: RouterProcess, model: str) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    messages = [{"role": "user", "content": "Guess my number."}]
    body = {"model": model, "messages": messages, "max_tokens": 8, "seed": 3, "logprobs": True}
    answer = chat(router.url, {**body, "return_token_ids": True})
    assert answer.status_code == 200, answer.text
    return messages, answer.json()["choices"][0]["message"]


def test_bundles_the_router_strips_are_refused_naming_it_or_recovered_from_the_top_level_prefix(
    router: RouterProcess, vllm_server: VLLMServer
) -> None:
    model = vllm_server.served_model_name
    messages, reply = first_turn(router, model)
    # The hooked worker's answer crosses the router whole: its bundle, and which replica served it with what.
    assert reply["replica"] == vllm_server.base_url
    assert set(reply["model_fingerprint"]) == {"sha256", *(key for key, _ in FINGERPRINT_PARTS)}
    prefix = reply["prompt_token_ids"] + reply["generation_token_ids"]
    assistant = {key: reply[key] for key in ("role", "content", "prompt_token_ids", "generation_token_ids")}
    assistant["generation_log_probs"] = reply["generation_log_probs"]
    history = [*messages, assistant, {"role": "user", "content": "Higher."}]
    body = {"model": model, "messages": history, "max_tokens": 4, "logprobs": True, "return_token_ids": True}

    # Bundles on messages only: the router drops them, and the hook sees a text history it cannot prove.
    stripped = chat(router.url, body)
    assert stripped.status_code == 400, stripped.text
    message = stripped.json()["error"]["message"]
    assert "came through vllm-router" in message and "required_prefix_token_ids" in message
    direct = chat(vllm_server.base_url, body)  # the same body straight to vLLM splices from the bundle
    assert direct.status_code == 200 and direct.json()["prefix_splice"]["applied"] is True

    # The prefix top-level, which the router keeps: spliced from it alone, exact.
    recovered = chat(router.url, {**body, "required_prefix_token_ids": prefix})
    assert recovered.status_code == 200, recovered.text
    answer = recovered.json()
    assert answer["prefix_splice"]["applied"] is True
    assert answer["prompt_token_ids"][: len(prefix)] == prefix
    assert answer["prompt_token_ids"] == direct.json()["prompt_token_ids"]

    # A history re-templated on purpose says so, and is served with the template's ids.
    on_purpose = chat(router.url, {**body, "start_token_segment": True})
    assert on_purpose.status_code == 200, on_purpose.text
    # Log probs alone get a bundle from the hook too: refused the same way. Asking for no ids: stock behaviour.
    logprobs_only = {key: value for key, value in body.items() if key != "return_token_ids"}
    assert chat(router.url, logprobs_only).status_code == 400
    plain = {key: value for key, value in logprobs_only.items() if key != "logprobs"}
    assert chat(router.url, plain).status_code == 200


def test_ngt_run_puts_the_demo_gym_behind_a_router_and_its_rollouts_stay_exact(
    vllm_server: VLLMServer, tmp_path: Path
) -> None:
    config = load_config(
        [str(demo_config_behind_router(tmp_path, [vllm_server.base_url]))],
        [f"policy_model_name={vllm_server.served_model_name}", "head_server.port=0"],
    )
    output = tmp_path / "rollouts.jsonl"
    with Gym(config) as gym:
        (router,) = gym.routers.values()
        assert list_workers(router.url) == [vllm_server.base_url]
        adapter_base = config.instances["policy_model"].fields["base_url"]
        assert adapter_base == f"{router.url}/v1"
        summary = asyncio.run(
            collect(
                NUMBER_GUESS_ROWS,
                output,
                gym.urls["number_guess_agent"],
                agent="number_guess_agent",
                repeats=2,
                concurrency=4,
                timeout=300,
                progress=False,
                auth_token=gym.auth_token,
            )
        )
        router_pid = router.pid
    assert router_pid is not None and not router.running  # stopped with the gym
    assert summary.done_now == summary.total > 0 and not summary.failures_path.exists()
    report = check_file(output)
    assert report.ok and report.contiguous == report.rollouts == summary.total, report.format()
    turns = [
        item
        for line in output.read_text().splitlines()
        for item in json.loads(line)["response"]["output"]
        if isinstance(item, dict) and item.get("generation_token_ids") is not None
    ]
    assert turns and all(turn["replica"] == vllm_server.base_url for turn in turns)
    multi_turn = sum(1 for line in output.read_text().splitlines() if _model_calls(json.loads(line)) > 1)
    assert multi_turn > 0, "no rollout made a second model call: nothing crossed the router with a prefix"
    print(f"\nbehind vllm-router: {summary.total} rollouts, {len(turns)} model calls, {multi_turn} multi-turn, exact")


def _model_calls(record: dict[str, Any]) -> int:
    output = record["response"]["output"]
    return sum(1 for item in output if isinstance(item, dict) and item.get("generation_token_ids") is not None)


def fingerprint_rewriting_worker(replica_url: str, mode: dict[str, str]) -> FastAPI:
    """A worker added to the router by hand: every call answered by the real replica, its chat answers' fingerprint
    then rewritten as `mode["as"]` says: "another template" (a replica serving another chat template) or "none" (a
    replica whose hook found no tokenizer file to fingerprint). What a real replica of either kind answers, without a
    second vLLM."""

    def rewrite(path: str, payload: dict[str, Any], request: Request) -> None:
        if path != "v1/chat/completions":
            return
        for choice in payload["choices"]:
            message = choice["message"]
            message["replica"] = f"{request.url.scheme}://{request.url.netloc}"
            if mode["as"] == "none":
                message.pop("model_fingerprint", None)
            elif "model_fingerprint" in message:
                message["model_fingerprint"] |= {"chat_template_sha256": "0" * 64, "sha256": "1" * 64}

    return relay_worker(replica_url, rewrite=rewrite)


def test_answers_behind_a_router_started_elsewhere_are_held_to_its_workers_fingerprint(
    router: RouterProcess, vllm_server: VLLMServer
) -> None:
    model = vllm_server.served_model_name
    mode = {"as": "another template"}
    config = VLLMModelConfig(base_url=f"{router.url}/v1", model=model)
    body = {"model": model, "messages": [{"role": "user", "content": "Hi."}], "max_tokens": 2, "return_token_ids": True}
    with (
        serve_in_thread(VLLMModel("policy_model", config).build_app()) as adapter,
        serve_in_thread(fingerprint_rewriting_worker(vllm_server.base_url, mode)) as stand_in,
    ):

        def ask(session: int) -> httpx.Response:
            headers = {"x-session-id": f"fingerprint-{session}"}
            return httpx.post(f"{adapter}/v1/chat/completions", json=body, headers=headers, timeout=120)

        def refused_within(seconds: float) -> dict[str, Any]:
            deadline, session = time.monotonic() + seconds, 0
            while time.monotonic() < deadline:
                session += 1
                answer = ask(session)
                if answer.status_code != 200:
                    assert answer.status_code == 502, answer.text
                    return answer.json()["error"]
                time.sleep(0.2)
            raise AssertionError(f"no answer refused within {seconds:.0f}s")

        # The router's one worker is asked its fingerprint before the first answer is accepted.
        assert ask(0).status_code == 200
        for kind, error_type, says in (
            ("another template", "replica_mismatch", f"replica {stand_in} serves the chat template unlike"),
            ("none", "replica_unfingerprinted", f"replica {stand_in} answered without a model_fingerprint"),
        ):
            mode["as"] = kind
            add_worker(router.url, stand_in)
            try:
                error = refused_within(60)  # the router's list read after each answer, the newcomer asked
                assert error["type"] == error_type and says in error["message"], error
                assert f"the fleet check of vllm-router at {router.url}/v1" in error["message"]
            finally:
                remove_worker(router.url, stand_in)
            assert ask(1000).status_code == 200  # gone from the list: answers pass again


def test_a_router_that_would_time_out_before_the_adapter_is_refused(tmp_path: Path) -> None:
    path = demo_config_behind_router(tmp_path, ["http://127.0.0.1:8000"])
    path.write_text(
        path.read_text().replace("        worker_urls:", "        request_timeout_secs: 600\n        worker_urls:")
    )
    config = load_config([str(path)], ["policy_model_name=m"])
    with pytest.raises(RouterConfigError) as refused:
        router_spec(config.instances["policy_model"])
    message = str(refused.value)
    assert "policy_model.responses_api_models.vllm_model.router.request_timeout_secs (600)" in message
    assert "must be longer than the adapter's request_timeout_seconds (600)" in message
    longer = load_config(
        [str(path)], ["policy_model_name=m", "policy_model.responses_api_models.vllm_model.request_timeout_seconds=300"]
    )
    assert router_spec(longer.instances["policy_model"]).request_timeout_secs == 600
