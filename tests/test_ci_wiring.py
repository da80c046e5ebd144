"""What .ci/run relies on the Makefile for: the side venvs and the stock vLLM wheels fetched while `make test` runs."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def dry_run(target: str) -> list[str]:
    """The commands `make TARGET` would run from scratch (`-n -B`: printed, none run, whatever is installed here)."""
    if shutil.which("make") is None:
        pytest.fail("make is not installed; the repository's targets need it")
    completed = subprocess.run(
        ["make", "--dry-run", "--always-make", target], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert completed.returncode == 0, completed.stderr
    return completed.stdout.splitlines()


def test_extra_venvs_builds_the_nemo_gym_venv() -> None:
    """A prerequisite list is expanded when make reads the rule: a variable defined below it would be empty there."""
    commands = dry_run("extra-venvs")
    assert any("pip install" in line and "nemo-gym==" in line for line in commands), commands


def test_extra_venvs_fetches_the_stock_wheels() -> None:
    commands = dry_run("extra-venvs")
    assert any(line.endswith("ngt vllm-compat --download-only") for line in commands), commands


def test_ci_checks_the_stock_wheels_and_cannot_skip_them() -> None:
    assert any(
        "NGT_REQUIRE_VLLM_WHEELS=1" in line and "tests/vllm_wheels" in line for line in dry_run("test-vllm-wheels")
    )
    steps = [line.split("#")[0].split() for line in (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()]
    names = [words[1] for words in steps if words[:1] == ["step"]]
    assert names.index("test-vllm-wheels") > names.index("test")
