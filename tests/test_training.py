"""Rollout record -> training sequence, and the contiguity check behind it."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from nemo_gym_tok.records.contiguity import NotContiguousError, bundled_turns, check_contiguous, check_file
from nemo_gym_tok.records.training import (
    NoTokenBundlesError,
    SeveralSegmentsError,
    rollout_to_training_sequence,
    rollout_to_training_sequences,
)

END = 9


def item(prompt, generation, **extra) -> dict:
    return {
        "type": "message",
        "role": "assistant",
        "prompt_token_ids": prompt,
        "generation_token_ids": generation,
        "generation_log_probs": [-0.1 * (i + 1) for i in range(len(generation))],
        **extra,
    }


def record(*items, reward=1.0) -> dict:
    return {"question": "q", "response": {"output": list(items)}, "reward": reward}


def test_three_call_episode_masks_exactly_the_generated_ids() -> None:
    episode = record(
        {"type": "reasoning", "summary": []},
        item([1, 2, 3], [10, 11, END]),  # ended on the terminator
        {"type": "function_call_output", "call_id": "c", "output": "x"},
        item([1, 2, 3, 10, 11, END, 4, 5], [12, 13]),  # cut by max_tokens...
        item([1, 2, 3, 10, 11, END, 4, 5, 12, 13, END, 6], [14]),  # ...the template closed it with END
    )
    sequence = rollout_to_training_sequence(episode)
    assert sequence.token_ids == [1, 2, 3, 10, 11, END, 4, 5, 12, 13, END, 6, 14]
    assert sequence.loss_mask == [0, 0, 0, 1, 1, 1, 0, 0, 1, 1, 0, 0, 1]
    assert sequence.turns == [(3, 6), (8, 10), (12, 13)]
    assert sequence.log_probs[3:6] == pytest.approx([-0.1, -0.2, -0.3])
    assert sequence.log_probs[10] == 0.0  # the template's terminator after a cut turn is not generated
    assert sequence.reward == 1.0 and len(sequence) == 13


def test_non_contiguous_record_names_turn_position_and_context() -> None:
    episode = record(item([1, 2], [3, 4]), item([1, 2, 3, 7, 5], [6]))
    with pytest.raises(
        NotContiguousError, match=r"model call 1 .* at position 3 \(expected 4, found 7\); before: '1 2 3 4'"
    ) as info:
        rollout_to_training_sequence(episode, decode=lambda ids: " ".join(map(str, ids)))
    assert (info.value.turn, info.value.position) == (1, 3)


def test_shorter_prompt_is_not_contiguous() -> None:
    with pytest.raises(NotContiguousError, match="found end of prompt"):
        check_contiguous(bundled_turns(record(item([1, 2], [3]), item([1, 2], [4]))))


def test_record_without_bundles() -> None:
    with pytest.raises(NoTokenBundlesError, match="return_token_id_information: true"):
        rollout_to_training_sequence(record({"type": "message", "role": "assistant", "content": "hi"}))


def test_repaired_turns_come_from_splice_telemetry() -> None:
    turns = bundled_turns(
        record(
            item([1], [2]),
            item([1, 2, 3], [4], prefix_splice={"applied": True, "template_differed": True, "replaced_tokens": 2}),
        )
    )
    assert [t.repaired for t in turns] == [False, True]


@given(
    st.lists(
        st.tuples(st.lists(st.integers(0, 50), max_size=5), st.lists(st.integers(0, 50), min_size=1, max_size=5)),
        min_size=1,
        max_size=6,
    )
)
def test_generated_contiguous_episodes_round_trip(turns) -> None:
    """Build contiguous prompts from (supplied, generated) pieces; the sequence gives the pieces back."""
    items, ids = [], []
    for supplied, generated in turns:
        ids += supplied
        items.append(item(list(ids), generated))
        ids += generated
    sequence = rollout_to_training_sequence(record(*items))
    assert sequence.token_ids == ids
    assert sum(sequence.loss_mask) == sum(len(g) for _, g in turns)
    assert [sequence.token_ids[a:b] for a, b in sequence.turns] == [g for _, g in turns]
    assert all(m == 1 for a, b in sequence.turns for m in sequence.loss_mask[a:b])


def test_new_token_segment_starts_a_new_sequence() -> None:
    restarted = {"applied": False, "template_differed": False, "replaced_tokens": 0, "new_segment": True}
    episode = record(
        item([1, 2], [3, END]),
        item([7, 8], [4, END], prefix_splice=restarted),  # the harness compacted the history: new ids from here
        item([7, 8, 4, END, 5], [6]),
    )
    first, second = rollout_to_training_sequences(episode)
    assert first.token_ids == [1, 2, 3, END] and first.turns == [(2, 4)]
    assert second.token_ids == [7, 8, 4, END, 5, 6] and second.loss_mask == [0, 0, 1, 1, 0, 1]
    with pytest.raises(SeveralSegmentsError, match="2 token segments"):
        rollout_to_training_sequence(episode)
    without_flag = record(
        *[{k: v for k, v in i.items() if k != "prefix_splice"} for i in episode["response"]["output"]]
    )
    with pytest.raises(NotContiguousError):  # the same record without the segment mark is a broken rollout
        rollout_to_training_sequences(without_flag)


def test_replaced_end_token_is_contiguous_and_keeps_the_sampled_id() -> None:
    RETURN, CLOSE = 20, 21  # GPT-OSS: the model ends on <|return|>, the history renders <|end|>
    replaced = {"applied": True, "template_differed": True, "replaced_tokens": 1, "end_token_replaced": True}
    episode = record(item([1, 2], [3, RETURN]), item([1, 2, 3, CLOSE, 5], [6], prefix_splice=replaced))
    (sequence,) = rollout_to_training_sequences(episode)
    assert sequence.token_ids == [1, 2, 3, RETURN, 5, 6]
    assert sequence.loss_mask == [0, 0, 1, 1, 0, 1]
    with pytest.raises(NotContiguousError):  # without the telemetry the swap is a contiguity break
        rollout_to_training_sequences(record(item([1, 2], [3, RETURN]), item([1, 2, 3, CLOSE, 5], [6])))


def test_check_file_counts_asked_new_segments_and_fails_unasked_ones(tmp_path) -> None:
    restarted = {"applied": False, "template_differed": False, "replaced_tokens": 0, "new_segment": True}
    asked = {**restarted, "new_segment_reason": "asked"}
    path = tmp_path / "rollouts.jsonl"
    path.write_text(json.dumps(record(item([1, 2], [3, END]), item([7, 8], [4], prefix_splice=asked))) + "\n")
    report = check_file(path)
    assert report.ok and report.new_segments == 1 and report.unasked_segments == 0
    assert "asked for (start_token_segment; one training sequence each): 1" in report.format()
    for splice, why in (
        ({**restarted, "new_segment_reason": "history_without_ids"}, "its history carried no token ids"),
        (restarted, "prefix_splice.new_segment_reason says None"),  # written before the reason was
    ):
        path.write_text(json.dumps(record(item([1, 2], [3, END]), item([7, 8], [4], prefix_splice=splice))) + "\n")
        report = check_file(path)
        assert not report.ok and report.contiguous == 0 and report.unasked_segments == 1 and report.new_segments == 0
        assert "model call 2 started a new token segment nobody asked for: " + why in report.failures[0]
