"""The tiny vision-language model served by `ngt vllm-serve` on the real vLLM CPU build: one server for the folder."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from nemo_gym_tok.testing.tiny_model.vision import build_tiny_vlm
from nemo_gym_tok.vllm_server import CPU_SERVING_ARGS, CPU_SERVING_ENV, TEST_BED_ARGS, TEST_BED_ENV, VLLMServer
from tests.servers import hooked_server

VLM_NAME = "tiny-vlm"
MAX_IMAGES_PER_PROMPT = 4


@pytest.fixture(scope="session")
def tiny_vlm_dir() -> Path:
    return build_tiny_vlm()


@pytest.fixture(scope="session")
def vlm_server(tiny_vlm_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VLLMServer]:
    """The hooked tiny VLM, shared by every vision test. NGT_TEST_VLM_URL reuses one for local iteration (CI never
    sets it)."""
    with hooked_server(
        tiny_vlm_dir,
        served_model_name=VLM_NAME,
        extra_args=(
            *CPU_SERVING_ARGS,
            *TEST_BED_ARGS,
            "--limit-mm-per-prompt",
            f'{{"image": {MAX_IMAGES_PER_PROMPT}}}',
        ),
        env={**TEST_BED_ENV, **CPU_SERVING_ENV},
        log_path=tmp_path_factory.mktemp("vlm") / "vllm.log",
        reuse_env="NGT_TEST_VLM_URL",
        what="hooked tiny VLM: ",
    ) as server:
        yield server
