"""Two hooked vLLM replicas, one SIGKILLed mid-collection: `ngt collect` completes, contiguous, on the live replica."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest

from nemo_gym_tok.agents.simple_agent.app import SimpleAgent, SimpleAgentConfig
from nemo_gym_tok.collect import failures_path_for
from nemo_gym_tok.config import ServerInstance
from nemo_gym_tok.records.contiguity import check_file
from nemo_gym_tok.servers.client import ServerClient
from nemo_gym_tok.servers.inprocess import serve_in_thread
from nemo_gym_tok.servers.registry import validate_instance
from nemo_gym_tok.vllm.server import CPU_SERVING_ARGS, TEST_BED_ARGS, TEST_BED_ENV, VLLMServer
from responses_api_models.vllm_model.app import VLLMModel, VLLMModelConfig
from responses_api_models.vllm_model.sessions import Attempt
from tests.fixtures.collect_agent import create_head_app
from tests.servers import hooked_server

REPO = Path(__file__).resolve().parents[1]
ROWS = REPO / "resources_servers" / "number_guess" / "data" / "example.jsonl"
REPEATS = 3
KILL_AFTER_ROLLOUTS = 2
"""Finished rollouts before the kill (at least): both replicas have served conversations by then, and most of the
24 are still to come, so new ones start after the doomed replica is gone."""
MAX_ROUNDS = 4
"""number_guess's default: an episode makes up to 4 model calls, so one with 1 or 2 answered has more to come."""


@pytest.fixture
def doomed_vllm(
    vllm_server: VLLMServer, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[VLLMServer]:
    """A second hooked replica like the shared one, started for this test alone since the test kills it."""
    with hooked_server(
        tiny_model_dir,
        served_model_name=vllm_server.served_model_name,
        extra_args=(*CPU_SERVING_ARGS, *TEST_BED_ARGS),
        env=TEST_BED_ENV,
        log_path=tmp_path_factory.mktemp("doomed-vllm") / "vllm.log",
        what="second vLLM replica: ",
    ) as server:
        yield server


def warm_up(vllm: VLLMServer) -> None:
    """One call like the rollouts' first: a fresh vLLM's first generation is slow (tens of seconds on 2 cores), and
    a replica still warming up when collection starts would skew where conversations finish first."""
    row = json.loads(ROWS.read_text().splitlines()[0])
    body = {"model": vllm.served_model_name, "messages": row["responses_create_params"]["input"], "max_tokens": 4}
    answer = httpx.post(f"{vllm.base_url}/v1/chat/completions", json=body, timeout=300)
    assert answer.status_code == 200, answer.text


def start_gym(stack: ExitStack, adapter: VLLMModel) -> str:
    """Adapter, number_guess and its agent in this process (so the test reads the router), and a head server."""
    urls = {"policy_model": stack.enter_context(serve_in_thread(adapter.build_app()))}
    server_class, config = validate_instance(
        ServerInstance("number_guess", "resources_servers", "number_guess", {}, {})
    )
    urls["number_guess"] = stack.enter_context(serve_in_thread(server_class("number_guess", config).build_app()))
    agent = SimpleAgent(
        "number_guess_agent",
        SimpleAgentConfig(model_server="policy_model", resources_server="number_guess", max_steps=4),
        ServerClient(dict(urls)),
    )
    urls["number_guess_agent"] = stack.enter_context(serve_in_thread(agent.build_app()))
    return stack.enter_context(serve_in_thread(create_head_app(urls)))


def ready_to_kill(attempts: list[Attempt], doomed: str, live: str) -> bool:
    """Both replicas have answered calls, and some conversation has had only answered calls, all on `doomed`, fewer
    than MAX_ROUNDS - 1: its next call will go to `doomed`, so a kill now makes it move mid-episode."""
    if not any(a.url == live and a.outcome == "ok" for a in attempts):
        return False
    for calls in by_conversation(attempts).values():
        if all(a.url == doomed and a.outcome == "ok" for a in calls) and len(calls) < MAX_ROUNDS - 1:
            return True
    return False


def by_conversation(attempts: list[Attempt]) -> dict[str, list[Attempt]]:
    conversations: dict[str, list[Attempt]] = defaultdict(list)
    for attempt in attempts:
        conversations[attempt.key].append(attempt)
    return conversations


def test_collect_completes_when_a_replica_dies_mid_collection(
    vllm_server: VLLMServer, doomed_vllm: VLLMServer, tmp_path: Path
) -> None:
    live, doomed = f"{vllm_server.base_url}/v1", f"{doomed_vllm.base_url}/v1"
    adapter = VLLMModel(
        "policy_model",
        VLLMModelConfig(
            base_url=[doomed, live],
            model=vllm_server.served_model_name,
            return_token_id_information=True,
            retry_backoff_seconds=0.2,
            health_check_interval_seconds=1.0,
        ),
    )
    output = tmp_path / "rollouts.jsonl"
    total = sum(1 for line in ROWS.read_text().splitlines() if line.strip()) * REPEATS
    for vllm in (vllm_server, doomed_vllm):
        warm_up(vllm)
    with ExitStack() as stack:
        head = start_gym(stack, adapter)
        collect = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "nemo_gym_tok",
                "collect",
                "--input",
                str(ROWS),
                "--output",
                str(output),
                "--agent",
                "number_guess_agent",
                "--head-url",
                head,
                "--repeats",
                str(REPEATS),
                "--concurrency",
                "4",
                "--timeout",
                "300",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            deadline = time.monotonic() + 300
            # Kill once some rollouts are done and a conversation is part-way through on the doomed replica.
            while (
                not output.exists()
                or output.read_bytes().count(b"\n") < KILL_AFTER_ROLLOUTS
                or not ready_to_kill(list(adapter.router.attempts), doomed, live)
            ):
                assert collect.poll() is None, f"collect ended before the kill: {collect.communicate()}"
                assert time.monotonic() < deadline, "no moment to kill came in 300 s (see ready_to_kill)"
                time.sleep(0.01)
            assert doomed_vllm.process is not None
            os.killpg(doomed_vllm.process.pid, signal.SIGKILL)  # the API server and its engine: a crash, no goodbye
            killed_at = time.monotonic()
            done_at_kill = output.read_bytes().count(b"\n")
            doomed_vllm.process.wait(timeout=30)
            stdout, stderr = collect.communicate(timeout=300)
        finally:
            if collect.poll() is None:
                collect.kill()
        finished_at = time.monotonic()
        router = adapter.router
        attempts = list(router.attempts)
        report = router.report()

    # collect: every rollout done, none failed, every one token-contiguous (those that changed replica included).
    assert collect.returncode == 0, stderr
    assert f"0 failed, {total} total" in stdout
    assert not failures_path_for(output).exists()
    contiguity = check_file(output)
    assert contiguity.ok and contiguity.contiguous == contiguity.rollouts == total, contiguity.format()

    # Where the conversations went. The doomed replica was marked unhealthy by a failed call after the kill, was
    # never sent another call after that, and never came back.
    dead = router.replicas[doomed]
    assert not dead.healthy and dead.unhealthy_since is not None
    marked_at = dead.unhealthy_since
    assert killed_at < marked_at < finished_at
    assert all(a.started < marked_at for a in attempts if a.url == doomed), "a call went to the dead URL after the mark"
    assert all(a.outcome == "url_failed" for a in attempts if a.url == doomed and a.started > killed_at)

    conversations = by_conversation(attempts)
    assert len(conversations) == total  # the agent's x-session-id: one key per rollout
    before_kill = {a.url for a in attempts if a.outcome == "ok" and a.ended < killed_at}
    assert before_kill == {doomed, live}, "both replicas served conversations before the kill"
    started_after_kill = [calls for calls in conversations.values() if calls[0].started > killed_at]
    assert all(a.url == live for calls in started_after_kill for a in calls if a.outcome == "ok")
    started_after_mark = [calls for calls in conversations.values() if calls[0].started > marked_at]
    assert started_after_mark, "no conversation started after the doomed replica was marked unhealthy"
    assert all(a.url == live and a.outcome == "ok" for calls in started_after_mark for a in calls)
    moved = [
        calls
        for calls in conversations.values()
        if any(a.url == doomed and a.outcome == "ok" for a in calls) and any(a.url == live for a in calls)
    ]
    assert moved, "no conversation in flight on the doomed replica moved to the live one"
    for calls in conversations.values():  # every call the agent made was answered in the end
        assert calls[-1].outcome == "ok"
        assert all(a.outcome in ("ok", "url_failed") for a in calls)

    summary = {
        "rollouts": total,
        "killed_after_rollouts": done_at_kill,
        "seconds_kill_to_mark": round(marked_at - killed_at, 2),
        "seconds_kill_to_done": round(finished_at - killed_at, 1),
        "conversations_started_after_mark": len(started_after_mark),
        "conversations_moved": len(moved),
        "failed_calls_on_dead_url": sum(a.url == doomed and a.outcome == "url_failed" for a in attempts),
        "per_url": {
            entry["url"]: {
                k: entry[k]
                for k in ("conversations_started", "conversations_moved_in", "calls", "failed_calls", "healthy")
            }
            for entry in report["urls"]
        },
    }
    print(f"\nreplica failover: {json.dumps(summary)}")
