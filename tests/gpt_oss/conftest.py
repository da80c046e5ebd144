"""The tiny GPT-OSS model and ONE real hooked vLLM server on it for this folder (`make test-gpt-oss`)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from nemo_gym_tok.testing.tiny_model.gpt_oss import build_tiny_gpt_oss
from nemo_gym_tok.vllm_server import CPU_SERVING_ARGS, VLLMServer
from tests.servers import hooked_server

SERVED_MODEL_NAME = "tiny-gpt-oss"
# Pinned explicitly (ngt vllm-serve would pin today's date): Harmony writes it into every system message.
START_DATE = "2025-06-28"
GPT_OSS_ARGS = (
    # No chunked prefill, as on the test bed (nemo_gym_tok/vllm_server.py): the CPU engine dies when it splits the
    # prefill of a seeded request. These seeded conversations run one at a time and fit the budget today; the flag
    # keeps a later concurrent test from reaching the split.
    "--max-model-len",
    "4096",
    "--max-num-batched-tokens",
    "4096",
    "--no-enable-chunked-prefill",
    "--seed",
    "0",
    # Forced tool calls on gpt_oss need the openai tool parser; without it tool_choice is silently ignored.
    "--enable-auto-tool-choice",
    "--tool-call-parser",
    "openai",
    "--reasoning-parser",
    "openai_gptoss",
)


@pytest.fixture(scope="session")
def gpt_oss_model_dir() -> Path:
    return build_tiny_gpt_oss()


@pytest.fixture(scope="session")
def gpt_oss_server(gpt_oss_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VLLMServer]:
    """The real vLLM server (CPU build) on the tiny GPT-OSS, through `ngt vllm-serve` (hook on), date pinned.

    For local iteration only, NGT_TEST_GPT_OSS_URL points these tests at a server already running the same way.
    """
    with hooked_server(
        gpt_oss_model_dir,
        served_model_name=SERVED_MODEL_NAME,
        extra_args=(*CPU_SERVING_ARGS, *GPT_OSS_ARGS),
        env={"VLLM_SYSTEM_START_DATE": START_DATE},
        log_path=tmp_path_factory.mktemp("vllm-gpt-oss") / "vllm.log",
        reuse_env="NGT_TEST_GPT_OSS_URL",
    ) as server:
        yield server
