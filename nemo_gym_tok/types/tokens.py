"""The token bundle: the exact prompt ids, generated ids and log probs of one model call."""

from __future__ import annotations

from typing import Annotated, Any

import orjson
from pydantic import BaseModel, ConfigDict, Field, Strict, ValidatorFunctionWrapHandler, WrapValidator, model_validator

MAX_TOKEN_ID = 2**31 - 1
"""vLLM keeps token ids as 32-bit ints; a larger id is a caller's mistake (past 64 bits orjson alone would read it as a
float: the gym's reader, nemo_gym_tok.common.exact_json, leaves such text to the stdlib)."""
_ID_LIST_CLASSES = bytes(
    ord("0") if ord("0") <= byte <= ord("9") else byte if byte == ord(",") else ord("x") for byte in range(256)
)
"""Maps every digit to "0", keeps ",", and every other byte to "x": one pass tells a list of plain ids apart."""
_TEN_DIGITS = b"0" * len(str(MAX_TOKEN_ID))
"""A number this long may pass MAX_TOKEN_ID; shorter ones never do."""


def plain_token_ids(ids: Any) -> bool:
    """Whether `ids` is a list of ints from 0 to 999,999,999 (no bool, float, string or nesting): what every real id
    list is, decided at C speed from its JSON, which orjson writes as digits and commas only (bools as true/false,
    floats with a point or an exponent, negatives with a sign). False leaves the list to the item-by-item check, which
    names the first bad id."""
    return plain_token_ids_json(ids) is not None


def plain_token_ids_json(ids: Any) -> bytes | None:
    """orjson's text of `ids` where plain_token_ids holds (a caller that hashes the ids reuses it), else None."""
    if type(ids) is not list:
        return None
    try:
        written = orjson.dumps(ids)
    except TypeError:  # an int past 64 bits, or a value JSON cannot hold
        return None
    classes = written[1:-1].translate(_ID_LIST_CLASSES)
    return written if b"x" not in classes and _TEN_DIGITS not in classes else None


def _validated_ids(value: Any, validate: ValidatorFunctionWrapHandler) -> list[int]:
    # A bundle holds thousands of ids, which pydantic checks one by one; the plain case is settled at C speed first.
    return list(value) if plain_token_ids(value) else validate(value)


# Strict: a bool, a float like 3.0 or a string "3" is a caller mistake, never silently coerced into an id.
TokenId = Annotated[int, Strict(), Field(ge=0, le=MAX_TOKEN_ID)]
TokenIds = Annotated[list[TokenId], WrapValidator(_validated_ids)]
LogProb = Annotated[float, Field(allow_inf_nan=True)]

BUNDLE_FIELDS = ("prompt_token_ids", "generation_token_ids", "generation_log_probs")
"""The bundle's field names, spelled only here: every layer (splice, contract, collect, adapter, bench) imports them."""
TELEMETRY_FIELDS = (
    "prefix_splice",
    "token_source",
    "constrained_by",
    "generation_forced_mask",
    "sampling",
    "model_fingerprint",
    "weight_version",
    "weight_version_spans",
    "replica",
    "image_runs",
)
"""Fields that travel with a bundle: kept on the output item that carries it, left out of what environments get."""
WEIGHT_VERSION_KEY = "weight_version"
WEIGHT_VERSION_SPANS_KEY = "weight_version_spans"
REPLICA_KEY = "replica"
IMAGE_RUNS_KEY = "image_runs"
PREFIX_KEY = "required_prefix_token_ids"
"""Top-level request field: the exact ids the prompt must start with (the previous call's prompt + generation)."""
NEW_SEGMENT_KEY = "start_token_segment"
"""Top-level request field: use the template's ids from this call on (the harness edited the history on purpose)."""
NEW_SEGMENT_REASON_KEY = "new_segment_reason"
"""Why a call started a new token segment (`prefix_splice.new_segment`): one of the two below."""
SEGMENT_ASKED = "asked"
"""The caller sent `start_token_segment: true`: it took the template's ids on purpose (an edited history, say)."""
SEGMENT_HISTORY_WITHOUT_IDS = "history_without_ids"
"""The adapter set it crossing vllm-router, for a history with assistant turns and no token ids: nobody asked, and
the rollout's ids are not contiguous there (`ngt check` fails it)."""
# 1 where the grammar left the sampler one token (nemo_gym_tok.contract.constrained.forced_mask), else 0.
ForcedFlag = Annotated[int, Strict(), Field(ge=0, le=1)]


class PrefixSplice(BaseModel):
    """Telemetry of the hooked vLLM server: whether it replaced template ids with the model's own."""

    model_config = ConfigDict(extra="allow")

    applied: bool
    template_differed: bool
    replaced_tokens: int


class WeightVersionSpan(BaseModel):
    """Generated ids [start, end) of one call (indexes into its generation_token_ids) were sampled by the weights vLLM
    labelled `version` (vLLM's own `WeightVersionSpan`)."""

    model_config = ConfigDict(extra="forbid")

    version: Annotated[str, Strict()]
    start: Annotated[int, Strict()]
    end: Annotated[int, Strict()]


class ImageRunRecord(BaseModel):
    """Where one image of a call's prompt sits in its expanded `prompt_token_ids`: `length` placeholder ids from
    `position`, and `digest`, vLLM's hash of the image and its processing settings (its multimodal cache key)."""

    model_config = ConfigDict(extra="forbid")

    position: Annotated[int, Strict(), Field(ge=0)]
    length: Annotated[int, Strict(), Field(ge=1)]
    digest: str | None = None


def weight_versions_problem(weight_version: Any, spans: Any, generation_length: int | None) -> str | None:
    """What is wrong with a bundle's `weight_version` and `weight_version_spans` as plain JSON values (None when
    nothing): the version is a string or None; spans, where present, are {version, start, end} objects with int
    bounds, 0 <= start < end <= the number of generated ids, each starting where the one before ended, together
    covering every generated id, and the first one's version is `weight_version`."""
    if weight_version is not None and not isinstance(weight_version, str):
        return f"weight_version must be a string or null, got {type(weight_version).__name__}"
    if spans is None:
        return None
    if generation_length is None:
        return "weight_version_spans without generation_token_ids: the spans index into the generated ids"
    if not isinstance(spans, list) or not spans:
        return "weight_version_spans must be a non-empty list of {version, start, end} (or absent)"
    expected_start = 0
    for index, span in enumerate(spans):
        if not isinstance(span, dict) or set(span) != {"version", "start", "end"}:
            return f"weight_version_spans[{index}] must be an object with exactly version, start and end"
        version, start, end = span["version"], span["start"], span["end"]
        if not isinstance(version, str):
            return f"weight_version_spans[{index}].version must be a string"
        if type(start) is not int or type(end) is not int:
            return f"weight_version_spans[{index}]: start and end must be integers"
        if not 0 <= start < end <= generation_length:
            return (
                f"weight_version_spans[{index}] is [{start}, {end}): spans need 0 <= start < end <= "
                f"{generation_length} (the number of generated ids)"
            )
        if start != expected_start:
            return (
                f"weight_version_spans[{index}] starts at {start}, where the spans before it end at {expected_start}:"
                " spans must be contiguous"
            )
        expected_start = end
    if expected_start != generation_length:
        return (
            f"weight_version_spans end at {expected_start}, not at {generation_length}: they must cover every "
            "generated id"
        )
    if weight_version != spans[0]["version"]:
        return (
            f"weight_version {weight_version!r} is not the first span's version {spans[0]['version']!r} (the "
            "version that sampled the first generated id)"
        )
    return None


class TokenBundleMixin(BaseModel):
    """Adds the optional bundle (all three fields or none) and splice telemetry to a message or item model."""

    model_config = ConfigDict(extra="allow")

    prompt_token_ids: TokenIds | None = None
    generation_token_ids: TokenIds | None = None
    generation_log_probs: list[LogProb] | None = None
    prefix_splice: PrefixSplice | None = None
    token_source: str | None = None
    """Which source the adapter took the prompt ids from: message, return_token_ids or tokenize."""
    constrained_by: list[str] | None = None
    """What put a grammar over this call's sampling (`tool_choice:required`, `response_format:json_schema`, ...);
    [] for a free call, None where unknown (records written before the field existed)."""
    generation_forced_mask: list[ForcedFlag] | None = None
    """Per generated id: 1 where the call was constrained and the reported log prob is exactly 0.0 (forced)."""
    sampling: dict[str, Any] | None = None
    """The call's effective sampling parameters (request, else the model's generation_config.json, else vLLM's
    defaults) and `logprobs_mode`: nemo_gym_tok.contract.provenance.effective_sampling."""
    model_fingerprint: dict[str, str] | None = None
    """sha256 of the served tokenizer.json and chat template (`sha256` over both): nemo_gym_tok.contract.provenance."""
    weight_version: Annotated[str, Strict()] | None = None
    """The vLLM weight version (its `/weight_info` label, `"default"` until set) that sampled the call's first
    generated id. None is unknown: a record written before the field, a vLLM without per-output versions (before
    0.32) and no `/weight_info` route, or a version that changed during a call the adapter could not see into. Never
    a guess."""
    replica: str | None = None
    """Which vLLM server sampled the call, as the hooked server names itself (`http://host:port`, or its
    $NEMO_GYM_TOK_REPLICA): behind a router, the worker the router chose. None where unknown (a stock vLLM)."""
    image_runs: list[ImageRunRecord] | None = None
    """A vision model's call: each image of the prompt, in order, where its placeholder ids sit and its digest ([]
    for a call without images); None on a text model or where unknown."""
    weight_version_spans: list[WeightVersionSpan] | None = None
    """Present only when the call's generated ids span more than one version (weights pushed while it generated):
    contiguous [start, end) spans over generation_token_ids covering all of them, the first one's version being
    `weight_version`."""

    @model_validator(mode="after")
    def _bundle_is_all_or_none(self) -> TokenBundleMixin:
        if (
            self.prompt_token_ids is None
            and self.generation_token_ids is None
            and self.generation_log_probs is None
            and self.generation_forced_mask is None
            and self.weight_version_spans is None
        ):  # most messages of a history: nothing to check (a lone weight_version is a string already)
            return self
        present = [name for name in BUNDLE_FIELDS if getattr(self, name) is not None]
        if present and len(present) != len(BUNDLE_FIELDS):
            missing = [name for name in BUNDLE_FIELDS if name not in present]
            raise ValueError(f"token bundle is all or none: got {', '.join(present)} without {', '.join(missing)}")
        if present and len(self.generation_token_ids or ()) != len(self.generation_log_probs or ()):
            raise ValueError(
                f"generation_token_ids ({len(self.generation_token_ids or ())}) and generation_log_probs "
                f"({len(self.generation_log_probs or ())}) must have the same length"
            )
        mask, generation = self.generation_forced_mask, self.generation_token_ids
        if mask is not None and generation is not None and len(mask) != len(generation):
            raise ValueError(
                f"generation_forced_mask ({len(mask)}) and generation_token_ids ({len(generation)}) must have the "
                "same length"
            )
        spans = self.weight_version_spans
        problem = weight_versions_problem(
            self.weight_version,
            None if spans is None else [span.model_dump() for span in spans],
            None if generation is None else len(generation),
        )
        if problem is not None:
            raise ValueError(problem)
        return self

    @property
    def has_bundle(self) -> bool:
        return self.prompt_token_ids is not None


# The names above must be the model's own fields: a renamed field then fails at import, not in a dict lookup.
if _unknown := set(BUNDLE_FIELDS) - TokenBundleMixin.model_fields.keys():
    raise TypeError(f"BUNDLE_FIELDS names {sorted(_unknown)}, which TokenBundleMixin does not define")


def bundle_of(data: dict[str, Any]) -> dict[str, Any]:
    """The bundle and telemetry fields present in a plain dict (message or item)."""
    return {name: data[name] for name in (*BUNDLE_FIELDS, *TELEMETRY_FIELDS) if data.get(name) is not None}
