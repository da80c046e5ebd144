"""`ngt check` on a vision rollout's image records (nemo_gym_tok/records/image_runs.py): in place, and kept."""

from __future__ import annotations

from nemo_gym_tok.records.image_runs import image_runs_problem, images_in

PAD = 7
PROMPT_1 = [1, 6, PAD, PAD, PAD, 8, 2]
PROMPT_2 = [*PROMPT_1, 3, 4, 6, PAD, PAD, 8, 5]
RUNS_1 = [{"position": 2, "length": 3, "digest": "a"}]
RUNS_2 = [*RUNS_1, {"position": 10, "length": 2, "digest": "b"}]


def test_runs_in_place_and_kept_pass_and_count_the_last_calls_images() -> None:
    turns = [(PROMPT_1, RUNS_1), (PROMPT_2, RUNS_2)]
    assert image_runs_problem(turns) is None
    assert images_in(turns) == 2
    assert image_runs_problem([(PROMPT_1, None)]) is None and images_in([(PROMPT_1, None)]) == 0


def test_a_run_its_prompt_ids_do_not_hold_fails() -> None:
    for runs in (
        [{"position": 2, "length": 2, "digest": "a"}],  # short of the whole run
        [{"position": 1, "length": 3, "digest": "a"}],  # off by one
        [{"position": 5, "length": 9, "digest": "a"}],  # past the end
        [{"position": "2", "length": 3}],  # malformed
    ):
        assert image_runs_problem([(PROMPT_1, runs)]) is not None, runs


def test_an_image_that_changed_between_calls_fails() -> None:
    swapped = [{**RUNS_2[0], "digest": "z"}, RUNS_2[1]]
    problem = image_runs_problem([(PROMPT_1, RUNS_1), (PROMPT_2, swapped)])
    assert problem == "model call 2: image 0 of the call before is not where it was, or not the same image"
    dropped = [RUNS_2[1]]
    assert image_runs_problem([(PROMPT_1, RUNS_1), (PROMPT_2, dropped)]) is not None
