"""No module reaches into another's privates: no `_name` imported across modules, no private module from outside
its package (a name another module needs is public, or the code moves to where it is used)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LIBRARY_ROOTS = ("nemo_gym_tok", "responses_api_models", "resources_servers", "responses_api_agents")


def _private(part: str) -> bool:
    return part.startswith("_") and not part.startswith("__")


def reaches_into_privates(path: Path) -> list[str]:
    """Each import in `path` that takes a private name from another module, or a private module from outside the
    package that holds it."""
    relative = path.relative_to(ROOT)
    package = ".".join(relative.with_suffix("").parts[:-1])
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            modules = [node.module]
            found.extend(
                f"{relative}:{node.lineno} imports {node.module}.{alias.name}"
                for alias in node.names
                if _private(alias.name)
            )
        elif isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        else:
            continue
        for module in modules:
            parts = module.split(".")
            for index, part in enumerate(parts):
                owner = ".".join(parts[:index])
                if _private(part) and not (package == owner or package.startswith(f"{owner}.")):
                    found.append(f"{relative}:{node.lineno} imports the private module {module} from outside {owner}")
                    break
    return found


def _library_files() -> list[Path]:
    return sorted(path for root in LIBRARY_ROOTS for path in (ROOT / root).rglob("*.py") if "tests" not in path.parts)


def test_no_module_imports_another_modules_private_names() -> None:
    files = _library_files()
    assert len(files) > 150, f"found only {len(files)} library files"
    found = [line for path in files for line in reaches_into_privates(path)]
    assert not found, "private names imported across modules:\n" + "\n".join(found)


@pytest.mark.parametrize(
    ("source", "reaches"),
    [
        ("from PKG.servers.http_pool import _pooled\n", True),
        ("from PKG.splice._ids import check_token_ids\n", True),  # a private module from outside splice/
        ("import PKG.splice._ids\n", True),
        ("from PKG.splice import check_token_ids\n", False),
        ("from __future__ import annotations\n", False),
    ],
)
def test_the_check_sees_what_it_should(tmp_path: Path, source: str, reaches: bool) -> None:
    probe = ROOT / "nemo_gym_tok" / "servers" / f"_probe_{tmp_path.name}.py"
    # PKG stands for the package, so that the architecture test's scan of this file does not read the probes as imports.
    probe.write_text(source.replace("PKG", "nemo_gym_tok"), encoding="utf-8")
    try:
        assert bool(reaches_into_privates(probe)) is reaches
    finally:
        probe.unlink()
