"""NeMo Gym 0.7.0's request shapes through this project's adapter: training-capture paths, per-row metadata, cookies.

NeMo Gym's own simple_agent with `token_id_capture: true` (and the top-level `token_id_capture` block) sends every
model call of a row to `/ng-rollout/<task>-<rollout>/training-token-capture/v1/responses` on the adapter, which
serves it and records the call in NeMo Gym's capture directory (`nemo_gym_token_capture_dir`). NeMo Gym's own reader
(tests/nemo_gym/read_capture.py, in .venv-nemo-gym) then reads the records back and rebuilds each rollout from them;
both must equal the bundles on the agent's answer. Half the rows carry `metadata.chat_template_kwargs` (thinking
off), whose effect is asserted on the prompt ids. On the suite's hooked vLLM. Run by `make test-nemo-gym` only.
"""

from __future__ import annotations

import copy
import json
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import Request
from fastapi.responses import Response as HTTPResponse

from nemo_gym_tok.servers.inprocess import serve_in_thread
from nemo_gym_tok.types.tokens import BUNDLE_FIELDS
from nemo_gym_tok.vllm_server import VLLMServer
from responses_api_models.vllm_model.app import VLLMModel, VLLMModelConfig
from tests.nemo_gym import gym
from tests.nemo_gym.nemo_rl_rule import check_collection
from tests.nemo_gym.test_nemo_gym_agent_via_adapter import MODEL_KEY, agent_overrides, agent_rows
from tests.nemo_gym.test_nemo_gym_prefix_backend import ENVIRONMENTS

pytestmark = pytest.mark.vllm

ENVIRONMENT = "example_single_tool_call"
READER = Path(__file__).with_name("read_capture.py")
THINKING_OFF = json.dumps({"enable_thinking": False})


@contextmanager
def serve_adapter(server: VLLMServer, capture_dir: Path, seen: list[dict[str, Any]]) -> Iterator[str]:
    """The adapter (bundles on, recording NeMo Gym's capture) in front of `server`; records each request's path."""
    config = VLLMModelConfig(
        base_url=f"{server.base_url}/v1",
        model=server.served_model_name,
        splice="hook",
        return_token_id_information=True,
        nemo_gym_token_capture_dir=str(capture_dir),
    )
    app = VLLMModel(MODEL_KEY, config).build_app()

    @app.middleware("http")
    async def record(request: Request, call_next: Any) -> Any:
        response = await call_next(request)
        answer = b"".join([chunk async for chunk in response.body_iterator])
        seen.append(
            {
                "path": request.url.path,
                "status": response.status_code,
                "cookies": dict(request.cookies),
                "set_cookie": response.headers.get("set-cookie"),
            }
        )
        return HTTPResponse(answer, response.status_code, dict(response.headers))

    with serve_in_thread(app) as url:
        yield url


def read_capture(capture_dir: Path, entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """NeMo Gym's own reader over the capture directory (read_capture.py in .venv-nemo-gym)."""
    spec = json.dumps({"dir": str(capture_dir), "results": entries})
    out = subprocess.run([str(gym.NEMO_GYM_PYTHON), str(READER)], input=spec, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout)


def bundles(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{key: item[key] for key in BUNDLE_FIELDS} for item in output if item.get("generation_token_ids")]


def think_block(server: VLLMServer) -> list[int]:
    """The ids thinking-off adds at the end of a generation prompt (the tiny model's Qwen3 template), by vLLM."""

    def tokens(**kwargs: Any) -> list[int]:
        body = {"model": server.served_model_name, "messages": [{"role": "user", "content": "hi"}], **kwargs}
        return httpx.post(f"{server.base_url}/tokenize", json=body, timeout=60).json()["tokens"]

    on, off = tokens(), tokens(chat_template_kwargs={"enable_thinking": False})
    assert off[: len(on)] == on and len(off) > len(on)
    return off[len(on) :]


def _thinking_off(row: dict[str, Any]) -> bool:
    return "chat_template_kwargs" in (row["responses_create_params"].get("metadata") or {})


def test_training_capture_and_metadata_through_adapter(vllm_server: VLLMServer, tmp_path: Path) -> None:
    capture_dir = tmp_path / "capture"
    config, agent_key, build_rows, _ = ENVIRONMENTS[ENVIRONMENT]
    rows = agent_rows(ENVIRONMENT)
    distinct = len(build_rows(gym.package_root()))
    for index, row in enumerate(rows):
        row.update(_ng_task_index=index % distinct, _ng_rollout_index=index // distinct)
        if index % 2:
            metadata = row["responses_create_params"].setdefault("metadata", {})  # the row's seed stays
            metadata["chat_template_kwargs"] = THINKING_OFF
    seen: list[dict[str, Any]] = []
    with serve_adapter(vllm_server, capture_dir, seen) as adapter_url:
        overrides = agent_overrides(adapter_url, agent_key)
        overrides[agent_key]["responses_api_agents"]["simple_agent"]["token_id_capture"] = True
        overrides["token_id_capture"] = {"enabled": True, "dir": str(capture_dir)}
        with gym.running_gym([config], overrides, external=[MODEL_KEY]) as running:
            results = gym.run_rows(running.url(agent_key), rows)

    rollouts = check_collection(results)  # every /run answered 200
    assert not rollouts.broken, rollouts.broken
    ids = [f"{row['_ng_task_index']}-{row['_ng_rollout_index']}" for row in rows]
    expected_paths = {f"/ng-rollout/{rid}/training-token-capture/v1/responses" for rid in ids}
    paths = {entry["path"] for entry in seen}
    assert paths == expected_paths, sorted(paths - expected_paths)[:5]
    assert all(entry["status"] == 200 for entry in seen), [e for e in seen if e["status"] != 200][:3]
    assert len(seen) == rollouts.model_calls

    # NeMo Gym's collector puts the row's indices on its result before reading the capture; so does this test.
    report = read_capture(
        capture_dir,
        [
            {
                "rollout_id": rid,
                "result": {
                    **copy.deepcopy(result.body),
                    "_ng_task_index": row["_ng_task_index"],
                    "_ng_rollout_index": row["_ng_rollout_index"],
                },
            }
            for rid, row, result in zip(ids, rows, results)
        ],
    )
    block = think_block(vllm_server)
    resolved = 0
    for row, result, read in zip(rows, results, report):
        ours = bundles(result.body["response"]["output"])
        recorded = [{k: e[k] for k in BUNDLE_FIELDS} for e in read["entries"]]
        assert recorded == ours, read["rollout_id"]
        assert read["rebuilt"] == ours and read["mask_sample"] is False, (read["rollout_id"], read["error"])
        decisions = [e["parent_resolution"] for e in read["entries"]]
        assert decisions == ["root"] + ["resolved"] * (len(decisions) - 1), decisions
        for parent, child in zip(read["entries"], read["entries"][1:]):
            assert child["parent_call_id"] == parent["model_call_id"]
        resolved += len(decisions) - 1
        # The row's metadata reached the chat template: thinking off ends the first prompt with the empty block.
        first_prompt = ours[0]["prompt_token_ids"]
        thinking_off = _thinking_off(row)
        assert (first_prompt[-len(block) :] == block) is thinking_off, read["rollout_id"]
    cookies = sorted({name for entry in seen for name in entry["cookies"]})
    rebuilt = sum(r["rebuilt"] == bundles(x.body["response"]["output"]) for r, x in zip(report, results))
    print(
        f"\n[nemo-gym training capture via adapter] rollouts {len(results)}, contiguous by NeMo RL's rule "
        f"{len(results) - len(rollouts.broken)}, model calls {rollouts.model_calls} (all on "
        f"/ng-rollout/<id>/training-token-capture/v1/responses, 200), records read back by NeMo Gym "
        f"{sum(len(r['entries']) for r in report)} equal to the bundles, parents resolved {resolved}, rebuilt by "
        f"NeMo Gym's collector equal {rebuilt}/{len(results)}, masked {sum(bool(r['mask_sample']) for r in report)}, "
        f"rows with metadata thinking off "
        f"{sum(map(_thinking_off, rows))}, cookies sent {cookies}, set-cookie "
        f"answers {sum(bool(e['set_cookie']) for e in seen)}"
    )
    assert rollouts.long_rollouts >= 10 and resolved > 0
    assert not cookies and not any(entry["set_cookie"] for entry in seen)


def test_metadata_extra_body_seed_applies(vllm_server: VLLMServer, tmp_path: Path) -> None:
    """`metadata.extra_body` fields reach vLLM: one seed gives one sampled answer at temperature 1."""
    seen: list[dict[str, Any]] = []
    with serve_adapter(vllm_server, tmp_path / "capture", seen) as adapter_url:

        def ask(extra_body: dict[str, Any]) -> list[int]:
            body = {
                "input": "Say something.",
                "temperature": 1.0,
                "max_output_tokens": 12,
                "metadata": {"extra_body": json.dumps(extra_body)},
            }
            answer = httpx.post(f"{adapter_url}/v1/responses", json=body, timeout=120)
            assert answer.status_code == 200, answer.text
            return answer.json()["output"][-1]["generation_token_ids"]

        seeded = [ask({"seed": 1234}) for _ in range(2)]
        unseeded = [ask({}) for _ in range(3)]
    print(
        f"\n[metadata extra_body seed] seeded answers equal {seeded[0] == seeded[1]}, unseeded answers distinct "
        f"{len({tuple(ids) for ids in unseeded})}/3"
    )
    assert seeded[0] == seeded[1]
    assert len({tuple(ids) for ids in unseeded}) > 1  # without the seed the same request samples differently


def test_chat_completions_on_the_capture_path_are_recorded(vllm_server: VLLMServer, tmp_path: Path) -> None:
    """The chat route on a training-capture path: two turns, read back by NeMo Gym's reader, the second linked."""
    seen: list[dict[str, Any]] = []
    path = "/ng-rollout/chat-1/training-token-capture/v1/chat/completions"
    with serve_adapter(vllm_server, tmp_path / "capture", seen) as adapter_url:
        messages: list[dict[str, Any]] = [{"role": "user", "content": "Say something."}]
        answers = []
        for turn in range(2):
            body = {"messages": messages, "max_tokens": 8, "metadata": {"chat_template_kwargs": THINKING_OFF}}
            answer = httpx.post(f"{adapter_url}{path}", json=body, timeout=120)
            assert answer.status_code == 200, answer.text
            answers.append(answer.json())
            messages = [*messages, answer.json()["choices"][0]["message"], {"role": "user", "content": f"More {turn}."}]
    read = read_capture(tmp_path / "capture", [{"rollout_id": "chat-1", "result": {"response": {"output": []}}}])[0]
    assert [{k: e[k] for k in BUNDLE_FIELDS} for e in read["entries"]] == [
        {k: a["choices"][0]["message"][k] for k in BUNDLE_FIELDS} for a in answers
    ]
    assert [e["parent_resolution"] for e in read["entries"]] == ["root", "resolved"]
    assert read["entries"][1]["parent_call_id"] == read["entries"][0]["model_call_id"]
    assert [e["response_id"] for e in read["entries"]] == [a["id"] for a in answers]
