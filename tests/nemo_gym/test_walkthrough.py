"""docs/nemo-gym.md's walk-through, run as written: `ngt vllm-serve`, NeMo Gym's `gym env start` and `gym eval run`,
then `ngt check` over the rollouts NeMo Gym wrote.

The commands are read from the doc's `bash` blocks, so the doc cannot drift from what runs. Each block runs in the
environment its first line names: this project's venv (vLLM + the hook) or .venv-nemo-gym (NeMo Gym). Run by
`make test-nemo-gym` only.
"""

from __future__ import annotations

import copy
import json
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from nemo_gym_tok.common.managed_process import ManagedProcess
from nemo_gym_tok.vllm_server import CPU_SERVING_ARGS, CPU_SERVING_ENV, TEST_BED_ARGS, TEST_BED_ENV
from tests.nemo_gym import gym
from tests.nemo_gym.nemo_rl_rule import check_rollout

pytestmark = pytest.mark.vllm

DOC = gym.REPO / "docs" / "nemo-gym.md"
SECTION = "## Walk-through"
DOC_PORT = "8000"
HOOK_BIN = Path(sys.executable).parent
# The servers `gym env start --resources-server example_single_tool_call --model-type vllm_model` launches, each
# from the venv NeMo Gym looks for under uv_venv_dir (<kind>/<name>/.venv).
SERVER_FOLDERS = (
    "resources_servers/example_single_tool_call",
    "responses_api_agents/simple_agent",
    "responses_api_models/vllm_model",
    "environment_servers/legacy_agent",
)
SHIPPED_ROWS = 5  # example_single_tool_call/data/example.jsonl
REPEATS = 4  # the doc's --num-repeats


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def walkthrough_blocks(doc: str) -> list[str]:
    """The `bash` blocks of the doc's walk-through section, in order."""
    start = doc.index(SECTION)
    end = doc.find("\n## ", start + len(SECTION))
    section = doc[start : end if end != -1 else None]
    return re.findall(r"```bash\n(.*?)```", section, flags=re.S)


def block_bin(block: str) -> Path:
    """The bin folder of the environment the block's first line names."""
    first = block.splitlines()[0]
    if "NeMo Gym's environment" in first:
        return gym.NEMO_GYM_VENV / "bin"
    if "has vLLM" in first or "environment of step 1" in first:
        return HOOK_BIN
    raise AssertionError(f"the walk-through block does not say which environment it runs in: {first!r}")


def _rows(path: Path) -> None:
    shipped = gym.package_root() / "resources_servers" / "example_single_tool_call" / "data" / "example.jsonl"
    rows = [json.loads(line) for line in shipped.read_text().splitlines() if line.strip()]
    assert len(rows) == SHIPPED_ROWS, f"NeMo Gym now ships {len(rows)} rows: update SHIPPED_ROWS"
    with path.open("w") as out:
        for row in rows:
            row = copy.deepcopy(row)
            params = row["responses_create_params"]
            for tool in params["tools"]:
                tool["parameters"]["properties"]["city"]["enum"] = ["sf", "nyc", "paris"]
            params.update(tool_choice="required", parallel_tool_calls=False, max_output_tokens=64)
            out.write(json.dumps(row) + "\n")


def _venv_links(root: Path) -> Path:
    """NeMo Gym's per-server venv folders, each a link to the prebuilt .venv-nemo-gym."""
    for folder in SERVER_FOLDERS:
        (root / folder).mkdir(parents=True, exist_ok=True)
        (root / folder / ".venv").symlink_to(gym.NEMO_GYM_VENV.resolve())
    return root


@contextmanager
def _background(command: str, env: dict[str, str], cwd: Path, log: Path) -> Iterator[ManagedProcess]:
    process = ManagedProcess.start(["bash", "-c", command], env=env, cwd=cwd, log_path=log)
    try:
        yield process
    finally:
        # SIGTERM to the block's process group (gym env start then stops its servers and Ray), SIGKILL what is left.
        process.stop(grace=45.0)


def _wait_for(what: str, ready: Callable[[], object], process: ManagedProcess, log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not process.alive:
            pytest.fail(f"{what} exited ({process.returncode}):\n{log.read_text(errors='replace')[-4000:]}")
        if ready():
            return
        time.sleep(1.0)
    pytest.fail(f"{what} not ready after {timeout:.0f}s:\n{log.read_text(errors='replace')[-4000:]}")


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2.0).status_code == 200
    except httpx.TransportError:
        return False


def _splices(base_url: str) -> float:
    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    return sum(
        float(line.split()[1]) for line in text.splitlines() if line.startswith("nemo_gym_tok_prefix_splices_total")
    )


def test_walkthrough_as_written(tiny_model_dir: Path, tmp_path: Path) -> None:
    blocks = walkthrough_blocks(DOC.read_text())
    assert len(blocks) == 4, f"the walk-through has {len(blocks)} bash blocks, this test runs 4"
    port = str(_free_port())
    venvs = _venv_links(tmp_path / "nemo-gym-venvs")
    gym_args = f" ++skip_venv_if_present=true ++uv_venv_dir={venvs}"
    vllm_args = [*CPU_SERVING_ARGS, *TEST_BED_ARGS]
    # $VLLM_ARGS is expanded unquoted, as a user's flags would be: the JSON value must hold no spaces.
    vllm_args = [json.dumps(json.loads(a), separators=(",", ":")) if a.startswith("{") else a for a in vllm_args]
    base_env = {
        **os.environ,
        **CPU_SERVING_ENV,
        **TEST_BED_ENV,
        "MODEL": str(tiny_model_dir),
        "VLLM_ARGS": " ".join(vllm_args),
    }

    def command(block: str) -> tuple[str, dict[str, str]]:
        text = re.sub(rf"\b{DOC_PORT}\b", port, block)
        bin_dir = block_bin(block)
        if bin_dir != HOOK_BIN:
            text = text.rstrip() + gym_args
        return text, {**base_env, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}

    _rows(tmp_path / "rows.jsonl")
    vllm_url = f"http://127.0.0.1:{port}"
    serve, serve_env = command(blocks[0])
    start, start_env = command(blocks[1])
    with _background(serve, serve_env, tmp_path, tmp_path / "vllm.log") as vllm:
        _wait_for(
            "`ngt vllm-serve` (block 1)", lambda: _healthy(f"{vllm_url}/health"), vllm, tmp_path / "vllm.log", 900
        )
        splices_before = _splices(vllm_url)
        env_log = tmp_path / "gym-env-start.log"
        with _background(start, start_env, tmp_path, env_log) as servers:
            _wait_for(
                "`gym env start` (block 2)",
                lambda: re.search(r"All (\d+) / \1 servers ready", env_log.read_text(errors="replace")),
                servers,
                env_log,
                600,
            )
            collect, collect_env = command(blocks[2])
            collected = subprocess.run(
                ["bash", "-c", collect], env=collect_env, cwd=tmp_path, capture_output=True, text=True, timeout=1200
            )
            assert collected.returncode == 0, (collected.stdout + collected.stderr)[-4000:]
        splices = _splices(vllm_url) - splices_before
    check, check_env = command(blocks[3])
    checked = subprocess.run(
        ["bash", "-c", check], env=check_env, cwd=tmp_path, capture_output=True, text=True, timeout=300
    )

    rows = [json.loads(line) for line in (tmp_path / "rollouts.jsonl").read_text().splitlines() if line.strip()]
    rule = [check_rollout(row) for row in rows]
    calls = sum(r.model_calls for r in rule)
    print(
        f"\n[nemo-gym walk-through] rollouts {len(rows)}, contiguous by NeMo RL's rule "
        f"{sum(r.contiguous for r in rule)}, model calls {calls}, with several calls "
        f"{sum(r.model_calls > 1 for r in rule)}, hook splices {splices:.0f}, rewards "
        f"{sum(row['reward'] for row in rows):.0f}/{len(rows)}\n[nemo-gym walk-through] ngt check:\n{checked.stdout}"
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert f"token-contiguous rollouts: {len(rows)}/{len(rows)}" in checked.stdout
    assert len(rows) == SHIPPED_ROWS * REPEATS
    assert all(r.contiguous for r in rule), [r.first_break for r in rule if not r.contiguous]
    # Several calls in some rollout, each later call spliced by the hook: the walk-through exercised the splice.
    assert calls > len(rows) and splices >= calls - len(rows)
