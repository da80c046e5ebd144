"""The hook's image support: a vision model's placeholder ids, banned from sampling, collapsed for the splice, and the
expanded prompt proven against the previous turn's ids (the pure rules: nemo_gym_tok.splice's image runs)."""

from __future__ import annotations

import weakref
from typing import Any

from nemo_gym_tok.splice import (
    CollapsedPrefix,
    ImageMarkers,
    ImageMismatchError,
    PrefixSource,
    check_expanded_prefix,
    collapse_image_runs,
    count_image_parts,
    message_field,
)
from nemo_gym_tok.types.tokens import IMAGE_RUNS_KEY
from nemo_gym_tok.vllm.chat_rendering import host_of

MARKER_FIELDS = ("vision_start_token_id", "image_token_id", "vision_end_token_id")
"""Where a vision model's config names its image markers (Qwen2-VL's scheme, which PaddleOCR-VL and others share)."""
BANNED_BIAS = -100.0
"""The logit bias that keeps a placeholder from being sampled: OpenAI's and vLLM's floor, which multiplies its odds by
e^-100 (about 4e-44): never, in practice."""


_runs_in_flight: dict[int, list[dict[str, Any]]] = {}
"""Each vision request's image runs, from its preprocessing until its response's bundle takes them."""


def image_runs(engine_inputs: Any) -> list[dict[str, Any]] | None:
    """Each image of the one prompt vLLM's processor made: its placeholder ids' position and length in the expanded
    ids, and vLLM's hash of it (the digest the next turn's images are held to)."""
    if not isinstance(engine_inputs, list) or len(engine_inputs) != 1 or not isinstance(engine_inputs[0], dict):
        return None
    placeholders = (engine_inputs[0].get("mm_placeholders") or {}).get("image") or []
    hashes = (engine_inputs[0].get("mm_hashes") or {}).get("image") or []
    return [
        {"position": item.offset, "length": item.length, "digest": hashes[k] if k < len(hashes) else None}
        for k, item in enumerate(placeholders)
    ]


def remember_image_runs(request: Any, engine_inputs: Any) -> None:
    """Keep the request's image runs until its response's bundle reads them (dropped with the request)."""
    runs = image_runs(engine_inputs)
    if runs is None:
        return
    key = id(request)
    _runs_in_flight[key] = runs
    weakref.finalize(request, _runs_in_flight.pop, key, None)


def image_run_fields(request: Any) -> dict[str, Any]:
    """`image_runs` for the bundle of a vision request's answer ({} for a text model)."""
    runs = _runs_in_flight.pop(id(request), None)
    return {} if runs is None else {IMAGE_RUNS_KEY: runs}


def image_markers(online: Any) -> ImageMarkers | None:
    """The served model's image markers, read once per server; None for a text model or a vision model whose config
    names none the splice knows (its image histories are refused)."""

    def learn() -> ImageMarkers | None:
        if not is_vision_model(online):
            return None
        config = online.model_config
        hf_config = config.hf_config
        found = [getattr(hf_config, name, None) for name in MARKER_FIELDS]
        if not all(isinstance(value, int) for value in found):
            return None
        video = getattr(hf_config, "video_token_id", None)
        return ImageMarkers(*found, other_pad_ids=(video,) if isinstance(video, int) else ())

    return host_of(online).fact("image markers", learn)


def is_vision_model(online: Any) -> bool:
    return bool(getattr(getattr(online, "model_config", None), "is_multimodal_model", False))


def ban_placeholders(request: Any, markers: ImageMarkers) -> None:
    """Placeholder ids stand for media, never for text: a sampled one would poison every later turn's history (it
    stands for no image), so the request's logit bias bans them. Raw log probs (vLLM's default) are unaffected."""
    if not hasattr(request, "logit_bias"):
        return  # /tokenize and other routes that sample nothing
    bias = dict(request.logit_bias or {})
    bias.update({str(token): BANNED_BIAS for token in markers.placeholder_ids})
    request.logit_bias = bias


def carries_images(prompt: Any) -> bool:
    """A rendered chat prompt with media for the multimodal processor."""
    data = prompt.get("multi_modal_data") if isinstance(prompt, dict) else None
    return bool(data)


class ImageSplice:
    """One request's prefix in the template's space (each image run one pad) and what the expanded prompt must hold."""

    def __init__(self, source: PrefixSource, collapsed: CollapsedPrefix, digests: list[Any] | None = None) -> None:
        self.expanded_prefix = source.prefix
        self.collapsed = collapsed
        self.digests = digests
        """The bundled message's own record of its images' digests (`image_runs`), None when it carries none."""
        self.source = PrefixSource(collapsed.ids, source.message_index, source.explicit, collapsed.prompt_length)

    @classmethod
    def of(cls, online: Any, source: PrefixSource, images: bool, messages: list[Any]) -> ImageSplice | None:
        """The image form of `source` on a vision model (None on a text model, or for a history with no placeholder
        when the request carries no image). Raises ImageMismatchError for a placeholder that stands for no image,
        and for images on a vision model whose markers the splice does not know."""
        if not is_vision_model(online):
            return None
        markers = image_markers(online)
        if markers is None:
            if images:
                raise ImageMismatchError(
                    "this vision model's config names no image markers the splice knows "
                    f"({', '.join(MARKER_FIELDS)}): its image histories cannot be proven, so they are refused"
                )
            return None
        if not images and markers.placeholder_ids.isdisjoint(source.prefix):
            return None  # the common text-only turn: no Python loop over the prefix
        field = "required_prefix_token_ids" if source.explicit else f"messages[{source.message_index}]'s token ids"
        collapsed = collapse_image_runs(source.prefix, markers, prompt_length=source.prompt_length, field=field)
        recorded = None if source.explicit else message_field(messages[source.message_index], IMAGE_RUNS_KEY)
        digests = [message_field(run, "digest") for run in recorded] if isinstance(recorded, list) else None
        splice = cls(source, collapsed, digests)
        sent = sum(count_image_parts(message) for message in messages[: source.message_index + 1])
        held = len(splice.collapsed.runs)
        if sent != held:
            raise ImageMismatchError(
                f"the history's ids hold {held} image(s) up to messages[{source.message_index}], its messages "
                f"{sent}: an image was {'dropped from' if sent < held else 'added to'} the messages the ids cover"
            )
        return splice

    def check(self, engine_inputs: Any) -> None:
        """The expanded prompt vLLM's processor made starts with the previous turn's ids, every image in place."""
        runs = image_runs(engine_inputs)
        if runs is None:
            raise ImageMismatchError("the prefix splice supports chats rendered to one prompt")
        check_expanded_prefix(
            engine_inputs[0].get("prompt_token_ids") or [],
            [(run["position"], run["length"]) for run in runs],
            self.expanded_prefix,
            self.collapsed.runs,
        )
        hashes = [run["digest"] for run in runs]
        for run in self.collapsed.runs:
            recorded = self.digests[run.index] if self.digests and run.index < len(self.digests) else None
            now = hashes[run.index] if run.index < len(hashes) else None
            if recorded is not None and now is not None and recorded != now:
                raise ImageMismatchError(
                    f"image {run.index} is not the image the model saw: the history's bundle records its digest "
                    f"{str(recorded)[:16]}..., the request's image {run.index} hashes to {str(now)[:16]}... (same "
                    "size, other pixels or processing)"
                )
