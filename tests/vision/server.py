"""The tiny vision-language model's server for the vision tests: its settings, and the one launched as soon as
collection ends (the root conftest calls `launch_early`) so that its start-up overlaps the suite's other tests; its
model worker on a CPU of its own. A module of its own, not the folder's conftest: pytest may import a conftest under
another name than `tests.vision.conftest`, and the launched server must be the one the fixture finds."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable
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

VLM_NAME = "tiny-vlm"
MAX_IMAGES_PER_PROMPT = 4
REUSE_ENV = "NGT_TEST_VLM_URL"
FOLDER = Path(__file__).resolve().parent
EXTRA_ARGS = (*CPU_SERVING_ARGS, *TEST_BED_ARGS, "--limit-mm-per-prompt", f'{{"image": {MAX_IMAGES_PER_PROMPT}}}')
ENV = {**TEST_BED_ENV, **CPU_SERVING_ENV, **replica_cpu_env(1)}  # the shared text servers' workers sit on CPU 0

_launched: list[VLLMServer] = []


def take_launched() -> VLLMServer | None:
    """The early-launched server, for the fixture to wait for (None when none was launched)."""
    return _launched.pop() if _launched else None


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
