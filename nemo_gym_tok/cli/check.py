"""`ngt check`: the token-contiguity report of a rollouts file, and optionally a log-prob recompute."""

from __future__ import annotations

import argparse
import sys

from nemo_gym_tok.records.contiguity import check_file

LOGPROB_TOLERANCE = 0.01
"""Nats: the free-turn mean absolute difference above which `--logprobs` fails (bf16 vLLM vs float32 recompute)."""


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "check",
        help="token-contiguity report over collected rollouts; --logprobs recomputes their log probs",
        description=(
            "Walk every rollout record of each FILE: a rollout is token-contiguous when each model call's prompt ids "
            "start "
            "with all prompt+generation ids before it. Prints rollouts, model calls, contiguous rollouts, turns the "
            "prefix splice repaired, and the first failures; then the rollouts whose turns span more than one vLLM "
            "weight version (turns with different weight_version, or a turn with weight_version_spans: a report, not "
            "a failure) and those with a turn of unknown version. Reads records of schema_version 1 and 2; a record of "
            "any other version is a failure naming it. Exit status 0 when every rollout is contiguous, else 1. "
            "With --logprobs MODEL_DIR, every FILE's rollouts are instead turned into training sequences and each "
            "generated token's log prob is recomputed with transformers (float32; CUDA when available, else CPU; one "
            "forward pass per sequence) and compared with the recorded (vLLM) one: mean and max absolute difference "
            "per rollout and overall, and per-turn sums, free turns apart from constrained ones (decoded under a "
            "grammar, whose recorded log probs are of the masked distribution). It refuses (exit 2) a MODEL_DIR "
            "whose tokenizer/chat-template fingerprint differs from the one the records carry. Exit status 0 when "
            f"the free-turn mean absolute difference is under {LOGPROB_TOLERANCE} nats, else 1."
        ),
    )
    parser.add_argument("files", nargs="+", metavar="FILE", help="rollouts JSONL (from ngt collect)")
    parser.add_argument("--model", metavar="DIR", help="tokenizer directory, to show failures as decoded text")
    parser.add_argument(
        "--logprobs",
        metavar="MODEL_DIR",
        help="recompute the generated tokens' log probs with this model (transformers) and compare with the records",
    )
    parser.add_argument(
        "--naive",
        action="store_true",
        help="with --logprobs: also rebuild each episode the naive way (chat template over the final messages, "
        "re-tokenized, assistant spans) and report how many generated positions carry another id and how far "
        "per-turn log-prob sums move",
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.naive and not args.logprobs:
        print("ngt: --naive needs --logprobs MODEL_DIR", file=sys.stderr)
        return 2
    if args.logprobs:
        return _run_logprobs(args)
    decode = None
    if args.model:
        from transformers import AutoTokenizer

        decode = AutoTokenizer.from_pretrained(args.model).decode
    status = 0
    for path in args.files:
        try:
            report = check_file(path, decode)
        except OSError as exc:
            print(f"ngt: cannot read {path}: {exc.strerror}", file=sys.stderr)
            return 2
        if len(args.files) > 1:
            print(f"{path}:")
        print(report.format())
        status = status if report.ok else 1
    return status


def _run_logprobs(args: argparse.Namespace) -> int:
    from nemo_gym_tok.records.logprob_check import check_records, naive_sequence, read_records, transformers_scorer

    try:
        records = read_records(args.files)
    except OSError as exc:
        print(f"ngt: cannot read {exc.filename}: {exc.strerror}", file=sys.stderr)
        return 2
    except ValueError as exc:
        print(f"ngt: a rollouts file is not JSONL: {exc}", file=sys.stderr)
        return 2
    refusal = _fingerprint_refusal(args.logprobs, [record for _, record in records])
    if refusal:
        print(f"ngt: {refusal}", file=sys.stderr)
        return 2
    naive = None
    if args.naive:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.logprobs)

        def naive(record: dict) -> object:  # type: ignore[misc]
            return naive_sequence(record, tokenizer)

    try:
        score = transformers_scorer(args.logprobs)
    except OSError as exc:
        print(f"ngt: cannot load a model from {args.logprobs}: {exc}", file=sys.stderr)
        return 2
    report = check_records(records, score, naive)  # type: ignore[arg-type]
    print(report.format())
    free = report.free_mean()
    return 0 if free == free and free < LOGPROB_TOLERANCE else 1


def _fingerprint_refusal(model_dir: str, records: list[dict]) -> str | None:
    """Why `model_dir` must not score these records (its tokenizer or chat template is not the one that served them),
    or None. Records without a fingerprint (older ones) cannot be checked and are let through with a note."""
    from nemo_gym_tok.contract.provenance import FINGERPRINT_PARTS, model_fingerprint, record_fingerprints

    recorded = set().union(*(record_fingerprints(record) for record in records)) if records else set()
    if not recorded:
        print(
            "note: the records carry no model_fingerprint of the current recipe (written before it existed or covered "
            "every tokenizer file); the tokenizer is not verified"
        )
        return None
    try:
        fingerprint = model_fingerprint(model_dir)
    except OSError as exc:
        return f"cannot fingerprint {model_dir} (tokenizer files and chat template): {exc}"
    local = (fingerprint["tokenizer_sha256"], fingerprint["chat_template_sha256"])
    foreign = sorted(recorded - {local})
    if foreign:
        differs = sorted(
            {what for pair in foreign for (_, what), got, want in zip(FINGERPRINT_PARTS, pair, local) if got != want}
        )
        recorded_text = ", ".join(f"{tokenizer[:16]}/{template[:16]}" for tokenizer, template in foreign)
        return (
            f"{model_dir} is not the model that served these rollouts: {' and '.join(differs)} differ from the "
            f"records' (tokenizer/chat template sha256 here {local[0][:16]}/{local[1][:16]}, recorded "
            f"{recorded_text}); recomputed log probs would not be comparable"
        )
    return None
