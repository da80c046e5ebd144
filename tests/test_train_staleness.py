"""Asynchronous RL's pure parts: each token's weight version and lag, the staleness bound, the corrections from the
sampler's log probs, the schedule collection runs ahead along, and the collector's gate."""

from __future__ import annotations

import math
import threading
import time
from typing import Any

import pytest

from nemo_gym_tok.records.training import TrainingSequence
from nemo_gym_tok.train.ahead import AheadCollector, CollectorStoppedError
from nemo_gym_tok.train.correction import Correction, loss_fields, token_weights
from nemo_gym_tok.train.prompts import PromptRows, prompt_key, prompt_of
from nemo_gym_tok.train.staleness import PushLog, StaleWeightsError, lag_counts, token_lags, token_versions

# prompt [1, 2, 3], turn 0 sampled [10, 11], a user turn [4, 5], turn 1 sampled [12, 13, 14].
IDS = [1, 2, 3, 10, 11, 4, 5, 12, 13, 14]
MASK = [0, 0, 0, 1, 1, 0, 0, 1, 1, 1]
LOGPROBS = [0.0, 0.0, 0.0, -1.0, -2.0, 0.0, 0.0, -0.5, -1.5, -3.0]
TURNS = [(3, 5), (7, 10)]


def sequence(versions: list[str | None], spans: list[Any] | None = None) -> TrainingSequence:
    return TrainingSequence(
        IDS, MASK, LOGPROBS, TURNS, 1.0, [[], []], None, versions, spans if spans is not None else [None, None]
    )


def log_of(*labels: str) -> PushLog:
    log = PushLog()
    for label in labels:
        log.pushed(label)
    return log


def test_token_versions_follow_turns_and_spans() -> None:
    spans = [None, [{"version": "a", "start": 0, "end": 1}, {"version": "b", "start": 1, "end": 3}]]
    versions = token_versions(sequence(["a", "a"], spans))
    assert versions == [None, None, None, "a", "a", None, None, "a", "b", "b"]
    # A span that does not cover a generated id leaves it unknown, never guessed.
    partial = [None, [{"version": "b", "start": 1, "end": 3}]]
    assert token_versions(sequence(["a", "a"], partial))[7] is None


def test_lags_count_pushes_not_step_numbers() -> None:
    log = log_of("run-0", "run-1", "run-5")  # a label skipped (a step without a push) is not a lag
    assert token_lags(sequence(["run-1", "run-5"]), log, "run-5", max_staleness=1) == [
        None, None, None, 1, 1, None, None, 0, 0, 0,
    ]  # fmt: skip
    lags = token_lags(sequence(["run-0", "run-1"]), log, "run-5", max_staleness=2)
    assert lag_counts([lags]) == {1: 3, 2: 2}


@pytest.mark.parametrize(
    ("versions", "trainer", "bound", "message"),
    [
        (["run-0", "run-1"], "run-1", 0, "1 pushes behind .* over the staleness bound 0"),
        ([None, "run-1"], "run-1", 4, "position 3: a sampled token has no weight version"),
        (["default", "run-1"], "run-1", 4, "'default', which this run never pushed"),
        (["run-1", "run-1"], "run-0", 4, "newer than the trainer's"),
    ],
)
def test_a_token_whose_lag_is_unknown_or_over_the_bound_is_refused(
    versions: list[str | None], trainer: str, bound: int, message: str
) -> None:
    with pytest.raises(StaleWeightsError, match=message):
        token_lags(sequence(versions), log_of("run-0", "run-1"), trainer, bound)


def test_a_version_that_failed_its_probe_is_refused_and_cannot_be_pushed_again() -> None:
    log = log_of("run-0")
    log.failed("run-1")
    with pytest.raises(StaleWeightsError, match="'run-1', which failed its probe"):
        token_lags(sequence(["run-0", "run-1"]), log, "run-0", 4)
    with pytest.raises(ValueError, match="pushed before"):
        log.pushed("run-1")


def test_tis_weights_use_the_samplers_log_probs_as_the_behaviour_policy() -> None:
    sampler = [0.0, -1.0, -2.0, -0.1]
    learner = [0.0, -0.5, -2.5, -0.1 + math.log(5.0)]
    lags = [None, 1, 2, 0]
    weights, figures = token_weights(Correction("tis", tis_cap=2.0), sampler, learner, lags)
    assert weights == pytest.approx([0.0, math.exp(0.5), math.exp(-0.5), 2.0])
    assert (figures.tokens, figures.capped, figures.masked) == (3, 1, 0)
    assert figures.by_lag[1].mean == pytest.approx(0.5) and figures.by_lag[0].mean == pytest.approx(math.log(5.0))
    # Other sampler log probs, other weights: the behaviour policy is what the sampler recorded.
    moved, _ = token_weights(Correction("tis", tis_cap=2.0), [0.0, -0.5, -2.0, -0.1], learner, lags)
    assert moved[1] == pytest.approx(1.0) and moved != weights


def test_mask_drops_tokens_beyond_the_mask_lag_and_none_keeps_all() -> None:
    sampler, learner, lags = [-1.0, -1.0, -1.0], [-1.0, -3.0, -1.0], [0, 1, None]
    masked, figures = token_weights(Correction("mask", mask_lag=0), sampler, learner, lags)
    assert masked == [1.0, 0.0, 0.0] and figures.masked == 1
    kept, figures = token_weights(Correction("none"), sampler, learner, lags)
    assert kept == [1.0, 1.0, 0.0] and (figures.capped, figures.masked) == (0, 0)
    assert figures.lag_share(1) == pytest.approx(0.5)


def test_the_rollout_output_carries_the_weights_or_the_mask() -> None:
    weights = [[1.0, 0.0, 1.5], [0.0, 2.0]]
    assert loss_fields(Correction("tis"), weights) == {"token_weight": weights}
    assert loss_fields(Correction("mask"), [[1.0, 0.0, 1.0], [0.0, 1.0]]) == {"env_mask": [[1, 0, 1], [0, 1]]}
    assert loss_fields(Correction("none"), weights) == {}


def test_bad_corrections_are_refused() -> None:
    for bad in ({"mode": "ratio"}, {"tis_cap": 0.5}, {"tis_cap": math.inf}, {"mask_lag": -1}):
        with pytest.raises(ValueError):
            Correction(**bad)


def rows(count: int) -> PromptRows:
    return PromptRows([{"responses_create_params": {"input": f"prompt {index}"}} for index in range(count)])


def test_the_schedule_repeats_each_row_per_group_and_walks_every_row_each_pass() -> None:
    schedule = rows(8).schedule(steps=6, prompts_per_step=2, num_generations=3, seed=0)
    assert len(schedule) == 6 and all(len(batch) == 6 for batch in schedule)
    for batch in schedule:
        assert batch[0] is batch[1] is batch[2] and batch[3] is batch[4] is batch[5]
    first_pass = [prompt_key(prompt_of(batch[index])) for batch in schedule[:4] for index in (0, 3)]
    assert len(set(first_pass)) == 8  # one shuffle per pass: every row once before any again
    assert schedule == rows(8).schedule(steps=6, prompts_per_step=2, num_generations=3, seed=0)
    assert schedule != rows(8).schedule(steps=6, prompts_per_step=2, num_generations=3, seed=1)


class Recorder:
    """A collect function that records when each batch started and what the gate allowed then."""

    def __init__(self, collector_ref: list[AheadCollector]) -> None:
        self.started: list[int] = []
        self.ref = collector_ref

    def __call__(self, step: int, batch: Any) -> list[dict[str, Any]]:
        self.started.append(step)
        return [{"step": step, "row": row} for row in batch]


@pytest.mark.parametrize("staleness", [0, 2])
def test_the_collector_starts_batch_n_only_once_step_n_minus_staleness_is_allowed(staleness: int) -> None:
    ref: list[AheadCollector] = []
    recorder = Recorder(ref)
    collector = AheadCollector([["a"], ["b"], ["c"], ["d"], ["e"]], recorder, staleness)
    ref.append(collector)
    collector.allow(0)
    assert collector.take(0) == [{"step": 0, "row": "a"}]
    time.sleep(0.2)  # the collector has time to run as far as the gate lets it
    assert recorder.started == list(range(min(5, 1 + staleness)))
    collector.allow(1)
    assert collector.take(1)[0]["row"] == "b"
    time.sleep(0.2)
    assert recorder.started == list(range(min(5, 2 + staleness)))
    collector.stop()
    assert collector.timings[0].seconds >= 0.0


def test_a_collection_failure_reaches_the_trainer_and_a_stopped_collector_says_so() -> None:
    def failing(step: int, batch: Any) -> list[dict[str, Any]]:
        if step == 1:
            raise RuntimeError("3 of 8 rollouts failed")
        return []

    collector = AheadCollector([["a"], ["b"], ["c"]], failing, 4)
    collector.allow(0)
    assert collector.take(0) == []
    with pytest.raises(CollectorStoppedError, match="batch 1 was not collected: 3 of 8 rollouts failed"):
        collector.take(1)

    blocked = AheadCollector([["a"], ["b"]], lambda step, batch: [], 0)
    blocked.allow(0)
    blocked.take(0)
    waiter = threading.Thread(target=lambda: pytest.raises(CollectorStoppedError, blocked.take, 1))
    waiter.start()
    blocked.stop()
    waiter.join(5)
    assert not waiter.is_alive()


def test_the_table_reads_its_rows_reach_and_targets() -> None:
    from nemo_gym_tok.train.staleness_table import RunFigures, markdown_table, steps_to_reach, targets

    assert steps_to_reach([0.1, 0.9, 0.9, 0.7, 0.9, 0.9]) == 3  # trailing 3-step means: 0.633, then 0.833
    assert steps_to_reach([0.9, 0.9]) is None and steps_to_reach([0.5, 0.8, 0.9, 0.9]) == 3

    def row(staleness: int, correction: str, first: float, last: float, **changes: Any) -> RunFigures:
        fields: dict[str, Any] = dict(
            name=f"staleness-{staleness}", max_staleness=staleness, correction=correction, steps=30,
            reward_first=first, reward_last=last, version_reward_first=first, version_reward_last=last,
            steps_to_reach=9, train_seconds=300.0, trainer_idle_share=0.1, sampler_idle_share=0.5,
            lag_shares={"0": 0.25, "2": 0.75}, capped_share=0.01, masked_share=0.0, gap_by_lag={"0": 3e-7, "2": 0.2},
            episodes=240, contiguous=240, unknown_versions=0, probe_ms_mean=60.0, step_seconds_mean=10.0,
        )  # fmt: skip
        return RunFigures(**{**fields, **changes})

    tis = Correction("tis").describe()
    rows = [row(0, tis, 0.3, 0.9), row(2, tis, 0.32, 0.88)]
    assert all(targets(rows).values())
    gain = "staleness 2 with correction: reward gain by drawing weights within 0.05 of the synchronous run's"
    last = "staleness 2 with correction: last 5 steps' reward within 0.05 of the synchronous run's"
    assert not targets([row(0, tis, 0.3, 0.9), row(2, tis, 0.3, 0.8)])[gain]
    # A lower first window by step (older weights' episodes) is not a miss; a lower end is, whatever the gain.
    lagged_start = row(2, tis, 0.15, 0.9, version_reward_first=0.31)
    assert all(targets([row(0, tis, 0.3, 0.9), lagged_start]).values())
    low_end = row(2, tis, 0.2, 0.84, version_reward_first=0.2, version_reward_last=0.8)
    assert targets([row(0, tis, 0.3, 0.9), low_end]) == {**targets(rows), last: False}
    assert not targets([*rows, row(4, "none", 0.3, 0.9, unknown_versions=3)])["every token's weights known (0 unknown)"]
    table = markdown_table(rows)
    assert (
        table.count("\n") == 4
        and "| 2 | token TIS (cap 2) | 0.320 / 0.880 (+0.560) | 0.320 / 0.880 (+0.560) | 9 |" in table
    )
    assert "0: 25.0%, 2: 75.0%" in table and "0: 3e-07, 2: 0.2" in table


def test_the_docs_staleness_table_is_the_committed_runs() -> None:
    """docs/training.md shows the table `make train-async` wrote for the run committed as docs/train-async.json."""
    from pathlib import Path

    from nemo_gym_tok.train.staleness_table import RunFigures, markdown_table, read_table

    docs = Path(__file__).resolve().parents[1] / "docs"
    rows = [RunFigures.from_json(row) for row in read_table(docs / "train-async.json")]
    assert [row.max_staleness for row in rows] == [0, 1, 2, 4, 4]
    assert markdown_table(rows) in (docs / "training.md").read_text(encoding="utf-8")
    assert all(row.contiguous == row.episodes == 240 and row.unknown_versions == 0 for row in rows)
