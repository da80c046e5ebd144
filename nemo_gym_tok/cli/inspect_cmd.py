"""`ngt inspect`: a self-contained HTML page showing where each id of a rollouts file came from."""

from __future__ import annotations

import argparse
import sys


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "inspect",
        help="write an HTML page of a rollouts file's token sequences (template, model, repaired ids)",
        description=(
            "Read the rollout records of FILE and write one self-contained HTML page (inline CSS and JS, nothing "
            "fetched): the rollouts with reward and turns; per rollout its training sequence as a token strip "
            "coloured by where each id came from (template, model-generated, repaired span); for each turn the "
            "prefix splice repaired, the template's ids against the model's, decoded side by side. Hovering a "
            "token shows its id and decoded piece."
        ),
    )
    parser.add_argument("file", metavar="FILE", help="rollouts JSONL (from ngt collect or ngt demo)")
    parser.add_argument("--html", metavar="OUT", required=True, help="where to write the page")
    parser.add_argument(
        "--tokenizer",
        metavar="MODEL_DIR",
        help=(
            "the tokenizer (and chat template) the rollouts were served with, to decode ids and rebuild the "
            "template's ids of repaired turns. Default: the embedded tiny model (nemo_gym_tok.testing.tiny_model, "
            "built "
            "and cached on first use), which is what `ngt demo` serves; rollouts of any other model need its "
            "directory here, else their pieces decode as nonsense"
        ),
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from transformers import AutoTokenizer

    from nemo_gym_tok.records.inspect_html import write_page

    model_dir = args.tokenizer
    if model_dir is None:
        from nemo_gym_tok.testing.tiny_model import build_tiny_model

        model_dir = build_tiny_model()
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    try:
        data = write_page(args.file, args.html, tokenizer)
    except OSError as exc:
        print(f"ngt: {exc.filename}: {exc.strerror}", file=sys.stderr)
        return 2
    except ValueError as exc:
        print(f"ngt: {exc}", file=sys.stderr)
        return 2
    rollouts = data["rollouts"]
    spans = sum(len(s["repaired"]) for r in rollouts for s in r["sequences"])
    failed = sum(r["error"] is not None for r in rollouts)
    print(
        f"wrote {args.html}: {len(rollouts)} rollouts, {spans} repaired spans"
        + (f", {failed} rollouts unreadable (shown with their error)" if failed else "")
    )
    return 0
