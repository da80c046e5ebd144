"""What the hook wraps and uses inside vLLM, the releases it supports, and the check that vLLM has them in place."""

from __future__ import annotations

import functools
import importlib
import inspect
import re
from typing import Any

from nemo_gym_tok.types.tokens import weight_versions_problem
from nemo_gym_tok.vllm import routes
from nemo_gym_tok.vllm.routes import ROUTE_METHODS

ALLOW_UNTESTED_ENV = "NEMO_GYM_TOK_ALLOW_UNTESTED_VLLM"
SUPPORTED_VLLM = ((0, 29), (0, 34))
"""The vLLM releases the hook supports, as (major, minor): from the first (inclusive) to the second (exclusive), i.e.
0.29 to 0.33 (docs/vllm-versions.md). Inside the range the hook installs whenever `check_internals()` finds what it
wraps; outside it only with NEMO_GYM_TOK_ALLOW_UNTESTED_VLLM=1 (and the same check)."""


# module, class, method: what the hook wraps. A vLLM upgrade that moves any of these fails `check_internals()`.
PATCHED_METHODS = (
    ("vllm.renderers.online_renderer", "OnlineRenderer", "preprocess_chat"),
    ("vllm.renderers.online_renderer", "OnlineRenderer", "warmup"),
    ("vllm.entrypoints.openai.chat_completion.serving", "OpenAIServingChat", "chat_completion_full_generator"),
    ("vllm.renderers.online_renderer", "OnlineRenderer", "_make_request_with_harmony"),
    ("vllm.entrypoints.openai.chat_completion.serving", "OpenAIServingChat", "chat_completion_stream_generator"),
    ("vllm.renderers.base", "BaseRenderer", "tokenize_prompts_async"),
)
# Other internals the wrappers use.
# preprocess_chat's parameters the splice reads (by name, as vLLM's callers pass them).
PREPROCESS_CHAT_PARAMETERS = (
    "request",
    "messages",
    "default_template",
    "default_template_content_format",
    "default_template_kwargs",
    "tool_dicts",
)
# tokenize_prompts_async's parameters: the rendered text prompts and the tokenization parameters. A prompt that
# already holds `prompt_token_ids` is not tokenized again (the splice relies on that: `ngt vllm-compat` checks it).
TOKENIZE_PROMPTS_PARAMETERS = ("prompts", "params")
# _make_request_with_harmony's parameters, and what it returns: (Harmony messages, [{"prompt_token_ids": ...}]).
HARMONY_PARAMETERS = ("request", "should_include_tools")
USED_SYMBOLS = (
    ("vllm.exceptions", "VLLMValidationError"),
    ("vllm.renderers.params", "ChatParams"),
    ("vllm.renderers.params", "merge_kwargs"),
    ("vllm.entrypoints.openai.chat_completion.protocol", "ChatCompletionResponse"),
    ("vllm.entrypoints.openai.chat_completion.protocol", "ChatCompletionRequest"),
    ("vllm.entrypoints.openai.chat_completion.protocol", "ChatCompletionToolsParam"),
)
# Dataclass fields of vLLM's outputs the answer wrappers read (chat_responses.py): (module, class, field). Each
# release from FIELD_SINCE on must have it; before that the bundle says None (unknown) for what it gives.
OUTPUTS_MODULE = "vllm.outputs"
WEIGHT_VERSIONS_FIELD = (OUTPUTS_MODULE, "CompletionOutput", "weight_versions")
"""The generated ids' weight version spans (`list[WeightVersionSpan] | None`, set on the final output only)."""
USED_FIELDS = (
    WEIGHT_VERSIONS_FIELD,
    (OUTPUTS_MODULE, "WeightVersionSpan", "version"),
    (OUTPUTS_MODULE, "WeightVersionSpan", "start"),
    (OUTPUTS_MODULE, "WeightVersionSpan", "end"),
)
FIELD_SINCE: dict[tuple[str, str, str], tuple[int, int]] = dict.fromkeys(USED_FIELDS, (0, 32))
"""The first vLLM release, as (major, minor), with each USED_FIELDS field (0.29 to 0.31 have no per-output weight
versions: `ngt vllm-compat` reads it from each wheel). Absent from that release or a later one, the field moved and
check_internals() names it; absent from an earlier one, the hook's bundles say weight_version None there."""
TOKEN_REUSE = ("vllm.renderers.online_renderer", "_reused_prompt_token_ids")
"""vLLM's token-reuse step of chat preprocessing: a request whose `kv_transfer_params` holds `prompt_token_ids` is
handed those ids, nothing rendered or tokenized. The hook wraps it (hook.reuse_spliced_ids) to hand a next turn
spliced at the cost of its new messages to the engine, so vLLM's rendering of the whole conversation is skipped; on a
release without it (0.29 to 0.33 all have it) next turns take the full check (slower, as exact).
tests/test_hook_internals.py fails where the suite's vLLM lacks it."""
WRAPPED_MARKER = "__nemo_gym_tok_original__"
"""The attribute on a hook wrapper that holds the vLLM method it wraps."""


class VLLMInternalsChanged(RuntimeError):
    """The vLLM internals the hook wraps are not where this version of the hook expects them."""


def check_internals() -> list[str]:
    """Names of the patched or used vLLM symbols that are missing (empty when all are in place). A route method whose
    route the installed vLLM does not serve (routes.not_served: a release that predates it, or an optional package
    its routes need that does not import here) is not missing: there is no such route to guard."""
    import vllm

    missing = []
    for module_name, class_name, method in (*PATCHED_METHODS, *ROUTE_METHODS):
        owner = lookup(module_name, class_name)
        if owner is None or not callable(getattr(owner, method, None)):
            if not routes.not_served((module_name, class_name, method), vllm.__version__):
                missing.append(f"{module_name}.{class_name}.{method}")
    checked = (
        (PATCHED_METHODS[0], PREPROCESS_CHAT_PARAMETERS),
        (PATCHED_METHODS[3], HARMONY_PARAMETERS),
        (PATCHED_METHODS[5], TOKENIZE_PROMPTS_PARAMETERS),
    )
    for patched, expected in checked:
        method = getattr(lookup(*patched[:2]), patched[2], None)
        if method is not None:
            parameters = inspect.signature(getattr(method, WRAPPED_MARKER, method)).parameters
            missing.extend(f"{'.'.join(patched)}({name}=...)" for name in expected if name not in parameters)
    for module_name, symbol in USED_SYMBOLS:
        if lookup(module_name, symbol) is None:
            missing.append(f"{module_name}.{symbol}")
    for used in USED_FIELDS:
        if not has_field(lookup(*used[:2]), used[2]) and field_expected(used, vllm.__version__):
            missing.append(".".join(used))
    return missing


def reuses_forwarded_ids() -> bool:
    """Whether the installed vLLM's chat preprocessing takes forwarded prompt ids without rendering (TOKEN_REUSE)."""
    return callable(lookup(*TOKEN_REUSE))


def field_expected(used: tuple[str, str, str], version: str) -> bool:
    """Whether vLLM `version` (`0.32.0`, `0.31.1+cpu`) should have the USED_FIELDS field `used` (FIELD_SINCE)."""
    match = re.match(r"(\d+)\.(\d+)", version)
    return match is None or (int(match[1]), int(match[2])) >= FIELD_SINCE.get(used, (0, 0))


def has_field(owner: Any, name: str) -> bool:
    """Whether the class `owner` declares the field `name` (a dataclass field, or an annotation of it or a base)."""
    if owner is None:
        return False
    if name in getattr(owner, "__dataclass_fields__", {}):
        return True
    return any(name in vars(klass).get("__annotations__", {}) for klass in getattr(owner, "__mro__", ()))


def weight_version_fields(completion: Any, generation_length: int) -> dict[str, Any]:
    """The bundle's `weight_version` (the first span's version) and, only when the generated ids span more than one
    version, `weight_version_spans`, from a finished vLLM CompletionOutput's `weight_versions` (WEIGHT_VERSIONS_FIELD)
    over its `generation_length` generated ids. {} where it has none (a release before 0.32, no generated ids) or its
    spans do not fit the ids: the bundle then says nothing, i.e. unknown. Spans past the ids (a stop string trims
    the last ones) are cut at their end, which is where vLLM trims."""
    spans = getattr(completion, WEIGHT_VERSIONS_FIELD[2], None)
    if not spans or generation_length <= 0:
        return {}
    # The version as vLLM gave it, not str() of it: a None (or any non-string) label must read as unknown, never as
    # the text "None"; weight_versions_problem below turns it into {}.
    plain = [{"version": span.version, "start": int(span.start), "end": int(span.end)} for span in spans]
    plain = [span for span in plain if span["start"] < generation_length]
    if not plain:
        return {}
    plain[-1]["end"] = min(plain[-1]["end"], generation_length)
    if weight_versions_problem(plain[0]["version"], plain, generation_length) is not None:
        return {}
    fields: dict[str, Any] = {"weight_version": plain[0]["version"]}
    if len(plain) > 1:
        fields["weight_version_spans"] = plain
    return fields


def is_installed() -> bool:
    module_name, class_name, method = PATCHED_METHODS[0]
    owner = lookup(module_name, class_name)
    return owner is not None and hasattr(getattr(owner, method), WRAPPED_MARKER)


def is_supported_vllm(version: str) -> bool:
    """Whether a vLLM version string (`0.32.0`, `0.33.1rc1`, `0.30.0+cpu`) lies in SUPPORTED_VLLM."""
    match = re.match(r"(\d+)\.(\d+)", version)
    if match is None:
        return False
    release = (int(match[1]), int(match[2]))
    return SUPPORTED_VLLM[0] <= release < SUPPORTED_VLLM[1]


def supported_vllm_text() -> str:
    """SUPPORTED_VLLM for people: `0.29 to 0.33`."""
    (low_major, low_minor), (high_major, high_minor) = SUPPORTED_VLLM
    # The upper bound is exclusive; within one major version the last supported minor is one below it.
    last = f"{high_major}.{high_minor - 1}" if high_minor > 0 else f"below {high_major}.0"
    return f"{low_major}.{low_minor} to {last}"


def wrap(owner: type, name: str, make_wrapper: Any) -> None:
    """Replace `owner.name` with `make_wrapper(original)`, keeping the original on the wrapper (WRAPPED_MARKER)."""
    original = getattr(owner, name)
    wrapper = functools.wraps(original)(make_wrapper(original))
    setattr(wrapper, WRAPPED_MARKER, original)
    setattr(owner, name, wrapper)


def lookup(module_name: str, name: str) -> Any:
    """`module_name.name`, or None where the module does not import or lacks it."""
    try:
        return getattr(importlib.import_module(module_name), name, None)
    except ImportError:
        return None
