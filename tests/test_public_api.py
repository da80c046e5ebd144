"""The package root re-exports the public API, lazily."""

import subprocess
import sys

import nemo_gym_tok


def test_every_export_resolves() -> None:
    for name in nemo_gym_tok.__all__:
        assert getattr(nemo_gym_tok, name) is not None, name


def test_importing_the_package_imports_no_heavy_dependency() -> None:
    code = (
        "import sys, nemo_gym_tok; print(any(m in sys.modules for m in ('vllm', 'transformers', 'fastapi', 'torch')))"
    )
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "False"
