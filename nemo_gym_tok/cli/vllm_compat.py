"""`ngt vllm-compat [VERSION ...]`: check the prefix-splice hook against stock vLLM wheels without installing them."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `vllm-compat` parser to the `ngt` subcommands."""
    parser = subparsers.add_parser(
        "vllm-compat",
        help="check the hook against the stock vLLM wheels of every supported release (reads source, installs nothing)",
        description=(
            "Download the stock `vllm` wheel of each release (pip download --no-deps, kept in the cache) and read its "
            "source with ast, without installing or importing it. Checks what the prefix-splice hook needs: every "
            "method it wraps, the parameters it reads, the vLLM symbols it uses, vLLM's token-in path "
            "(kv_transfer_params['prompt_token_ids'] in preprocess_chat), and how preprocess_chat uses its request "
            "parser (whether it hands it the prompt ids, which the hook replaces with the spliced ones); and the "
            "weight-update path: the routes `ngt push-weights` drives, the NCCL weight-transfer routes a GPU trainer "
            "drives (TRL's server mode) with the parameters it passes, the reload the exact reload wraps, the API-key "
            "guard. Prints one row per release, then every problem. Exit status 0 when every release fits, 1 on any "
            "incompatibility, 2 when a wheel cannot be downloaded."
        ),
    )
    parser.add_argument(
        "versions",
        nargs="*",
        metavar="VERSION",
        help="vLLM releases to check, e.g. 0.34.0 (default: the x.y.0 of every minor version the hook supports)",
    )
    parser.add_argument(
        "--wheel-dir",
        type=Path,
        default=None,
        metavar="DIR",
        help="where wheels are downloaded and reused (default: vllm-wheels in $NGT_CACHE_DIR or ~/.cache/nemo_gym_tok)",
    )
    parser.add_argument(
        "--download-only",
        action="store_true",
        help="fetch the wheels into the cache and check nothing (CI fetches them while other tests run)",
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Check each release; print the table. Returns the exit status."""
    from nemo_gym_tok import vllm_wheels

    versions = args.versions or vllm_wheels.supported_releases()
    directory = args.wheel_dir or vllm_wheels.wheel_cache_dir()
    reports = []
    for version in versions:
        try:
            wheel = vllm_wheels.download_wheel(version, directory)
        except RuntimeError as exc:
            print(f"ngt vllm-compat: {exc}", file=sys.stderr)
            return 2
        if args.download_only:
            print(f"ngt vllm-compat: {wheel}")
            continue
        reports.append(vllm_wheels.check_wheel(wheel, version))
    if args.download_only:
        return 0
    print(vllm_wheels.format_reports(reports))
    return 0 if all(report.ok for report in reports) else 1
