"""`ngt push-weights DIR`: a checkpoint into every vLLM server a config names (or the URLs given), all or none."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from nemo_gym_tok.config import ConfigError, load_config
from nemo_gym_tok.weights import PAUSE_MODES, WeightPushError, push_weights

MODEL_KIND = "responses_api_models"


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "push-weights",
        help="load a checkpoint directory into every vLLM server of a config, all or none, under a weight version",
        description=(
            "Through vLLM's own weight routes (served with VLLM_SERVER_DEV_MODE=1), on every vLLM server the "
            "config's model adapters name (their base_url, or every worker of their router) and every --url (a "
            "vllm-router's URL stands for every worker it lists): ask each one first "
            "(routes served, key accepted, an exact reload, a new version), then pause all, reload DIR in place, "
            "reset the prefix caches, set the weight version, resume. A server that fails is named, and every server "
            "is put back on the weights and version it had; one that cannot be put back stays paused. Bundles "
            "collected afterwards carry the new version (`weight_version`). Prints the time each phase took. "
            "Exit 0 pushed, 1 not pushed (a server failed), 2 a usage mistake."
        ),
    )
    parser.add_argument("checkpoint_dir", metavar="DIR", help="checkpoint directory (save_pretrained) the servers read")
    parser.add_argument(
        "--version",
        help="the weight version label (vLLM's /update_weight_version); default: DIR's name. A push needs a new label",
    )
    parser.add_argument("--url", action="append", default=[], help="a vLLM server (root or /v1 URL); repeatable")
    parser.add_argument(
        "-c", "--config", action="append", default=[], metavar="FILE", help="gym config whose vllm_model URLs to use"
    )
    parser.add_argument(
        "--pause-mode",
        choices=PAUSE_MODES,
        default="wait",
        help="wait: in-flight requests finish on the old weights first (default); keep: they are frozen and go on "
        "with the new weights, and their bundles say which ids came from which version (weight_version_spans)",
    )
    parser.add_argument(
        "--api-key", help="the servers' API key (default: the config adapters' api_key, else $VLLM_API_KEY)"
    )
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds for each route call (default 300)")
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", dest="overrides", help="config override, as ngt run"
    )
    parser.set_defaults(func=run)


def vllm_targets(config_paths: list[str], overrides: list[str]) -> tuple[list[str], str | None]:
    """Every vLLM URL the config's model adapters name, in order, and their API key (the first that sets one)."""
    config = load_config(config_paths, overrides)
    urls: list[str] = []
    api_key: str | None = None
    for instance in config.instances.values():
        if instance.kind != MODEL_KIND:
            continue
        fields: dict[str, Any] = instance.fields
        base_url = fields.get("base_url")
        urls.extend([base_url] if isinstance(base_url, str) else list(base_url or []))
        router = fields.get("router")  # the workers of a router `ngt run` starts (a running router is asked)
        if isinstance(router, dict) and isinstance(router.get("worker_urls"), list):
            urls.extend(str(url) for url in router["worker_urls"])
        key = fields.get("api_key")
        if api_key is None and isinstance(key, str) and key and key != "EMPTY":
            api_key = key
    return urls, api_key


def run(args: argparse.Namespace) -> int:
    urls, config_key = list(args.url), None
    if args.config:
        try:
            config_urls, config_key = vllm_targets(args.config, args.overrides)
        except ConfigError as exc:
            print(f"ngt: {exc}", file=sys.stderr)
            return 2
        urls = [*config_urls, *urls]
    if not urls:
        print("ngt: no vLLM server named: give -c CONFIG (its vllm_model base_url) or --url URL", file=sys.stderr)
        return 2
    version = args.version or Path(args.checkpoint_dir).expanduser().resolve().name
    api_key = args.api_key or config_key or os.environ.get("VLLM_API_KEY")
    try:
        report = push_weights(
            urls,
            args.checkpoint_dir,
            version=version,
            api_key=api_key,
            pause_mode=args.pause_mode,
            timeout=args.timeout,
        )
    except ValueError as exc:
        print(f"ngt: {exc}", file=sys.stderr)
        return 2
    except WeightPushError as exc:
        print(f"ngt: not pushed: {exc}", file=sys.stderr)
        return 1
    print(report.format(), flush=True)
    return 0
