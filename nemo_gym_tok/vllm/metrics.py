"""Prometheus counters of the prefix-splice hook, exported on vLLM's own `/metrics`."""

from __future__ import annotations

from prometheus_client import Counter

from nemo_gym_tok.splice import SpliceResult

SPLICES = Counter(
    "nemo_gym_tok_prefix_splices", "Requests whose prompt started with a spliced model prefix"
)
DRIFTED_TURNS = Counter(
    "nemo_gym_tok_prefix_splice_drifted_turns",
    "Spliced requests where the chat template's ids for the history differed from the model's (repaired turns)",
)
REPLACED_TOKENS = Counter(
    "nemo_gym_tok_prefix_splice_replaced_tokens", "Template history ids replaced by the model's own ids"
)
REJECTED = Counter(
    "nemo_gym_tok_prefix_splice_rejected", "Requests answered 400 for a malformed, out-of-vocabulary or stale prefix"
)


def spliced(result: SpliceResult) -> None:
    SPLICES.inc()
    if result.template_differed:
        DRIFTED_TURNS.inc()
        REPLACED_TOKENS.inc(result.replaced_tokens)


def rejected() -> None:
    REJECTED.inc()
