"""The RL loop on a real hooked vLLM: TRL's GRPOTrainer, nemo_gym_tok's rollout_func over the gym, weights pushed
before each step. Each step's episodes carry the pushed version, are token-contiguous, reach TRL in the shapes it
requires, and the learner's log probs of the sampled ids match the sampler's.

The server is the training tests' float32 one (tests/fixtures/train_servers.py), as `ngt train-demo` serves. The shared
`rl_vllm_server` serves bfloat16, which rounds the float32 learner's updated weights: measured with the training
variant, the first step after an update was off by 0.020 nats mean (docs/training.md), over the 0.01 this test holds
the loop to."""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import pytest

from nemo_gym_tok.records.contiguity import bundled_turns, check_file
from nemo_gym_tok.servers.launcher import Gym
from nemo_gym_tok.vllm_server import VLLMServer

# TRL 1.16 warns on import that it was tried up to vLLM 0.31; nothing here uses TRL's vLLM paths.
pytestmark = [pytest.mark.vllm, pytest.mark.filterwarnings("ignore:TRL currently supports vLLM versions")]

ROOT = Path(__file__).resolve().parents[1]
ROWS_FILE = ROOT / "resources_servers" / "non_ascii" / "data" / "example.jsonl"
AGENT = "non_ascii_agent"
STEPS = 2
GAP_NATS = 0.01


class Recording:
    """Wraps the rollout_func and keeps what it handed TRL, call by call."""

    def __init__(self, rollout: Any) -> None:
        self.rollout, self.outputs = rollout, []

    def __call__(self, prompts: list[Any], trainer: Any) -> dict[str, Any]:
        self.prompts = prompts
        output = self.rollout(prompts, trainer)
        self.outputs.append(output)
        return output


@pytest.fixture(scope="module")
def trained(
    train_gym: Gym, train_vllm_server: VLLMServer, train_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
):
    from nemo_gym_tok.train.prompts import PromptRows
    from nemo_gym_tok.train.rollout import GymRollout
    from nemo_gym_tok.train.trainer import TrainingPlan, grpo_trainer, load_policy

    work = tmp_path_factory.mktemp("train-loop")
    prefix = f"train-loop-{uuid.uuid4().hex[:8]}-"  # new labels, also on a server reused from a URL
    model, tokenizer = load_policy(train_model_dir)
    rows = PromptRows([json.loads(line) for line in ROWS_FILE.read_text().splitlines() if line.strip()])
    rollout = GymRollout(
        rows,
        agent_url=train_gym.urls[AGENT],
        vllm_urls=[train_vllm_server.base_url],
        model_dir=train_model_dir,
        tokenizer=tokenizer,
        work_dir=work,
        agent=AGENT,
        version_label=lambda step: f"{prefix}{step}",
    )
    recording = Recording(rollout)
    plan = TrainingPlan(steps=STEPS, num_generations=2, prompts_per_step=2)
    trainer = grpo_trainer(model, tokenizer, rows, recording, plan, work / "trainer")
    trainer.train()
    return trainer, rollout, recording, prefix, plan


def test_each_step_pushed_and_trained_on_its_own_weights(trained) -> None:
    trainer, rollout, _, prefix, _ = trained
    assert trainer.state.global_step == STEPS
    assert [m.step for m in rollout.metrics] == list(range(STEPS))
    for metrics in rollout.metrics:
        records = (rollout.records_dir / f"step-{metrics.step:03d}.jsonl").read_text().splitlines()
        turns = [turn for line in records for turn in bundled_turns(json.loads(line))]
        # The label this test gave the step, against the one vLLM stamped on every bundle the step's records hold.
        assert turns and {turn.weight_version for turn in turns} == {f"{prefix}{metrics.step}"}
        assert metrics.version == turns[0].weight_version
        assert all(turn.weight_version_spans is None for turn in turns)


def test_every_episode_is_contiguous_and_the_exact_gap_is_small(trained) -> None:
    _, rollout, _, _, plan = trained
    for metrics in rollout.metrics:
        path = rollout.records_dir / f"step-{metrics.step:03d}.jsonl"
        # `ngt check`'s own walk of the step's records, not the loop's count of the episodes it converted.
        report = check_file(path)
        assert report.contiguous == report.rollouts == metrics.contiguous == metrics.episodes == plan.episodes_per_step
        records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        generated = sum(len(turn.generation_token_ids) for record in records for turn in bundled_turns(record))
        free = metrics.exact["free"]
        assert free.tokens == metrics.sampled_tokens == generated > 0
        assert free.mean < GAP_NATS, metrics.line()
        assert metrics.exact["constrained"].tokens == 0  # free sampling only
        assert metrics.text is not None and metrics.text.positions == metrics.sampled_tokens


def test_the_rollout_output_has_the_shapes_grpo_trainer_requires(trained) -> None:
    _, rollout, recording, _, plan = trained
    assert len(recording.outputs) == STEPS
    for output, metrics in zip(recording.outputs, rollout.metrics):
        assert {"prompt_ids", "completion_ids", "logprobs", "env_mask"} <= output.keys()
        assert all(len(output[key]) == plan.episodes_per_step for key in output)
        for prompt, completion, mask, logprobs in zip(
            output["prompt_ids"], output["completion_ids"], output["env_mask"], output["logprobs"]
        ):
            assert prompt and len(completion) == len(mask) == len(logprobs)
            assert set(mask) == {0, 1} and mask[0] == 1  # the completion opens with the first sampled id
            assert all(lp == 0.0 for lp, m in zip(logprobs, mask) if not m)
            assert all(lp <= 0.0 for lp in logprobs)
        # Re-read from the step's records (in the rows' order, as the loop collects them): every sampled id is one
        # the records say was generated, every reward the environment's.
        lines = (rollout.records_dir / f"step-{metrics.step:03d}.jsonl").read_text().splitlines()
        records = sorted((json.loads(line) for line in lines if line.strip()), key=lambda r: r["rollout_id"]["row"])
        generated = sum(len(turn.generation_token_ids) for record in records for turn in bundled_turns(record))
        assert sum(map(sum, output["env_mask"])) == generated
        rewards = [record["reward"] for record in records]
        assert output["gym_reward"] == rewards and all(0.0 <= r <= 1.0 for r in rewards)


def test_a_step_labelled_with_another_version_is_refused(trained) -> None:
    from nemo_gym_tok.records.training import rollout_to_training_sequence
    from nemo_gym_tok.train.weight_check import StaleWeightsError, check_weight_versions

    _, rollout, _, prefix, _ = trained
    line = (rollout.records_dir / "step-000.jsonl").read_text().splitlines()[0]
    sequence = rollout_to_training_sequence(json.loads(line))
    check_weight_versions([("episode", sequence)], f"{prefix}0")
    with pytest.raises(StaleWeightsError):
        check_weight_versions([("episode", sequence)], f"{prefix}1")
