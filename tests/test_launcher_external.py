"""`ngt run`'s launcher with servers it does not start from this project: an instance at a `url` (running elsewhere)
and the refusals of a NeMo Gym instance it cannot start (`nemo_gym_python`). The live runs of both against NeMo Gym's
own servers are in tests/nemo_gym/test_collect_nemo_gym_envs.py (`make test-nemo-gym`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from fastapi import FastAPI

from nemo_gym_tok.common.net import free_port
from nemo_gym_tok.config import load_config
from nemo_gym_tok.servers.inprocess import serve_in_thread
from nemo_gym_tok.servers.launcher import Gym, LaunchError


def gym_of(tmp_path: Path, instances: dict[str, Any], ready_timeout: float = 60.0) -> Gym:
    path = tmp_path / "gym.yaml"
    path.write_text(yaml.safe_dump({"head_server": {"port": free_port()}, **instances}))
    return Gym(load_config([path]), ready_timeout=ready_timeout)


def external(url: Any) -> dict[str, Any]:
    return {"env": {"resources_servers": {"example_single_tool_call": {"url": url}}}}


def test_external_server_is_not_started_and_every_server_gets_its_url(tmp_path: Path) -> None:
    with serve_in_thread(FastAPI()) as url:  # answers 404 on /health: reachable is all the launcher asks
        with gym_of(tmp_path, external(f"{url}/")) as gym:
            assert gym.urls == {"env": url}
            assert [child.name for child in gym.children] == ["head"]
            assert httpx.get(f"{gym.head_url}/servers", timeout=10).json() == {"env": url}


def test_unreachable_external_server_is_a_launch_error_naming_it(tmp_path: Path) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(LaunchError, match=rf"external servers not reachable: env \({dead}\)"):
        gym_of(tmp_path, external(dead), ready_timeout=1.0).start()


def test_external_url_must_be_a_base_url(tmp_path: Path) -> None:
    with pytest.raises(LaunchError, match=r"env\.resources_servers\.example_single_tool_call\.url: expected"):
        gym_of(tmp_path, external("127.0.0.1:8000")).start()


def test_nemo_gym_instance_without_a_usable_python_is_refused_before_it_starts(tmp_path: Path) -> None:
    instances = {
        "env": {
            "resources_servers": {
                "example_single_tool_call": {"nemo_gym_python": str(tmp_path / "no-python"), "domain": "agent"}
            }
        }
    }
    with pytest.raises(LaunchError, match=r"nemo_gym_python: .* is not an executable Python"):
        gym_of(tmp_path, instances).start()
