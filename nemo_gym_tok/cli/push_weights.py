"""`ngt push-weights DIR`: a checkpoint into every vLLM server a config names (or the URLs given), all or none."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from nemo_gym_tok.config import ConfigError
from nemo_gym_tok.servers.model_targets import push_targets
from nemo_gym_tok.vllm.route_auth import WEIGHTS_KEY_ENV
from nemo_gym_tok.weights import (
    DEFAULT_MAX_MEAN_GAP,
    PAUSE_MODES,
    PROBE_TOKEN_IDS,
    WeightProbe,
    WeightPushError,
    describe_dropped,
    probe_from_checkpoint,
    push_weights,
)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "push-weights",
        help="load a checkpoint directory into every vLLM server of a config, all or none, under a weight version",
        description=(
            "Through vLLM's own weight routes (served with VLLM_SERVER_DEV_MODE=1), on every vLLM server the "
            "config's model adapters name and every --url (a vllm-router's URL stands for every worker it lists "
            "now). An adapter with a `router` field stands for the workers of its running router (named by the head "
            "of the config's `ngt run`, else found at the router's own port), or for its router.worker_urls when no "
            "router answers; a line says which. Ask each server first "
            "(routes served, key accepted, an exact reload, a new version), then pause all, reload DIR in place, "
            "reset the prefix caches, set the weight version, resume. A worker a router lists that gives no answer "
            "at all (connection refused, timed out) is taken out of that router and the push goes on over the live "
            "workers; it is named on the printed line. Any other server that fails is named, and every server "
            "is put back on the weights and version it had; one that cannot be put back stays paused. Bundles "
            "collected afterwards carry the new version (`weight_version`). With --probe, every server must then "
            f"serve the prompt log probs of {len(PROBE_TOKEN_IDS)} fixed token ids that transformers computes from "
            "DIR itself (float32, CPU) to within --probe-bound nats mean, or every server is put back and the "
            "version is reported unproven (turns sampled under it meanwhile are to be refused). Prints the time "
            "each phase took. Exit 0 pushed, 1 not pushed (a server failed), 2 a usage mistake."
        ),
    )
    parser.add_argument("checkpoint_dir", metavar="DIR", help="checkpoint directory (save_pretrained) the servers read")
    parser.add_argument(
        "--version",
        help="the weight version label (vLLM's /update_weight_version); default: DIR's name. A push needs a new label",
    )
    parser.add_argument("--url", action="append", default=[], help="a vLLM server (root or /v1 URL); repeatable")
    parser.add_argument(
        "-c",
        "--config",
        action="append",
        default=[],
        metavar="FILE",
        help="gym config whose model adapters' vLLMs to push to (a routed adapter: the workers its running router "
        "lists, the router found through the config's head_server, else its router.worker_urls)",
    )
    parser.add_argument(
        "--pause-mode",
        choices=PAUSE_MODES,
        default="wait",
        help="wait: in-flight requests finish on the old weights first (default); keep: they are frozen and go on "
        "with the new weights, and their bundles say which ids came from which version (weight_version_spans)",
    )
    parser.add_argument(
        "--api-key",
        help=f"the key that opens the servers' weight routes: their --weights-api-key where they split keys, else "
        f"their --api-key (default: ${WEIGHTS_KEY_ENV}, else the config adapters' api_key, else $VLLM_API_KEY)",
    )
    parser.add_argument(
        "--probe",
        action="store_true",
        help="after the resume, prove every server serves DIR's weights: its prompt log probs of fixed token ids "
        "against those transformers computes from DIR (needs torch and transformers here, and DIR readable here)",
    )
    parser.add_argument(
        "--probe-bound",
        type=float,
        metavar="NATS",
        help=f"with --probe: the largest mean |served - expected| log prob a server may show (default "
        f"{DEFAULT_MAX_MEAN_GAP:g})",
    )
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds for each route call (default 300)")
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", dest="overrides", help="config override, as ngt run"
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    urls, config_key = list(args.url), None
    if args.config:
        try:
            targets = push_targets(args.config, args.overrides)
        except ConfigError as exc:
            print(f"ngt: {exc}", file=sys.stderr)
            return 2
        for note in targets.notes:
            print(f"ngt: {note}", flush=True)
        urls, config_key = [*targets.urls, *urls], targets.api_key
    if not urls:
        print("ngt: no vLLM server named: give -c CONFIG (its vllm_model base_url) or --url URL", file=sys.stderr)
        return 2
    version = args.version or Path(args.checkpoint_dir).expanduser().resolve().name
    api_key = args.api_key or os.environ.get(WEIGHTS_KEY_ENV) or config_key or os.environ.get("VLLM_API_KEY")
    try:
        if args.probe_bound is not None and not args.probe:
            raise ValueError("--probe-bound is a bound of --probe: give --probe too")
        bound = DEFAULT_MAX_MEAN_GAP if args.probe_bound is None else args.probe_bound
        probe = checkpoint_probe(args.checkpoint_dir, bound) if args.probe else None
        report = push_weights(
            urls,
            args.checkpoint_dir,
            version=version,
            api_key=api_key,
            pause_mode=args.pause_mode,
            timeout=args.timeout,
            probe=probe,
        )
    except ValueError as exc:
        print(f"ngt: {exc}", file=sys.stderr)
        return 2
    except WeightPushError as exc:
        dropped = f"\nngt: {describe_dropped(exc.dropped)}" if exc.dropped else ""
        print(f"ngt: not pushed: {exc}{dropped}", file=sys.stderr)
        return 1
    print(report.format(), flush=True)
    return 0


def checkpoint_probe(checkpoint_dir: str, bound: float) -> WeightProbe:
    """The probe of DIR's own weights (transformers, float32, CPU): a ValueError, a usage mistake, when DIR is not a
    readable model directory here or the bound is not a positive number."""
    if not 0 < bound < float("inf"):
        raise ValueError(f"--probe-bound must be a positive number of nats, got {bound}")
    if not Path(checkpoint_dir).expanduser().is_dir():
        raise ValueError(f"--probe reads the checkpoint here, and {checkpoint_dir} is not a directory on this machine")
    try:
        return probe_from_checkpoint(Path(checkpoint_dir).expanduser(), PROBE_TOKEN_IDS, bound)
    except (OSError, ImportError) as exc:
        raise ValueError(f"--probe could not compute {checkpoint_dir}'s log probs: {exc}") from exc
