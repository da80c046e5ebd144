"""The tiny vision-language model served by `ngt vllm-serve` on the real vLLM CPU build: one server for the folder,
launched early (tests/vision/server.py) and waited for here."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from nemo_gym_tok.testing.tiny_model.vision import build_tiny_vlm
from nemo_gym_tok.vllm_server import VLLMServer
from tests.servers import hooked_server
from tests.vision.server import ENV, EXTRA_ARGS, REUSE_ENV, VLM_NAME, take_launched


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
        extra_args=EXTRA_ARGS,
        env=ENV,
        log_path=tmp_path_factory.mktemp("vlm") / "vllm.log",
        reuse_env=REUSE_ENV,
        what="hooked tiny VLM: ",
        launched=take_launched(),
    ) as server:
        yield server
