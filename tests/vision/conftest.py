"""The tiny vision-language model served by `ngt vllm-serve` on the real vLLM CPU build: one server for the folder,
launched as soon as collection ends (the root conftest calls `launch_early`) so that its start-up overlaps the suite's
other tests; its model worker on a CPU of its own."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest

from nemo_gym_tok.testing.tiny_model.vision import build_tiny_vlm
from nemo_gym_tok.vllm_server import (
    CPU_SERVING_ARGS,
    CPU_SERVING_ENV,
    TEST_BED_ARGS,
    TEST_BED_ENV,
    VLLMServer,
    replica_cpu_env,
)
from tests.servers import hooked_server

VLM_NAME = "tiny-vlm"
MAX_IMAGES_PER_PROMPT = 4
REUSE_ENV = "NGT_TEST_VLM_URL"
FOLDER = Path(__file__).resolve().parent
EXTRA_ARGS = (*CPU_SERVING_ARGS, *TEST_BED_ARGS, "--limit-mm-per-prompt", f'{{"image": {MAX_IMAGES_PER_PROMPT}}}')
ENV = {**TEST_BED_ENV, **CPU_SERVING_ENV, **replica_cpu_env(1)}  # the shared text servers' workers sit on CPU 0

_launched: list[VLLMServer] = []


def launch_early(items: Iterable[pytest.Item]) -> None:
    """Launch the VLM now if a selected test needs it (and no server is reused): the fixture waits for it later."""
    if os.environ.get(REUSE_ENV) or _launched or not any(item.path.is_relative_to(FOLDER) for item in items):
        return
    log = Path(tempfile.mkdtemp(prefix="ngt-vlm-")) / "vllm.log"
    server = VLLMServer(build_tiny_vlm(), served_model_name=VLM_NAME, extra_args=EXTRA_ARGS, env=ENV, log_path=log)
    _launched.append(server.launch())


def stop_early() -> None:
    """Stop a launched VLM no test waited for (a run stopped early)."""
    while _launched:
        _launched.pop().stop()


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
        launched=_launched.pop() if _launched else None,
    ) as server:
        yield server
