"""Load test: 128 concurrent episodes through `ngt collect` and a launched gym on real vLLM, with RSS per server."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from nemo_gym_tok.cli.demo import DEMO_CONFIG
from nemo_gym_tok.collect import CollectSummary, collect
from nemo_gym_tok.config import load_config
from nemo_gym_tok.records.contiguity import check_file
from nemo_gym_tok.servers.launcher import Gym
from nemo_gym_tok.vllm_server import VLLMServer

REPO = Path(__file__).resolve().parents[1]
EPISODES = 128
"""In flight at once: every environment's agent collects its share with concurrency = that share."""
WARM_UP_EPISODES = 16
"""Per environment, before the first memory reading: imports, connection pools and caches fill here."""
MAX_RSS_GROWTH = 0.5
AGENTS = {
    "capital_lookup": "capital_lookup_agent",
    "grid_navigation": "grid_navigation_agent",
    "number_guess": "number_guess_agent",
}


def rss_kib(pid: int) -> int:
    """Resident set size of process `pid` (Linux /proc), in KiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for pid {pid}")


@dataclass
class PeakSampler:
    """Samples each server's RSS in the background while the load runs: the peak tells what the end may hide."""

    pids: dict[str, int]
    peaks: dict[str, int] = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)

    def __enter__(self) -> PeakSampler:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(0.25):
            for name, pid in self.pids.items():
                try:
                    self.peaks[name] = max(self.peaks.get(name, 0), rss_kib(pid))
                except (OSError, RuntimeError):
                    pass  # an exited server: the test's own checks report it


def write_rows(path: Path, environment: str, count: int) -> Path:
    """`count` rows cycling through the environment's example rows (each is its own rollout)."""
    lines = [
        line
        for line in (REPO / "resources_servers" / environment / "data" / "example.jsonl").read_text().splitlines()
        if line.strip()
    ]
    path.write_text("".join(lines[i % len(lines)] + "\n" for i in range(count)))
    return path


def shares(total: int, parts: int) -> list[int]:
    return [total // parts + (1 if i < total % parts else 0) for i in range(parts)]


@pytest.fixture(scope="module")
def gym(vllm_server: VLLMServer) -> Iterator[Gym]:
    """The demo composition started by the launcher: every server its own process, so its RSS is its own."""
    overrides = [
        f"policy_base_url={vllm_server.base_url}/v1",
        f"policy_model_name={vllm_server.served_model_name}",
        "head_server.port=0",
    ]
    with Gym(load_config([DEMO_CONFIG], overrides)) as running:
        yield running


async def collect_all(gym: Gym, inputs: dict[str, Path], output_dir: Path) -> dict[str, CollectSummary]:
    """Every environment's rows at once, each agent with all its rows in flight."""

    async def one(environment: str, rows: Path) -> tuple[str, CollectSummary]:
        agent = AGENTS[environment]
        count = len(rows.read_text().splitlines())
        summary = await collect(
            rows,
            output_dir / f"{environment}.jsonl",
            gym.urls[agent],
            agent=agent,
            concurrency=count,
            timeout=600.0,
            progress=False,
            auth_token=gym.auth_token,
        )
        return environment, summary

    return dict(await asyncio.gather(*(one(environment, rows) for environment, rows in inputs.items())))


@pytest.mark.vllm
def test_128_concurrent_episodes_lose_nothing_stay_contiguous_and_memory_stays_bounded(
    gym: Gym, tmp_path: Path
) -> None:
    pids = {child.name: child.process.pid for child in gym.children}
    warm_dir, load_dir = tmp_path / "warm-up", tmp_path / "load"
    warm_dir.mkdir(), load_dir.mkdir()
    warm = {env: write_rows(warm_dir / f"{env}.rows.jsonl", env, WARM_UP_EPISODES) for env in AGENTS}
    asyncio.run(collect_all(gym, warm, warm_dir))
    after_warm_up = {name: rss_kib(pid) for name, pid in pids.items()}

    loads = {
        env: write_rows(load_dir / f"{env}.rows.jsonl", env, count)
        for env, count in zip(AGENTS, shares(EPISODES, len(AGENTS)))
    }
    started = time.monotonic()
    with PeakSampler(pids) as sampler:
        summaries = asyncio.run(collect_all(gym, loads, load_dir))
    elapsed = time.monotonic() - started
    at_end = {name: rss_kib(pid) for name, pid in pids.items()}

    lost = sum(summary.total - summary.done_now for summary in summaries.values())
    non_contiguous, records, model_calls = 0, 0, 0
    for environment in AGENTS:
        report = check_file(load_dir / f"{environment}.jsonl")
        non_contiguous += report.rollouts - report.contiguous
        records, model_calls = records + report.rollouts, model_calls + report.turns
    growth = {name: (at_end[name] - after_warm_up[name]) / after_warm_up[name] for name in pids}
    print(
        f"\nload: {records} episodes ({model_calls} model calls) in {elapsed:.1f}s, {lost} lost, "
        f"{non_contiguous} not contiguous"
    )
    for name in pids:
        print(
            f"  {name}: RSS {after_warm_up[name] / 1024:.1f} MiB after warm-up -> {at_end[name] / 1024:.1f} MiB at "
            f"the end ({growth[name]:+.1%}; peak {sampler.peaks.get(name, 0) / 1024:.1f} MiB)"
        )

    failures = [
        json.loads(line)
        for summary in summaries.values()
        if summary.failures_path.exists()
        for line in summary.failures_path.read_text().splitlines()
    ]
    assert lost == 0 and records == EPISODES, failures[:3]
    assert non_contiguous == 0
    assert gym.exited_child() is None
    grown = {name: f"{value:+.1%}" for name, value in growth.items() if value >= MAX_RSS_GROWTH}
    assert not grown, f"RSS grew by {MAX_RSS_GROWTH:.0%} or more from after warm-up to the end: {grown}"
