"""`ngt run`: start the head and every server of the merged config, restart crashed ones, until Ctrl-C or SIGTERM."""

from __future__ import annotations

import argparse
import signal
import sys
import threading

from nemo_gym_tok.config import ConfigError, load_config
from nemo_gym_tok.servers.launcher import DEFAULT_HEAD_PORT, Gym, LaunchError

SUPERVISE_INTERVAL_SECONDS = 0.2


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "run",
        help="start every server of a config (and the head server) until Ctrl-C",
        description=(
            "Merge the config files in order (later wins), apply --set overrides, start the head server and every "
            "server instance as child processes, print their URLs, and stop them all on Ctrl-C or SIGTERM. "
            f"The head server listens on head_server.port (default {DEFAULT_HEAD_PORT}; 0 picks a free port). "
            "A port another process holds is refused before anything starts. A server that exits is restarted "
            "with back-off (config key restart: {enabled: true, max_restarts: 5, window_seconds: 60, "
            "backoff_seconds: 1}); the gym stops when one exits more than max_restarts times within the window."
        ),
    )
    add_config_arguments(parser)
    parser.set_defaults(func=run)


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "-c", "--config", action="append", required=True, metavar="FILE", help="YAML config file; repeat to merge"
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        dest="overrides",
        help="override one value, e.g. --set my_env.resources_servers.example.port=8001; repeatable",
    )


def run(args: argparse.Namespace) -> int:
    """Start the gym, supervise it until a signal (exit 0) or a server that keeps exiting (exit 1)."""
    try:
        config = load_config(args.config, args.overrides)
    except ConfigError as exc:
        print(f"ngt: {exc}", file=sys.stderr)
        return 2
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    try:
        with Gym(config) as gym:
            print(f"head: {gym.head_url}", flush=True)
            for name, url in gym.urls.items():
                print(f"{name}: {url}", flush=True)
            print("all servers healthy; Ctrl-C stops them", flush=True)
            while not stop.wait(SUPERVISE_INTERVAL_SECONDS):
                fatal = gym.supervise(lambda event: print(f"ngt: {event}", file=sys.stderr, flush=True))
                if fatal:
                    print(f"ngt: {fatal}; stopping all", file=sys.stderr, flush=True)
                    return 1
            print("stopping all servers", flush=True)
    except ConfigError as exc:
        print(f"ngt: {exc}", file=sys.stderr)
        return 2
    except LaunchError as exc:
        print(f"ngt: {exc}", file=sys.stderr)
        return 1
    return 0
