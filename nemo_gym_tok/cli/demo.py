"""`ngt demo`: tiny model, real vLLM with the hook, the example environments, rollouts, contiguity report."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

from nemo_gym_tok.collect import collect, failures_path_for
from nemo_gym_tok.config import load_config
from nemo_gym_tok.records.contiguity import ContiguityReport, check_file
from nemo_gym_tok.servers.auth import AUTH_TOKEN_ENV, env_auth_token
from nemo_gym_tok.servers.launcher import Gym
from nemo_gym_tok.vllm_server import CPU_SERVING_ARGS, TEST_BED_ARGS, TEST_BED_ENV, VLLMServer

REPO_ROOT = Path(__file__).resolve().parents[2]
DEMO_CONFIG = REPO_ROOT / "configs" / "demo.yaml"
SERVED_MODEL_NAME = "tiny-qwen3"
AGENT_SUFFIX = "_agent"


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "demo",
        help="the one-command demo on the embedded tiny model",
        description=(
            "Build the tiny model (cached), start vLLM on it with the prefix-splice hook (about 50 s on 2 cores), "
            f"start the servers of {DEMO_CONFIG.relative_to(REPO_ROOT)}, collect rollouts from each example "
            "environment's data/example.jsonl, and print the token-contiguity report and where the files are. "
            "Exit status 0 when every rollout is token-contiguous. "
            f"With ${AUTH_TOKEN_ENV} set, every demo server requires it as a bearer token, vLLM is started with it as "
            "its API key (VLLM_API_KEY), and the adapter and the collector send it."
        ),
    )
    parser.add_argument("--limit", type=int, default=3, help="rows per environment (default 3)")
    parser.add_argument("--repeats", type=int, default=1, help="rollouts per row (default 1)")
    parser.add_argument("--concurrency", type=int, default=4, help="rollouts in flight per environment (default 4)")
    parser.add_argument(
        "--output-dir",
        type=Path,
        default=Path(".ngt/demo"),
        help="where rollouts go (default .ngt/demo); each run replaces the demo's files there",
    )
    parser.add_argument(
        "--vllm-url",
        metavar="URL",
        help=f"use a running hooked vLLM serving the tiny model as {SERVED_MODEL_NAME!r} instead of starting one",
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    started = time.monotonic()
    try:
        auth_token = env_auth_token()
    except ValueError as exc:
        print(f"demo: {exc}", file=sys.stderr)
        return 2
    output_dir: Path = args.output_dir
    output_dir.mkdir(parents=True, exist_ok=True)
    from nemo_gym_tok.testing.tiny_model import build_tiny_model

    model_dir = build_tiny_model()
    print(f"tiny model: {model_dir}", flush=True)
    vllm = None
    if args.vllm_url:
        vllm_url = args.vllm_url.rstrip("/")
    else:
        print("starting vLLM with the prefix-splice hook (about 50 s)...", flush=True)
        vllm = VLLMServer(
            model_dir,
            served_model_name=SERVED_MODEL_NAME,
            extra_args=(*CPU_SERVING_ARGS, *TEST_BED_ARGS),
            env={**TEST_BED_ENV, **({"VLLM_API_KEY": auth_token} if auth_token else {})},  # env: not in `ps`
            log_path=output_dir / "vllm.log",
        ).start()
        vllm_url = vllm.base_url
    try:
        overrides = [f"policy_base_url={vllm_url}/v1", f"policy_model_name={SERVED_MODEL_NAME}", "head_server.port=0"]
        if auth_token:  # the adapter's key for vLLM; quoted, so that a numeric token stays a string
            overrides.append(f"policy_model.responses_api_models.vllm_model.api_key={json.dumps(auth_token)}")
        config = load_config([DEMO_CONFIG], overrides)
        agents = [name for name in config.instances if name.endswith(AGENT_SUFFIX)]
        with Gym(config) as gym:
            print(
                f"servers up (head {gym.head_url}); collecting {args.limit} row(s) x {args.repeats} per environment",
                flush=True,
            )
            reports = {}
            failed = 0
            for agent in agents:
                environment = config.instances[agent].fields["resources_server"]
                rows = REPO_ROOT / "resources_servers" / environment / "data" / "example.jsonl"
                output = output_dir / f"{environment}.jsonl"
                # Each demo is a fresh run: resuming an earlier demo's files would collect nothing (or meet files an
                # older version of ngt wrote).
                output.unlink(missing_ok=True)
                failures_path_for(output).unlink(missing_ok=True)
                summary = asyncio.run(
                    collect(
                        rows,
                        output,
                        gym.urls[agent],
                        agent=agent,
                        concurrency=args.concurrency,
                        limit=args.limit,
                        repeats=args.repeats,
                        timeout=600.0,
                        auth_token=gym.auth_token,
                    )
                )
                print(f"{environment}: {summary.line()}", flush=True)
                failed += summary.failed
                reports[environment] = (output, check_file(output))
    finally:
        if vllm is not None:
            vllm.stop()
    status = _print_summary(reports, output_dir, time.monotonic() - started)
    if failed:
        print(f"demo: {failed} rollout(s) failed; see the .failures.jsonl files in {output_dir}/", file=sys.stderr)
        return 1
    return status


def _print_summary(reports: dict[str, tuple[Path, ContiguityReport]], output_dir: Path, seconds: float) -> int:
    print()
    for environment, (path, report) in reports.items():
        print(f"== {environment}: {path}")
        print(report.format())
    rollouts = sum(r.rollouts for _, r in reports.values())
    contiguous = sum(r.contiguous for _, r in reports.values())
    repaired = sum(r.repaired_turns for _, r in reports.values())
    turns = sum(r.turns for _, r in reports.values())
    print(
        f"\ndemo: {contiguous}/{rollouts} rollouts token-contiguous, {repaired}/{turns} model calls repaired by the "
        f"prefix splice; files in {output_dir}/ ({seconds:.0f} s)"
    )
    print(f"check any of them again with: ngt check {output_dir}/<environment>.jsonl")
    ok = rollouts > 0 and all(report.ok for _, report in reports.values())
    if not ok:
        print("demo: some rollouts are missing or not token-contiguous (see above)", file=sys.stderr)
    return 0 if ok else 1
