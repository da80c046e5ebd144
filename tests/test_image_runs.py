"""The splice's image runs (nemo_gym_tok/splice/_image_runs.py): collapsed for the splice, proven once expanded."""

from __future__ import annotations

import pytest

from nemo_gym_tok.splice import (
    ImageMarkers,
    ImageMismatchError,
    ImageRun,
    SpliceError,
    check_expanded_prefix,
    collapse_image_runs,
)

START, PAD, END, VIDEO = 900, 901, 902, 903
MARKERS = ImageMarkers(START, PAD, END, (VIDEO,))


def image(pads: int) -> list[int]:
    return [START, *[PAD] * pads, END]


def test_each_run_collapses_to_one_pad_and_is_remembered_where_it_was() -> None:
    prefix = [1, 2, *image(4), 3, *image(2), *image(6), 4, 5]
    collapsed = collapse_image_runs(prefix, MARKERS, prompt_length=len(prefix) - 1)
    assert collapsed.ids == [1, 2, START, PAD, END, 3, START, PAD, END, START, PAD, END, 4, 5]
    assert collapsed.runs == (ImageRun(0, 3, 4), ImageRun(1, 10, 2), ImageRun(2, 14, 6))
    assert collapsed.prompt_length == len(collapsed.ids) - 1  # the generated id stays the generated id
    assert collapse_image_runs([1, 2, 3], MARKERS).runs == ()


@pytest.mark.parametrize(
    ("prefix", "prompt_length", "words"),
    [
        ([1, PAD, 2], None, "outside an image"),  # typed or sampled in text
        ([1, START, END, 2], None, "no pad after it"),
        ([1, START, PAD, PAD, 2], None, "not closed"),
        ([1, *image(2), VIDEO], None, "does not take"),
        ([1, *image(2), 7, PAD], 5, "model sampled a placeholder"),
        ([1, 2, 3, START], 3, "model sampled a placeholder"),
        ([1, START, PAD, END], 3, "model sampled a placeholder"),  # the end marker generated
    ],
)
def test_a_placeholder_that_stands_for_no_image_is_refused(
    prefix: list[int], prompt_length: int | None, words: str
) -> None:
    with pytest.raises(ImageMismatchError, match=words) as refused:
        collapse_image_runs(prefix, MARKERS, prompt_length=prompt_length)
    assert isinstance(refused.value, SpliceError)  # the hook answers every SpliceError as a 400


def test_an_expanded_prompt_that_keeps_every_image_in_place_passes() -> None:
    prefix = [1, *image(4), 3, *image(2), 9]
    runs = collapse_image_runs(prefix, MARKERS).runs
    expanded = [*prefix, 5, *image(3), 6]  # the new turn adds an image after the history
    check_expanded_prefix(expanded, [(2, 4), (9, 2), (14, 3)], prefix, runs)


@pytest.mark.parametrize(
    ("placeholders", "expanded_tail", "words"),
    [
        ([(2, 4)], [], r"image 1 .* has no image in the request"),  # an image dropped
        ([(2, 4), (10, 2)], [], r"image 1 sits at 9 .* at 10"),  # moved (text inserted before it)
        ([(2, 4), (9, 3)], [], r"image 1 is 2 pads .* expands to 3"),  # another size
        ([(2, 4), (9, 2), (11, 1)], [], r"image 2 .* lies inside the history"),  # added inside the history
    ],
)
def test_each_image_that_differs_is_named(
    placeholders: list[tuple[int, int]], expanded_tail: list[int], words: str
) -> None:
    prefix = [1, *image(4), 3, *image(2), 9]
    runs = collapse_image_runs(prefix, MARKERS).runs
    with pytest.raises(ImageMismatchError, match=words):
        check_expanded_prefix([*prefix, *expanded_tail], placeholders, prefix, runs)


def test_text_that_differs_outside_the_images_is_refused() -> None:
    prefix = [1, *image(2), 3, 4]
    runs = collapse_image_runs(prefix, MARKERS).runs
    with pytest.raises(ImageMismatchError, match="part at 6 of 7"):
        check_expanded_prefix([1, *image(2), 3, 8, 5], [(2, 2)], prefix, runs)
    with pytest.raises(ImageMismatchError, match="part at 5 of 7"):
        check_expanded_prefix([1, *image(2)], [(2, 2)], prefix, runs)
