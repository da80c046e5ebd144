"""Start NeMo Gym 0.7.0's own servers from its installed package (no Ray, no uv) and collect rollouts through them.

The servers run in .venv-nemo-gym (`make test-nemo-gym` builds it); this module runs in the project's venv and only
talks to them over HTTP, the way NeMo Gym's launcher (`gym env start`) would after building their venvs: in each
server's folder, `python app.py` with the config NeMo Gym's parser resolved in NEMO_GYM_CONFIG_DICT and the server's
top-level key in NEMO_GYM_CONFIG_PATH.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

from nemo_gym_tok.common.managed_process import ManagedProcess, log_tail

REPO = Path(__file__).resolve().parents[2]
NEMO_GYM_VENV = Path(os.environ.get("NEMO_GYM_VENV", REPO / ".venv-nemo-gym"))
NEMO_GYM_PYTHON = NEMO_GYM_VENV / "bin" / "python"
RESOLVER = Path(__file__).with_name("resolve_config.py")
SERVER_KINDS = ("responses_api_models", "responses_api_agents", "resources_servers")


def package_root() -> Path:
    """The site-packages folder that holds nemo_gym/ and the shipped server folders beside it."""
    if not NEMO_GYM_PYTHON.exists():
        raise FileNotFoundError(f"{NEMO_GYM_PYTHON} is missing: `make test-nemo-gym` builds .venv-nemo-gym")
    out = subprocess.run(
        [str(NEMO_GYM_PYTHON), "-c", "import nemo_gym, pathlib; print(pathlib.Path(nemo_gym.__file__).parent.parent)"],
        check=True,
        capture_output=True,
        text=True,
    )
    return Path(out.stdout.strip())


def resolve_config(config_paths: Sequence[str], overrides: dict[str, Any]) -> str:
    """NeMo Gym's parser over its shipped configs plus `overrides`: the YAML every server process reads."""
    spec = json.dumps({"config_paths": list(config_paths), "overrides": overrides})
    out = subprocess.run([str(NEMO_GYM_PYTHON), str(RESOLVER), spec], capture_output=True, text=True, cwd=REPO)
    if out.returncode != 0:
        raise RuntimeError(f"NeMo Gym's config parser refused the config:\n{out.stderr[-4000:]}")
    return out.stdout


@dataclass
class GymServer:
    """One NeMo Gym server instance: its top-level key, kind/impl folder, URL and process."""

    key: str
    kind: str
    impl: str
    url: str
    process: ManagedProcess | None = None
    log_path: Path | None = None

    def log_tail(self, lines: int = 40) -> str:
        return log_tail(self.log_path, lines)


@dataclass
class Gym:
    """The running servers of one resolved config, by top-level key."""

    config: dict[str, Any]
    servers: dict[str, GymServer] = field(default_factory=dict)

    def url(self, key: str) -> str:
        return self.servers[key].url


def server_instances(config: dict[str, Any]) -> list[GymServer]:
    """The `instance -> kind -> impl` entries with an entrypoint, as NeMo Gym's launcher walks them."""
    found = []
    for key, value in config.items():
        if not isinstance(value, dict) or len(value) != 1:
            continue
        kind, inner = next(iter(value.items()))
        if kind not in SERVER_KINDS or not isinstance(inner, dict) or len(inner) != 1:
            continue
        impl, settings = next(iter(inner.items()))
        if isinstance(settings, dict) and "entrypoint" in settings:
            found.append(GymServer(key, kind, impl, f"http://{settings['host']}:{settings['port']}"))
    return found


@contextmanager
def running_gym(
    config_paths: Sequence[str],
    overrides: dict[str, Any],
    env: dict[str, str] | None = None,
    startup_timeout: float = 120.0,
    external: Sequence[str] = (),
) -> Iterator[Gym]:
    """Resolve the config, start every server of it from the package, wait until each answers, stop them after.

    `external`: instance keys served elsewhere (already running at the host and port the config gives them, e.g.
    this project's adapter): NeMo Gym's servers still resolve them by that host and port, but they are not started.
    """
    config_yaml = resolve_config(config_paths, overrides)
    gym = Gym(yaml.safe_load(config_yaml))
    root = package_root()
    log_dir = Path(tempfile.mkdtemp(prefix="ngt-nemo-gym-"))
    try:
        for server in server_instances(gym.config):
            if server.key in external:
                continue
            folder = root / server.kind / server.impl
            server.log_path = log_dir / f"{server.key}.log"
            server_env = {
                **os.environ,
                **(env or {}),
                "PYTHONPATH": str(root),
                "NEMO_GYM_CONFIG_DICT": config_yaml,
                "NEMO_GYM_CONFIG_PATH": server.key,
            }
            server.process = ManagedProcess.start(
                [str(NEMO_GYM_PYTHON), "app.py"], cwd=folder, env=server_env, log_path=server.log_path
            )
            gym.servers[server.key] = server
        for server in gym.servers.values():
            _wait_healthy(server, startup_timeout)
        yield gym
    finally:
        for server in gym.servers.values():
            _stop(server)


def _wait_healthy(server: GymServer, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert server.process is not None
        if not server.process.alive:
            raise RuntimeError(f"NeMo Gym server {server.key} exited:\n{server.log_tail()}")
        try:
            if httpx.get(f"{server.url}/health", timeout=2.0).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"NeMo Gym server {server.key} not healthy after {timeout:.0f}s:\n{server.log_tail()}")


def _stop(server: GymServer) -> None:
    if server.process is not None:
        server.process.stop(grace=15)


@dataclass
class RunResult:
    """One `/run` call of NeMo Gym's agent: the HTTP status and the JSON (or text) it answered."""

    status: int
    body: Any


def run_rows(
    agent_url: str, rows: Sequence[dict[str, Any]], concurrency: int = 4, timeout: float = 300.0
) -> list[RunResult]:
    """POST each row to the agent's `/run` (seed session, agent loop, verify), `concurrency` at a time."""

    def one(row: dict[str, Any]) -> RunResult:
        answer = httpx.post(f"{agent_url}/run", json=row, timeout=timeout)
        try:
            return RunResult(answer.status_code, answer.json())
        except ValueError:
            return RunResult(answer.status_code, answer.text)

    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(one, rows))
