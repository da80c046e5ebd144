"""nemo_gym_tok.train's pure parts: episodes for TRL, the log-prob gaps, the text pipeline's figures, weight-version
checks, prompts back to rows, the reward function, the step metrics."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest

from nemo_gym_tok.records.logprob_check import NaiveSequence
from nemo_gym_tok.records.training import TrainingSequence
from nemo_gym_tok.train.correction import CorrectionFigures
from nemo_gym_tok.train.episodes import SUPPLIED_LOG_PROB, episode_from_sequence, rollout_output
from nemo_gym_tok.train.logprob_gap import GapFigures, exact_gap, gap_figures, sampled_positions, total
from nemo_gym_tok.train.prompts import PromptRows, prompt_key
from nemo_gym_tok.train.reward import REWARD_KEY, gym_reward
from nemo_gym_tok.train.step_metrics import StepMetrics
from nemo_gym_tok.train.text_pipeline import TextPipelineFigures, compared_positions, text_pipeline_figures
from nemo_gym_tok.train.weight_check import StaleWeightsError, check_weight_versions, version_problems

# An episode: prompt [1, 2, 3], turn 0 sampled [10, 11], a user turn [4, 5], turn 1 sampled [12, 13, 14].
IDS = [1, 2, 3, 10, 11, 4, 5, 12, 13, 14]
MASK = [0, 0, 0, 1, 1, 0, 0, 1, 1, 1]
LOGPROBS = [0.0, 0.0, 0.0, -1.0, -2.0, 0.0, 0.0, -0.5, -1.5, -3.0]
TURNS = [(3, 5), (7, 10)]


def sequence(**changes: Any) -> TrainingSequence:
    fields: dict[str, Any] = {
        "token_ids": IDS,
        "loss_mask": MASK,
        "log_probs": LOGPROBS,
        "turns": TURNS,
        "reward": 0.25,
        "constrained_by": [[], []],
        "forced_mask": [0] * len(IDS),
        "weight_versions": ["3", "3"],
        "weight_version_spans": [None, None],
    }
    return TrainingSequence(**{**fields, **changes})


def test_an_episode_splits_at_the_end_of_its_first_prompt() -> None:
    episode = episode_from_sequence(sequence())
    assert episode.prompt_ids == [1, 2, 3]
    assert episode.completion_ids == [10, 11, 4, 5, 12, 13, 14]
    assert episode.env_mask == [1, 1, 0, 0, 1, 1, 1]
    assert episode.logprobs == [-1.0, -2.0, SUPPLIED_LOG_PROB, SUPPLIED_LOG_PROB, -0.5, -1.5, -3.0]
    assert episode.reward == 0.25


def test_supplied_positions_never_carry_a_log_prob() -> None:
    noisy = [0.0, 0.0, 0.0, -1.0, -2.0, -9.0, -9.0, -0.5, -1.5, -3.0]  # a record with values where nothing was sampled
    assert episode_from_sequence(sequence(log_probs=noisy)).logprobs[2:4] == [SUPPLIED_LOG_PROB] * 2


@pytest.mark.parametrize(("changes", "message"), [({"turns": []}, "no model turn"), ({"reward": None}, "no reward")])
def test_an_episode_without_turns_or_reward_is_refused(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        episode_from_sequence(sequence(**changes))


def test_rollout_output_has_what_grpo_trainer_reads() -> None:
    episodes = [episode_from_sequence(sequence()), episode_from_sequence(sequence(reward=1.0))]
    output = rollout_output(episodes, REWARD_KEY)
    assert set(output) == {"prompt_ids", "completion_ids", "env_mask", "logprobs", REWARD_KEY}
    assert all(len(values) == 2 for values in output.values())
    for completion, mask, logprobs in zip(output["completion_ids"], output["env_mask"], output["logprobs"]):
        assert len(completion) == len(mask) == len(logprobs)
    assert output[REWARD_KEY] == [0.25, 1.0]


def test_gap_figures_count_per_token_gaps_and_clipped_ratios() -> None:
    figures = gap_figures([-1.0, -2.0, -3.0], [-1.0, -2.1, -2.0])
    assert figures.tokens == 3 and figures.total == pytest.approx(1.1) and figures.max == pytest.approx(1.0)
    assert figures.mean == pytest.approx(1.1 / 3)
    # exp(-0.1) = 0.905 stays inside [0.8, 1.2]; exp(1.0) = 2.72 does not.
    assert figures.clipped == 1 and figures.clip_share == pytest.approx(1 / 3)
    assert gap_figures([-1.0], [-1.0 + math.log(1.25)]).clipped == 1  # 1.25 > 1.2
    assert gap_figures([-1.0], [-1.0 + math.log(0.85)]).clipped == 0
    assert gap_figures([-1.0], [50_000.0]).clipped == 1  # no overflow
    with pytest.raises(ValueError):
        gap_figures([-1.0], [])


def test_empty_figures_are_nan_and_add_up() -> None:
    empty = GapFigures()
    assert math.isnan(empty.mean) and math.isnan(empty.max) and math.isnan(empty.clip_share)
    both = total([gap_figures([-1.0], [-1.5]), empty, gap_figures([-1.0, -1.0], [-1.0, -3.0])])
    assert (both.tokens, both.total, both.max, both.clipped) == (3, pytest.approx(2.5), 2.0, 2)


def test_the_exact_gap_reads_sampled_positions_and_keeps_turn_kinds_apart() -> None:
    learner = [0.0] * len(IDS)
    for index in sampled_positions(sequence()):
        learner[index] = LOGPROBS[index] - 0.001
    assert sampled_positions(sequence()) == [3, 4, 7, 8, 9]
    by_kind = exact_gap(sequence(constrained_by=[[], ["tool_choice:required"]]), learner)
    assert by_kind["free"].tokens == 2 and by_kind["free"].mean == pytest.approx(0.001)
    assert by_kind["constrained"].tokens == 3 and by_kind["unknown"].tokens == 0
    assert exact_gap(sequence(constrained_by=[None, None]), learner)["unknown"].tokens == 5
    with pytest.raises(ValueError):
        exact_gap(sequence(), learner[:-1])


def test_the_text_pipeline_compares_turns_position_by_position() -> None:
    # Re-rendered: prompt [1, 2, 3, 9]; turn 0 re-tokenized as [10, 99] + end marker 7; user [4]; turn 1 as [12, 13].
    naive = NaiveSequence([1, 2, 3, 9, 10, 99, 7, 4, 12, 13], [(4, 7), (8, 10)])
    assert compared_positions(sequence(), naive) == [4, 5, 8, 9]  # the end marker was never sampled
    learner = [0.0] * 10
    learner[4], learner[5], learner[8], learner[9] = -1.0, -7.0, -0.5, -1.4
    figures = text_pipeline_figures(sequence(), naive, learner)
    # Turn 0: 10 == 10, 99 != 11; turn 1: 12, 13 equal, the third position (14) is missing.
    assert (figures.positions, figures.differing) == (5, 2)
    assert figures.differing_share == pytest.approx(0.4)
    # Gaps where both have a position: |-1 - -1|, |-7 - -2|, |-0.5 - -0.5|, |-1.4 - -1.5|.
    assert figures.gap.tokens == 4 and figures.gap.total == pytest.approx(5.1) and figures.gap.max == pytest.approx(5)
    assert figures.gap.clipped == 1


def test_the_text_pipeline_leaves_constrained_turns_out_and_refuses_missing_turns() -> None:
    naive = NaiveSequence([1, 2, 3, 10, 11, 4, 12, 13, 14], [(3, 5), (6, 9)])
    constrained = sequence(constrained_by=[["tool_choice:required"], []])
    figures = text_pipeline_figures(constrained, naive, [-1.0] * 9)
    assert figures.positions == 3 and figures.differing == 0
    assert compared_positions(constrained, naive) == [6, 7, 8]
    with pytest.raises(ValueError, match="assistant turns"):
        text_pipeline_figures(sequence(), NaiveSequence(IDS, [(3, 5)]), [0.0] * len(IDS))
    summed = sum([figures, figures], TextPipelineFigures())
    assert (summed.positions, summed.gap.tokens) == (6, 6)


def test_every_turn_must_carry_the_pushed_version() -> None:
    assert version_problems(sequence(), "3") == []
    assert version_problems(sequence(weight_versions=["3", "2"]), "3") == ["turn 1 was sampled by version '2'"]
    assert version_problems(sequence(weight_versions=[None, "3"]), "3") == ["turn 0 was sampled by version None"]
    spans = [{"version": "2", "start": 0, "end": 1}, {"version": "3", "start": 1, "end": 3}]
    assert "turn 1 spans versions '2' [0, 1), '3' [1, 3)" in version_problems(
        sequence(weight_version_spans=[None, spans]), "3"
    )
    check_weight_versions([("a", sequence())], "3")
    with pytest.raises(StaleWeightsError, match=r"1 of 2 episodes .*version '3'.*b: turn 0"):
        check_weight_versions([("a", sequence()), ("b", sequence(weight_versions=["2", "3"]))], "3")


ROWS = [
    {"responses_create_params": {"input": [{"role": "user", "content": "one"}], "max_output_tokens": 4}, "x": 1},
    {"responses_create_params": {"input": "two"}},
]


def test_prompts_lead_back_to_their_rows() -> None:
    rows = PromptRows(ROWS)
    assert rows.prompts() == [[{"role": "user", "content": "one"}], [{"role": "user", "content": "two"}]]
    # As a data set hands a prompt back: keys reordered, a key another message has filled with null.
    assert rows.row_for([{"content": "one", "role": "user", "name": None}]) is ROWS[0]
    assert rows.row_for("two") is ROWS[1]
    with pytest.raises(KeyError):
        rows.row_for([{"role": "user", "content": "three"}])
    assert prompt_key([{"role": "user", "content": "é"}]) == '[{"content":"é","role":"user"}]'


def test_two_rows_with_one_prompt_and_other_fields_are_refused() -> None:
    PromptRows([ROWS[0], dict(ROWS[0])])  # the same row twice is fine
    with pytest.raises(ValueError, match="row 1 has the prompt of an earlier row"):
        PromptRows([ROWS[0], {**ROWS[0], "x": 2}])
    with pytest.raises(ValueError):
        PromptRows([{"no": "params"}])


def test_the_reward_function_reads_the_rollouts_extra_key() -> None:
    assert gym_reward(["p", "q"], ["a", "b"], **{REWARD_KEY: [0.5, 1]}) == [0.5, 1.0]
    with pytest.raises(KeyError):
        gym_reward(["p"], ["a"])
    with pytest.raises(ValueError):
        gym_reward(["p"], ["a"], **{REWARD_KEY: [0.5, 1.0]})


def test_step_metrics_print_one_line_and_write_json_without_nan() -> None:
    metrics = StepMetrics(
        step=4,
        version="4",
        episodes=8,
        contiguous=8,
        rewards=[0.25, 0.75],
        sampled_tokens=96,
        exact={"free": gap_figures([-1.0], [-1.002]), "constrained": GapFigures(), "unknown": GapFigures()},
        text=TextPipelineFigures(4, 1, gap_figures([-1.0, -1.0], [-1.0, -2.0])),
        push_seconds=0.4,
        collect_seconds=1.0,
        measure_seconds=0.5,
        wait_seconds=0.25,
        probe_seconds=0.06,
        lags={0: 90, 1: 6},
        correction=CorrectionFigures(tokens=96, capped=2, by_lag={0: gap_figures([-1.0], [-1.0])}),
    )
    line = metrics.line()
    assert line.startswith("step  4 | reward 0.500 | exact gap free mean 2.0e-03 max 2.0e-03 clip 0.0%")
    assert "text: ids differ 25.0%, gap mean 0.500 max 1.00, clip 50.0%" in line
    assert "lag 0:93.8% 1:6.2% | capped 2 masked 0 | push 0.40s (probe 60 ms) | waited 0.2s | contiguous 8/8" in line
    row = metrics.to_json()
    assert row["lag_tokens"] == {"0": 90, "1": 6} and row["capped"] == 2 and row["lag0_gap_mean"] == 0.0
    assert row["probe_seconds"] == 0.06 and row["wait_seconds"] == 0.25
    assert row["exact_constrained_gap_mean"] is None and row["text_differing_share"] == 0.25
    assert row["reward_mean"] == 0.5 and row["weight_version"] == "4"
    json.dumps(row, allow_nan=False)
    # Read back, the step prints the same line and writes the same row: a committed metrics file is recomputed by the
    # code that printed it.
    again = StepMetrics.from_json(json.loads(json.dumps(row)))
    assert again.line() == line and again.to_json() == row
    assert again.exact["constrained"].tokens == 0 and again.text is not None and again.text.gap.clipped == 1
