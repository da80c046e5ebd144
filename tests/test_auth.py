"""auth_token: every gym server route but /health answers 401 without it; `ngt run` and `ngt collect` work with it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI
from fastapi.routing import APIRoute
from fastapi.testclient import TestClient
from starlette.routing import Route

from nemo_gym_tok.config import ConfigError, ServerInstance, load_config
from nemo_gym_tok.servers.auth import AUTH_TOKEN_ENV, BearerTokenMiddleware, auth_token_of
from nemo_gym_tok.servers.base import BaseServer
from nemo_gym_tok.servers.client import ServerClient
from nemo_gym_tok.servers.head import HeadServer, HeadServerConfig
from nemo_gym_tok.servers.inprocess import serve_in_thread
from nemo_gym_tok.servers.registry import validate_instance
from responses_api_agents.simple_agent.app import SimpleAgent, SimpleAgentConfig
from responses_api_models.vllm_model.app import VLLMModel, VLLMModelConfig
from tests.fixtures.fake_vllm import fake_vllm_app
from tests.test_cli_run import read_urls

TOKEN = "s3cret-token"
REPO = Path(__file__).resolve().parents[1]
ROWS = REPO / "resources_servers" / "number_guess" / "data" / "example.jsonl"
NGT = [sys.executable, "-m", "nemo_gym_tok"]


def every_kind(token: str | None) -> dict[str, BaseServer]:
    """One server of each kind (head, model adapter, environment, agent), built with the gym's token."""

    def client() -> ServerClient:
        return ServerClient(
            {"policy_model": "http://127.0.0.1:9", "number_guess": "http://127.0.0.1:9"}, auth_token=token
        )

    env_class, env_config = validate_instance(
        ServerInstance("number_guess", "resources_servers", "number_guess", {}, {})
    )
    return {
        "head": HeadServer("head", HeadServerConfig(servers={"a": "http://127.0.0.1:9"}), client()),
        "adapter": VLLMModel("policy_model", VLLMModelConfig(base_url="http://127.0.0.1:9/v1", model="m"), client()),
        "environment": env_class("number_guess", env_config, client()),
        "agent": SimpleAgent(
            "agent", SimpleAgentConfig(model_server="policy_model", resources_server="number_guess"), client()
        ),
    }


def requests_of(app: FastAPI) -> list[tuple[str, str]]:
    """(method, path) of every route the app serves, FastAPI's own /docs and /openapi.json included."""
    pairs = []
    for route in app.routes:
        if isinstance(route, (APIRoute, Route)):
            for method in sorted(route.methods or {"GET"}):
                if method != "HEAD":
                    pairs.append((method, route.path))
    return pairs


@pytest.mark.parametrize("kind", ["head", "adapter", "environment", "agent"])
def test_every_route_but_health_is_401_without_the_token(kind: str) -> None:
    app = every_kind(TOKEN)[kind].build_app()
    pairs = requests_of(app)
    assert ("GET", "/openapi.json") in pairs and ("GET", "/docs") in pairs and len(pairs) > 4
    http = TestClient(app)  # no `with`: no lifespan, nothing upstream is reached
    for method, path in pairs:
        for headers in (
            {},
            {"Authorization": "Bearer wrong"},
            {"Authorization": TOKEN},
            {"Authorization": f"Basic {TOKEN}"},
            {"Authorization": f"Bearer {TOKEN}x"},
        ):
            answer = http.request(method, path, headers=headers, json={})
            if path == "/health":
                assert answer.status_code == 200, (method, path)
                continue
            assert answer.status_code == 401, (method, path, headers, answer.status_code)
            assert answer.headers["www-authenticate"] == "Bearer"
            error = answer.json()["error"]
            assert (
                error["code"] == 401 and error["type"] == "authentication_error" and "bearer token" in error["message"]
            )
    assert http.get("/nowhere").status_code == 401  # unknown paths too: nothing is told without the token
    authorized = {"Authorization": f"Bearer {TOKEN}"}
    for path in ("/openapi.json", "/docs"):
        assert http.get(path, headers=authorized).status_code == 200
    assert http.get("/nowhere", headers={"authorization": f"bearer {TOKEN}"}).status_code == 404


def test_without_a_token_nothing_is_required() -> None:
    for server in every_kind(None).values():
        app = server.build_app()
        assert not any(m.cls is BearerTokenMiddleware for m in app.user_middleware)
        assert TestClient(app).get("/openapi.json").status_code == 200


def test_token_comes_from_the_config_else_the_environment(tmp_path: Path) -> None:
    plain = tmp_path / "plain.yaml"
    plain.write_text("x: 1\n")
    assert auth_token_of(load_config([plain]), {}) is None
    assert auth_token_of(load_config([plain]), {AUTH_TOKEN_ENV: "from-env"}) == "from-env"
    secret = tmp_path / "secret.yaml"
    secret.write_text("auth_token: ${gym_secret}\ngym_secret: from-config\n")
    assert auth_token_of(load_config([secret]), {AUTH_TOKEN_ENV: "from-env"}) == "from-config"
    assert auth_token_of(load_config([plain], ["auth_token=1234"]), {}) == "1234"  # --set parses YAML: an int
    for bad in ("auth_token=''", "auth_token=two words", "auth_token=[a]"):
        with pytest.raises(ConfigError, match="auth_token"):
            auth_token_of(load_config([plain], [bad]), {})


@pytest.fixture
def fake_vllm() -> Iterator[tuple[str, list[str]]]:
    """The fixture vLLM stand-in, recording the Authorization header of each call (the adapter's api_key)."""
    seen: list[str] = []
    app = fake_vllm_app()

    @app.middleware("http")
    async def record(request, call_next):  # type: ignore[no-untyped-def]
        seen.append(request.headers.get("authorization", ""))
        return await call_next(request)

    with serve_in_thread(app) as url:
        yield url, seen


def test_ngt_run_and_collect_with_the_token(fake_vllm: tuple[str, list[str]], tmp_path: Path) -> None:
    vllm_url, seen = fake_vllm
    config = tmp_path / "gym.yaml"
    config.write_text(
        "head_server: {port: 0}\n"
        f"policy_model: {{responses_api_models: {{vllm_model: {{base_url: '{vllm_url}/v1', model: m, "
        "api_key: vllm-key, return_token_id_information: true}}}\n"
        "number_guess: {resources_servers: {number_guess: {}}}\n"
        "number_guess_agent: {responses_api_agents: {simple_agent: {model_server: policy_model, "
        "resources_server: number_guess, max_steps: 2}}}\n"
    )
    env = {**os.environ, AUTH_TOKEN_ENV: TOKEN}
    gym = subprocess.Popen([*NGT, "run", "-c", str(config)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        urls = read_urls(gym)
        authorized = {"Authorization": f"Bearer {TOKEN}"}
        for url in urls.values():  # every process of the gym enforces it
            assert httpx.get(f"{url}/health").status_code == 200
            assert httpx.get(f"{url}/openapi.json").status_code == 401
            assert httpx.get(f"{url}/openapi.json", headers=authorized).status_code == 200
        assert httpx.get(f"{urls['head']}/servers").status_code == 401

        output = tmp_path / "rollouts.jsonl"
        command = [
            *NGT,
            "collect",
            "--input",
            str(ROWS),
            "--output",
            str(output),
            "--agent",
            "number_guess_agent",
            "--head-url",
            urls["head"],
            "--limit",
            "2",
            "--repeats",
            "2",
        ]
        refused = subprocess.run(
            command,
            env={k: v for k, v in env.items() if k != AUTH_TOKEN_ENV},
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert refused.returncode == 2 and AUTH_TOKEN_ENV in refused.stderr
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        records = [json.loads(line) for line in output.read_text().splitlines()]
        assert len(records) == 4 and all("reward" in record for record in records)
        # The agent's calls to the adapter and the environment carried the gym token (or they would be 401s);
        # the adapter sent vLLM its own api_key.
        assert seen and set(seen) == {"Bearer vllm-key"}
        gym.send_signal(signal.SIGINT)
        assert gym.wait(timeout=30) == 0
    finally:
        if gym.poll() is None:
            gym.kill()
            gym.wait()
