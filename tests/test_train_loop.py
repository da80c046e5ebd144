"""The RL loop on a real hooked vLLM: TRL's GRPOTrainer, nemo_gym_tok's rollout_func over the gym, weights pushed
and proven before each step. Synchronously: each step's episodes carry the pushed version, are token-contiguous, reach
TRL in the shapes it requires, and the learner's log probs of the sampled ids match the sampler's. One step ahead
(pushes in `keep` mode): each token's version and lag come from the records, and the weights TRL's loss takes are the
truncated ratio of the learner (the step's own checkpoint, recomputed here) over the records' sampler log probs.

The server is the shared float32 `rl_vllm_server` (tests/fixtures/train_servers.py), as `ngt train-demo` serves:
bfloat16 rounds the float32 learner's updated weights (measured with the training variant, the first step after an
update was off by 0.020 nats mean, docs/training.md), over the 0.01 this test holds the loop to."""

from __future__ import annotations

import json
import math
import time
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
AHEAD_STEPS = 3
CAP = 2.0
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


class OneStepBehind:
    """Wraps the rollout_func: from step 1 on, waits until the collector has finished that step's batch before the
    step pushes, so the batch was wholly drawn by the previous step's weights (lag 1), whatever the machine's speed.
    Keeps what was handed to TRL."""

    def __init__(self, rollout: Any) -> None:
        self.rollout, self.outputs = rollout, []

    def __call__(self, prompts: list[Any], trainer: Any) -> dict[str, Any]:
        step = int(trainer.state.global_step)
        deadline = time.monotonic() + 300
        while step and step not in self.rollout.collector.timings:
            assert time.monotonic() < deadline, f"the collector did not run ahead to batch {step}"
            time.sleep(0.05)
        output = self.rollout(prompts, trainer)
        self.outputs.append(output)
        return output


@pytest.fixture(scope="module")
def trained_ahead(
    train_gym: Gym, train_vllm_server: VLLMServer, train_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
):
    from nemo_gym_tok.train.correction import Correction
    from nemo_gym_tok.train.prompts import PromptRows
    from nemo_gym_tok.train.rollout import GymRollout
    from nemo_gym_tok.train.trainer import TrainingPlan, grpo_trainer, load_policy

    work = tmp_path_factory.mktemp("train-ahead")
    prefix = f"train-ahead-{uuid.uuid4().hex[:8]}-"
    model, tokenizer = load_policy(train_model_dir)
    rows = PromptRows([json.loads(line) for line in ROWS_FILE.read_text().splitlines() if line.strip()])
    plan = TrainingPlan(
        steps=AHEAD_STEPS,
        num_generations=2,
        prompts_per_step=2,
        max_staleness=1,
        correction=Correction("tis", tis_cap=CAP),
        pause_mode="keep",
    )
    rollout = GymRollout(
        rows,
        agent_url=train_gym.urls[AGENT],
        vllm_urls=[train_vllm_server.base_url],
        model_dir=train_model_dir,
        tokenizer=tokenizer,
        work_dir=work,
        agent=AGENT,
        version_label=lambda step: f"{prefix}{step}",
        keep_checkpoints=AHEAD_STEPS + 1,  # every step's weights stay, for the recomputation below
        text_pipeline=False,
        schedule=plan.schedule(rows),
        max_staleness=plan.max_staleness,
        correction=plan.correction,
        pause_mode=plan.pause_mode,
    )
    wrapped = OneStepBehind(rollout)
    trainer = grpo_trainer(model, tokenizer, rows, wrapped, plan, work / "trainer")
    try:
        trainer.train()
    finally:
        rollout.close()
    return rollout, wrapped, prefix


def records_of(rollout: Any, step: int) -> list[dict[str, Any]]:
    lines = (rollout.records_dir / f"step-{step:03d}.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines if line.strip()]
    return sorted(records, key=lambda record: int(record["rollout_id"]["row"]))


def test_the_collector_ran_one_step_ahead_and_every_token_says_so(trained_ahead) -> None:
    rollout, _, prefix = trained_ahead
    assert [m.step for m in rollout.metrics] == list(range(AHEAD_STEPS))
    for metrics in rollout.metrics:
        turns = [turn for record in records_of(rollout, metrics.step) for turn in bundled_turns(record)]
        # Read from the records, not from what the rollout computed: batch N was drawn by step N - 1's weights.
        drawn_by = f"{prefix}{max(0, metrics.step - 1)}"
        assert turns and {turn.weight_version for turn in turns} == {drawn_by}
        lag = 0 if metrics.step == 0 else 1
        assert metrics.lags == {lag: metrics.sampled_tokens}, metrics.line()
        assert metrics.contiguous == metrics.episodes == 4
    assert all(m.probe_seconds > 0 for m in rollout.metrics), "every push is proven"
    assert all(m.wait_seconds < m.collect_seconds for m in rollout.metrics[1:])  # batches 1 and 2 were ready


def test_the_loss_weights_are_the_learner_over_the_samplers_log_probs(trained_ahead) -> None:
    from nemo_gym_tok.records.training import rollout_to_training_sequence
    from nemo_gym_tok.train.learner_logprobs import learner_log_probs
    from nemo_gym_tok.train.logprob_gap import sampled_positions
    from nemo_gym_tok.train.trainer import load_policy

    rollout, wrapped, _ = trained_ahead
    moved = 0
    for step, output in enumerate(wrapped.outputs):
        learner_model, _ = load_policy(rollout.checkpoints_dir / f"step-{step}")  # the weights step N trained from
        sequences = [rollout_to_training_sequence(record) for record in records_of(rollout, step)]
        learner = learner_log_probs(
            learner_model, [s.token_ids for s in sequences], [sampled_positions(s) for s in sequences]
        )
        for index, (sequence, scores) in enumerate(zip(sequences, learner)):
            start = sequence.turns[0][0]
            weights = output["token_weight"][index]
            assert output["logprobs"][index] == [
                lp if sampled else 0.0 for lp, sampled in zip(sequence.log_probs[start:], sequence.loss_mask[start:])
            ]  # TRL's sampling log probs are the records' own
            for offset, sampled in enumerate(sequence.loss_mask[start:]):
                position = start + offset
                if not sampled:
                    assert weights[offset] == 0.0
                    continue
                expected = min(math.exp(scores[position] - sequence.log_probs[position]), CAP)
                assert weights[offset] == pytest.approx(expected, rel=1e-4, abs=1e-5)
                moved += step > 0 and abs(weights[offset] - 1.0) > 1e-3
    # At lag 1 the learner has moved: the weights are not all 1, so they carry the sampler's log probs into the loss.
    assert moved > 0


def test_a_push_refused_by_its_probe_marks_its_version_and_raises(
    train_vllm_server: VLLMServer,
    train_model_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The trainer's probe expects other weights than the server loads (its expected log probs shifted by 0.5 nats):
    the push is rolled back, and the push log refuses any token labelled with the version served unproven meanwhile."""
    import nemo_gym_tok.train.rollout as rollout_module
    from nemo_gym_tok.train.prompts import PromptRows
    from nemo_gym_tok.train.rollout import GymRollout
    from nemo_gym_tok.train.staleness import StaleWeightsError
    from nemo_gym_tok.train.trainer import load_policy
    from nemo_gym_tok.weights import WeightPushError

    honest = rollout_module.expected_log_probs
    monkeypatch.setattr(
        rollout_module, "expected_log_probs", lambda *args: tuple(value + 0.5 for value in honest(*args))
    )
    model, tokenizer = load_policy(train_model_dir)
    rows = PromptRows([json.loads(line) for line in ROWS_FILE.read_text().splitlines() if line.strip()])
    rollout = GymRollout(
        rows,
        agent_url="http://127.0.0.1:9",  # never called: the push fails first
        vllm_urls=[train_vllm_server.base_url],
        model_dir=train_model_dir,
        tokenizer=tokenizer,
        work_dir=tmp_path_factory.mktemp("refused-push"),
    )
    label = f"refused-{uuid.uuid4().hex[:8]}"
    with pytest.raises(WeightPushError) as caught:
        rollout.push(model, 0, label)
    assert caught.value.unproven_version == label
    assert train_vllm_server.base_url.removesuffix("/v1") in " ".join(caught.value.replicas)
    with pytest.raises(StaleWeightsError, match="failed its probe"):
        rollout.push_log.lag(label, label)
