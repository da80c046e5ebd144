"""A push while the gym samples: in-flight requests under each pause mode, and an episode whose turns span a push."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from nemo_gym_tok.cli.main import main as ngt
from nemo_gym_tok.records.contiguity import bundled_turns, check_contiguous
from nemo_gym_tok.servers.inprocess import serve_in_thread
from nemo_gym_tok.vllm_server import VLLMServer
from nemo_gym_tok.weights import push_weights
from responses_api_models.vllm_model.app import VLLMModel, VLLMModelConfig
from tests.weights_support import perturbed_checkpoint, weight_version

pytestmark = pytest.mark.vllm
MODEL = "tiny-qwen3"
LONG_TURN = 800  # generated ids: several seconds on the CPU (about 10), so the push lands while they are sampled


@pytest.fixture(scope="module")
def step_1(rl_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return perturbed_checkpoint(rl_model_dir, tmp_path_factory.mktemp("in-flight") / "step-1", seed=11)


class LongGeneration:
    """A long call streamed in a thread: `generating` is set once its first text is in (the engine is sampling it,
    which vLLM's running-requests gauge did not always show), and `message` is the hook's bundle from its final
    chunk once it ends."""

    def __init__(self, base_url: str) -> None:
        self.generating = threading.Event()
        self.message: dict[str, Any] = {}
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "Go on for a while."}],
            "max_tokens": LONG_TURN,
            "min_tokens": LONG_TURN,
            "logprobs": True,
            "seed": 5,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        self.thread = threading.Thread(target=self._run, args=(base_url, body))
        self.thread.start()

    def _run(self, base_url: str, body: dict[str, Any]) -> None:
        with httpx.stream("POST", f"{base_url}/v1/chat/completions", json=body, timeout=600) as answer:
            for line in answer.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                for choice in json.loads(line[6:]).get("choices") or []:
                    delta = choice.get("delta") or {}
                    if delta.get("content"):
                        self.generating.set()
                    if "generation_token_ids" in delta:
                        self.message = delta

    def wait_until_generating(self) -> None:
        assert self.generating.wait(timeout=120), "the long call sent no text in 120 s"
        time.sleep(0.3)  # some ids generated before the pause

    def result(self) -> dict[str, Any]:
        self.thread.join(timeout=600)
        assert self.message, "no bundle in the long call's final chunk"
        return self.message


@pytest.mark.parametrize("mode", ["keep", "wait"])
def test_a_request_in_flight_during_a_push_says_which_weights_sampled_it(
    rl_vllm_server: VLLMServer, rl_model_dir: Path, step_1: Path, mode: str
) -> None:
    url = rl_vllm_server.base_url
    push_weights([url], rl_model_dir, version=f"{mode}-before")
    call = LongGeneration(url)
    call.wait_until_generating()
    push_weights([url], step_1, version=f"{mode}-after", pause_mode=mode)
    message = call.result()
    generated = len(message["generation_token_ids"])
    assert message["weight_version"] == f"{mode}-before"
    if mode == "wait":  # it finished on the weights it started with
        assert "weight_version_spans" not in message or message["weight_version_spans"] is None
    else:  # frozen, then sampled on by the new weights: both spans, covering every id
        spans = message["weight_version_spans"]
        assert [span["version"] for span in spans] == ["keep-before", "keep-after"]
        assert spans[0]["start"] == 0 and spans[0]["end"] == spans[1]["start"] and spans[1]["end"] == generated
        assert 0 < spans[0]["end"] < generated
    assert weight_version(url) == f"{mode}-after"


@pytest.fixture
def adapter_on_rl_server(rl_vllm_server: VLLMServer) -> Iterator[str]:
    config = VLLMModelConfig(base_url=f"{rl_vllm_server.base_url}/v1", model=MODEL, return_token_id_information=True)
    with serve_in_thread(VLLMModel("policy_model", config).build_app()) as url:
        yield url


def test_an_episode_spanning_a_push_stays_exact_and_says_which_turn_came_from_which_weights(
    adapter_on_rl_server: str,
    rl_vllm_server: VLLMServer,
    rl_model_dir: Path,
    step_1: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    url = rl_vllm_server.base_url
    push_weights([url], rl_model_dir, version="episode-0")
    items: list[dict[str, Any]] = [{"role": "user", "content": "First question?"}]
    versions = []
    for turn, next_version in enumerate(("episode-1", None)):
        body = {"model": "m", "input": items, "max_output_tokens": 12, "temperature": 1.0, "seed": turn}
        response = httpx.post(f"{adapter_on_rl_server}/v1/responses", json=body, timeout=300).json()
        items = [*items, *response["output"]]
        versions.append(response["output"][-1]["weight_version"])
        if next_version is not None:
            push_weights([url], step_1, version=next_version)
            items.append({"role": "user", "content": "And now?"})
    assert versions == ["episode-0", "episode-1"]
    record = {"response": {"output": items}, "reward": 0.0}
    turns = bundled_turns(record)
    check_contiguous(turns)  # turn 2's prompt starts with turn 1's prompt + generated ids, across the push
    assert [turn.weight_version for turn in turns] == versions
    rollouts = tmp_path / "rollouts.jsonl"
    rollouts.write_text(json.dumps(record) + "\n")
    assert ngt(["check", str(rollouts)]) == 0
    printed = capsys.readouterr().out
    assert "rollouts spanning several weight versions: 1" in printed
    assert "turn 0 episode-0, turn 1 episode-1" in printed
