"""Builds a (Qwen BPE + family special tokens + real chat template) HF fast tokenizer for any shipped template."""

from __future__ import annotations

import re
from functools import lru_cache
from typing import TYPE_CHECKING

from nemo_gym_tok.testing.chat_templates.families import Family
from nemo_gym_tok.testing.tiny_model.tokenizer import QWEN_BPE_RANKS, QWEN_PAT_STR, qwen_ranks_file

if TYPE_CHECKING:
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

# Marker shapes that are tokens wherever they occur in a template: `<|x|>`, DeepSeek's `<｜x｜>`, and Gemma 4's
# one-sided `<|x>` / `<x|>` (plus its `<|"|>` string delimiter). No spaces, quotes or braces inside, so Jinja
# string building such as `'<|' + role + '|>'` and Python format holes (`<｜hy_User{}｜>`) are not taken.
_ALWAYS = re.compile(
    r"<\|[^\s<>|{}'\"\\]{1,48}\|>"
    r"|<｜[^\s<>｜{}'\"\\]{1,64}｜>"
    r"|<\|[A-Za-z_]\w{0,31}>(?!\|)"
    r"|(?<!\|)<[A-Za-z_]\w{0,31}\|>"
    r"|<\|\"\|>"
    r"|\[\|[a-z_]{1,24}\|\]"  # EXAONE's [|user|]
)
# `<start_of_turn>`/`<extra_id_1>`/`<SPECIAL_11>`-like markers: only for unrecognised templates, and only when
# the template never closes them (`<available_tools>...</available_tools>` is prompt text, not a token).
_UNDERSCORED = re.compile(r"<([A-Za-z][A-Za-z0-9]*(?:_[A-Za-z0-9]+)+)>")
# `[INST]`-like control tokens, for families whose tokenizers have them (Mistral's).
_BRACKETED = re.compile(r"\[/?[A-Z][A-Z_]{1,30}\]")
# XML-ish reasoning/tool markup that is a real added token in the models that use it (Qwen3, GLM, Hermes, ...).
_MARKUP_TAGS = ("<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
# Extracted markers whose name says "reasoning or tool markup" are added non-special, like Qwen3's <tool_call>.
_MARKUP_NAME = re.compile(r"think|reason|tool|call|function|arg|param|response|result|action", re.I)


def extract_markers(text: str, family: Family) -> list[tuple[str, bool]]:
    """Marker-like strings in the template text that the tokenizer must hold as single tokens, as (token, special).

    Sorted by token text so the result (and the ids derived from it) does not depend on where markers occur.
    The family table's own lists take precedence over this extraction; see `token_plan`.
    """
    found: dict[str, bool] = {}
    for token in _ALWAYS.findall(text):
        found[token] = not _MARKUP_NAME.search(token)
    # `<end_of_utterance>`-style markers written literally (SmolVLM on a ChatML base): one token in the real tokenizer.
    for match in _UNDERSCORED.finditer(text):
        if f"</{match.group(1)}>" not in text:
            found.setdefault(match.group(0), not _MARKUP_NAME.search(match.group(0)))
    if family.name == "generic":
        for plain in ("<s>", "</s>"):
            if plain in text:
                found[plain] = True
    if family.bracket_markers:
        for token in _BRACKETED.findall(text):
            found[token] = True
    for tag in _MARKUP_TAGS:
        if tag in text:
            found.setdefault(tag, False)
    return sorted(found.items())


def token_plan(template_text: str, family: Family) -> tuple[tuple[str, bool], ...]:
    """Every added token in id order: the family's special then markup lists (Qwen rows list Qwen's tokens in
    Qwen's order, so they land at Qwen's ids), then its bos/eos/stop tokens, then markers extracted from the text.
    """
    plan: dict[str, bool] = {}
    for token in family.special:
        plan.setdefault(token, True)
    for token in family.markup:
        plan.setdefault(token, False)
    for token in (family.bos, family.eos, *family.end_tokens):
        if token is not None:
            plan[token] = True  # stop tokens are special even when a list above names them as markup
    for token, special in extract_markers(template_text, family):
        plan.setdefault(token, special)
    return tuple(plan.items())


@lru_cache(maxsize=1)
def _base_json() -> str:
    """Qwen's BPE converted to a `tokenizers` JSON string: the slow conversion runs once per process."""
    from transformers.integrations.tiktoken import TikTokenConverter

    backend = TikTokenConverter(vocab_file=str(qwen_ranks_file()), pattern=QWEN_PAT_STR).converted()
    size = backend.get_vocab_size(with_added_tokens=True)
    if size != QWEN_BPE_RANKS:
        raise RuntimeError(f"expected {QWEN_BPE_RANKS} BPE ranks from the converter, got {size}")
    return backend.to_str()


@lru_cache(maxsize=1)
def _base() -> Tokenizer:
    """The parsed base tokenizer; its BPE model is shared (read-only) by every family tokenizer's backend."""
    from tokenizers import Tokenizer

    return Tokenizer.from_str(_base_json())


def _backend(plan: tuple[tuple[str, bool], ...]) -> Tokenizer:
    """A backend on the shared BPE model with `plan`'s tokens added one by one. New strings take the next free id
    from 151643 upwards; a few markers (`<s>`, `</s>`, ...) already are single BPE tokens and keep that id.
    """
    from tokenizers import AddedToken, Tokenizer

    base = _base()
    backend = Tokenizer(base.model)
    backend.normalizer, backend.pre_tokenizer = base.normalizer, base.pre_tokenizer
    backend.post_processor, backend.decoder = base.post_processor, base.decoder
    next_id = QWEN_BPE_RANKS
    for text, special in plan:
        known = base.token_to_id(text)
        token = AddedToken(text, special=special, normalized=False, lstrip=False, rstrip=False, single_word=False)
        (backend.add_special_tokens if special else backend.add_tokens)([token])
        expected = known if known is not None else next_id
        if backend.token_to_id(text) != expected:
            raise RuntimeError(f"{text!r} landed at id {backend.token_to_id(text)}, expected {expected}")
        next_id += known is None
    return backend


def _adopt(backend: Tokenizer, **kwargs: object) -> PreTrainedTokenizerFast:
    """Wrap `backend` without copying it. `PreTrainedTokenizerFast(tokenizer_object=...)` deep-copies, i.e. JSON
    round-trips the whole 151k-merge BPE (~0.6 s per tokenizer, minutes for the catalog); transformers 5 adopts
    a backend already set on the instance instead. Falls back to the copying constructor if that ever changes.
    """
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast.__new__(PreTrainedTokenizerFast)
    tokenizer._tokenizer = backend
    try:
        tokenizer.__init__(**kwargs)
    except ValueError:
        tokenizer = None
    if tokenizer is None or tokenizer.backend_tokenizer is not backend:
        return PreTrainedTokenizerFast(tokenizer_object=backend, **kwargs)
    return tokenizer


def family_tokenizer(template_text: str, family: Family) -> PreTrainedTokenizerFast:
    """Qwen's real BPE + the family's and the template's marker tokens, with `template_text` as chat template.

    bos/eos follow the family table (`classify` fills them in for unrecognised templates); pad is eos. Each call
    returns a new tokenizer with its own added tokens, sharing the read-only BPE model parsed once per process.
    """
    tokenizer = _adopt(
        _backend(token_plan(template_text, family)),
        bos_token=family.bos,
        eos_token=family.eos,
        pad_token=family.eos,
        unk_token=None,
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = template_text
    return tokenizer


def end_token_ids(tokenizer: PreTrainedTokenizerFast, family: Family) -> list[int]:
    """Ids of the family's generation stop tokens in `tokenizer` (eos first, no duplicates)."""
    ids: list[int] = []
    for token in (family.eos, *family.end_tokens):
        token_id = tokenizer.convert_tokens_to_ids(token)
        if token_id is None or token_id == tokenizer.unk_token_id:
            raise KeyError(f"stop token {token!r} of family {family.name!r} is not in the tokenizer")
        if token_id not in ids:
            ids.append(token_id)
    return ids
