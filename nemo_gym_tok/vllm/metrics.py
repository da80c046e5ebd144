"""Prometheus metrics of the prefix-splice hook, exported on vLLM's own `/metrics`."""

from __future__ import annotations

from prometheus_client import Counter, Histogram

from nemo_gym_tok.splice import SpliceResult

SPLICES = Counter("nemo_gym_tok_prefix_splices", "Requests whose prompt started with a spliced model prefix")
NEW_TURN_SPLICES = Counter(
    "nemo_gym_tok_prefix_splices_new_turn",
    "Spliced requests whose history was proven by the prompt this server spliced for it and whose template text was "
    "rendered for the new messages only (nothing of the history rendered, by the hook or by vLLM)",
)
DRIFTED_TURNS = Counter(
    "nemo_gym_tok_prefix_splice_drifted_turns",
    "Spliced requests where the chat template's ids for the prefix's own assistant turn differed from the model's "
    "(repaired turns: each turn is counted on the one call that adds it to the prefix)",
)
REPLACED_TOKENS = Counter(
    "nemo_gym_tok_prefix_splice_replaced_tokens", "Template ids of repaired turns replaced by the model's own ids"
)
REJECTED = Counter(
    "nemo_gym_tok_prefix_splice_rejected", "Requests answered 400 for a malformed, out-of-vocabulary or stale prefix"
)


PREPROCESS_SECONDS = Histogram(
    "nemo_gym_tok_preprocess_seconds",
    "Wall time of vLLM's chat preprocessing (templating and tokenization, or the splice) per request, by path: "
    "spliced (a prefix spliced in), template (no prefix: vLLM's own templating, what stock vLLM does), token_in "
    "(kv_transfer_params.prompt_token_ids: no templating), new_segment (start_token_segment), refused (an error)",
    ["path"],
    buckets=(0.0005, 0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.064, 0.128, 0.256, 0.512, 1.0, 2.0),
)
PREPROCESS_PATHS = ("spliced", "template", "token_in", "new_segment", "refused")


def preprocessed(path: str, seconds: float) -> None:
    PREPROCESS_SECONDS.labels(path=path).observe(seconds)


def spliced(new_turn: bool = False) -> None:
    SPLICES.inc()
    if new_turn:
        NEW_TURN_SPLICES.inc()


def measured(result: SpliceResult) -> None:
    """Count what the splice's measurement of the turn it adds found (see SplicedPrompt)."""
    if result.template_differed:
        DRIFTED_TURNS.inc()
        REPLACED_TOKENS.inc(result.replaced_tokens)


def rejected() -> None:
    REJECTED.inc()
