"""Fixtures shared by every test folder: the embedded tiny model and ONE real vLLM server per test session."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from nemo_gym_tok.testing.tiny_model import build_tiny_model
from nemo_gym_tok.vllm.hook import ENABLE_ENV
from nemo_gym_tok.vllm_server import CPU_SERVING_ARGS, TEST_BED_ARGS, TEST_BED_ENV, VLLMServer
from tests.servers import hooked_server
from tests.weights_support import DEV_MODE_ENV, copy_model_dir

# The fake agent's fixtures (`behaviour`, `agent_url`), shared by the collect tests; the training tests' float32
# vLLM and gym (`train_vllm_server`, `train_gym`, `train_model_dir`).
pytest_plugins = ["tests.fixtures.collect_agent", "tests.fixtures.train_servers"]

SERVED_MODEL_NAME = "tiny-qwen3"
# vLLM's Cohere v2 routes (tests/test_routes_cohere.py) on the shared hooked server, so they need no server of their
# own; with the `cohere` SDK (a test dependency) importable they are served only when this is set.
COHERE_API_ENV = {"VLLM_ENABLE_COHERE_API": "1"}


def pytest_collection_finish(session: pytest.Session) -> None:
    from tests.vision.server import launch_early

    if not session.config.option.collectonly:
        launch_early(session.items)  # the vision tests' server starts now, its start-up beside the other tests


def pytest_sessionfinish(session: pytest.Session) -> None:
    from tests.vision.server import stop_early

    stop_early()


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    return build_tiny_model()


@pytest.fixture(scope="session")
def vllm_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VLLMServer]:
    """The real vLLM OpenAI server (CPU build) on the tiny model with the prefix-splice hook (`ngt vllm-serve`),
    shared by every test that needs it. Requests without a bundle or prefix get stock vLLM behaviour.

    For local iteration only, NGT_TEST_VLLM_URL points the suite at a vLLM already serving the tiny model
    as `tiny-qwen3` (started the same way); CI never sets it, so CI always starts its own server.
    """
    with hooked_server(
        tiny_model_dir,
        served_model_name=SERVED_MODEL_NAME,
        extra_args=(*CPU_SERVING_ARGS, *TEST_BED_ARGS),
        env={**TEST_BED_ENV, **COHERE_API_ENV, DEV_MODE_ENV: "1"},  # loopback: /weight_info, /update_weight_version
        log_path=tmp_path_factory.mktemp("vllm") / "vllm.log",
        reuse_env="NGT_TEST_VLLM_URL",
    ) as server:
        yield server


@pytest.fixture(scope="session")
def plain_vllm_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VLLMServer]:
    """A stock vLLM server (`python -m vllm.entrypoints.openai.api_server`, no plugin switched on) on the tiny model,
    started like the hooked one: what a user who cannot install anything into vLLM talks to. Shared by every test
    of the adapter-side splice. NGT_TEST_PLAIN_VLLM_URL reuses one for local iteration (CI never sets it)."""
    with hooked_server(
        tiny_model_dir,
        served_model_name=SERVED_MODEL_NAME,
        extra_args=(*CPU_SERVING_ARGS, *TEST_BED_ARGS),
        env={**TEST_BED_ENV, ENABLE_ENV: "0", DEV_MODE_ENV: "1"},  # loopback: /weight_info for the adapter
        log_path=tmp_path_factory.mktemp("plain-vllm") / "vllm.log",
        reuse_env="NGT_TEST_PLAIN_VLLM_URL",
        hook=False,
        what="stock vLLM (no plugin): ",
    ) as server:
        yield server


@pytest.fixture(scope="session")
def rl_model_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A private copy of the tiny model: the directory `rl_vllm_server` starts from and rolls back to."""
    return copy_model_dir(tiny_model_dir, tmp_path_factory.mktemp("rl-model") / "step-0")


@pytest.fixture(scope="session")
def rl_vllm_server(rl_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VLLMServer]:
    """A hooked float32 vLLM with vLLM's weight routes (VLLM_SERVER_DEV_MODE=1) on a copy of the tiny model, for the
    tests that push weights and the RL loop's (tests/fixtures/train_servers.py): they change what it serves, so it is
    not `vllm_server`. float32, as `ngt train-demo` serves: bfloat16 would round the float32 learner's updates
    (docs/training.md). A test pushes its own step-0 checkpoint first rather than rely on what another test left.
    NGT_TEST_RL_VLLM_URL reuses one."""
    with hooked_server(
        rl_model_dir,
        served_model_name=SERVED_MODEL_NAME,
        extra_args=("--dtype", "float32", "--enforce-eager", *TEST_BED_ARGS),
        env={**TEST_BED_ENV, DEV_MODE_ENV: "1"},
        log_path=tmp_path_factory.mktemp("rl-vllm") / "vllm.log",
        reuse_env="NGT_TEST_RL_VLLM_URL",
        what="hooked vLLM with weight routes: ",
    ) as server:
        yield server
