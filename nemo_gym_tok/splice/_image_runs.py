"""Images in a token history: each image's run of placeholder ids, collapsed for the splice and proven once expanded.

A chat template renders an image as one placeholder (`<|vision_start|><|image_pad|><|vision_end|>`, say); the
model's multimodal processor then expands that one pad to as many pads as the image has patches, after tokenization,
where the splice runs. A previous turn's prompt ids hold the expanded runs. Spliced as they are, vLLM would expand
every pad of a run again (one image of N pads becomes 2N - 1, and the count check still passes). So the splice works
in the template's space: each run collapses to one pad (`collapse_image_runs`), the splice and its structural check
run as for text, vLLM expands the result, and `check_expanded_prefix` proves the expanded prompt starts with the
previous turn's ids, each image's run where it was and as long as it was.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from nemo_gym_tok.splice._ids import message_field
from nemo_gym_tok.splice._refusals import SpliceError

IMAGE_PART_TYPES = frozenset({"image_url", "image", "input_image", "image_pil", "image_embeds"})
"""Content part types that carry an image: OpenAI chat's, the Responses API's, and vLLM's own."""


class ImageMismatchError(SpliceError):
    """A history's image ids cannot be matched to the request's images: refused, never spliced."""


def count_image_parts(message: Any) -> int:
    """The image parts of one chat message's content (a dict or a parsed message object)."""
    content = message_field(message, "content")
    if not isinstance(content, list):
        return 0
    return sum(1 for part in content if message_field(part, "type") in IMAGE_PART_TYPES)


@dataclass(frozen=True)
class ImageMarkers:
    """The ids a model's template and processor mark an image with."""

    start_id: int
    pad_id: int
    end_id: int
    other_pad_ids: tuple[int, ...] = ()
    """Placeholders of other modalities (a video's pad): never in a history the splice accepts."""

    @property
    def placeholder_ids(self) -> frozenset[int]:
        """Every id that marks media: a model must never sample one (the hook bans them)."""
        return frozenset((self.start_id, self.pad_id, self.end_id, *self.other_pad_ids))


@dataclass(frozen=True)
class ImageRun:
    """One image's pads in expanded ids: the `index`-th image, `length` pads from `position`."""

    index: int
    position: int
    length: int


@dataclass(frozen=True)
class CollapsedPrefix:
    """A prefix with each image's run collapsed to one pad, and where the runs were in the expanded ids."""

    ids: list[int]
    runs: tuple[ImageRun, ...]
    prompt_length: int | None
    """How many of `ids` are the prompt's (the rest the generation), for a prefix that came with that split."""


def collapse_image_runs(
    prefix: Sequence[int], markers: ImageMarkers, *, prompt_length: int | None = None, field: str = "the prefix"
) -> CollapsedPrefix:
    """`prefix` with every run of image pads between a start and an end marker collapsed to one pad.

    Raises ImageMismatchError for a placeholder id that belongs to no image: a pad outside a start/end pair or an
    empty run (a placeholder sampled by the model or typed by a user), another modality's pad, a start marker not
    closed, or any placeholder in the generated ids (after `prompt_length`). `field` names the prefix in messages.
    """
    start, pad, end = markers.start_id, markers.pad_id, markers.end_id
    others = frozenset(markers.other_pad_ids)
    ids: list[int] = []
    runs: list[ImageRun] = []
    collapsed_prompt_length = None
    position, size = 0, len(prefix)
    while position < size:
        if position == prompt_length:
            collapsed_prompt_length = len(ids)
        token = prefix[position]
        if prompt_length is not None and position >= prompt_length and token in markers.placeholder_ids:
            raise ImageMismatchError(
                f"{field}: generated id {position - prompt_length} is the media placeholder {token}: the model "
                "sampled a placeholder, which stands for no image; a history holding it cannot be spliced"
            )
        if token in others:
            raise ImageMismatchError(
                f"{field}[{position}] is the placeholder {token} of a modality the splice does not take (a video's): "
                "only images can be matched"
            )
        if token == pad:
            raise ImageMismatchError(
                f"{field}[{position}] is an image pad ({pad}) outside an image (no start marker {start} before its "
                "run): a placeholder typed or sampled in text, which stands for no image"
            )
        if token != start:
            ids.append(token)
            position += 1
            continue
        run_start = position + 1
        run_end = run_start
        while run_end < size and prefix[run_end] == pad and (prompt_length is None or run_end < prompt_length):
            run_end += 1
        if run_end == run_start:
            raise ImageMismatchError(
                f"{field}[{position}] starts image {len(runs)} with no pad after it: an image's run is at least one "
                f"pad ({pad})"
            )
        if prompt_length is not None and run_end >= prompt_length:
            raise ImageMismatchError(
                f"{field}: image {len(runs)}'s run reaches the generated ids: the model sampled a placeholder, which "
                "stands for no image; a history holding it cannot be spliced"
            )
        if run_end >= size or prefix[run_end] != end:
            raise ImageMismatchError(
                f"{field}: image {len(runs)}'s run of {run_end - run_start} pads from {run_start} is not closed by the "
                f"end marker {end}"
            )
        runs.append(ImageRun(len(runs), run_start, run_end - run_start))
        ids += [start, pad, end]
        position = run_end + 1
    if prompt_length is not None and prompt_length >= size:
        collapsed_prompt_length = len(ids)
    return CollapsedPrefix(ids, tuple(runs), collapsed_prompt_length)


def check_expanded_prefix(
    expanded: Sequence[int],
    placeholders: Sequence[tuple[int, int]],
    prefix: Sequence[int],
    runs: Sequence[ImageRun],
) -> None:
    """The expanded prompt must start with `prefix` (the previous turn's ids), and the request's images must sit
    where `prefix`'s runs are: image k of the request (`placeholders[k]`: offset, length, in request order) at run k's
    position with run k's length, for every run of `prefix`, and no image of the request inside `prefix` beyond them.
    Raises ImageMismatchError naming the first image that differs and how."""
    end = len(prefix)
    inside = [(offset, length) for offset, length in placeholders if offset < end]
    for run in runs:
        if run.index >= len(placeholders):
            raise ImageMismatchError(
                f"image {run.index} of the history's ids ({run.length} pads at {run.position}) has no image in the "
                f"request, which carries {len(placeholders)}: an image was dropped from the messages"
            )
        offset, length = placeholders[run.index]
        if offset != run.position:
            raise ImageMismatchError(
                f"image {run.index} sits at {run.position} in the history's ids but at {offset} in this request: an "
                "image was added, dropped or moved in the history"
            )
        if length != run.length:
            raise ImageMismatchError(
                f"image {run.index} is {run.length} pads in the history's ids but the request's image {run.index} "
                f"expands to {length}: another image, or the same one at another size, than the model saw"
            )
    if len(inside) > len(runs):
        offset, length = inside[len(runs)]
        raise ImageMismatchError(
            f"the request's image {len(runs)} ({length} pads at {offset}) lies inside the history's ids, which hold "
            f"no image there: an image was added to an earlier message"
        )
    if len(expanded) < end or list(expanded[:end]) != list(prefix):
        where = next((i for i, (a, b) in enumerate(zip(expanded, prefix)) if a != b), min(len(expanded), end))
        raise ImageMismatchError(
            f"the expanded prompt does not start with the history's ids: they part at {where} of {end}, outside any "
            "image's run"
        )
