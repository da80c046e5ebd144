"""docs/architecture.md and the packages' own docstrings name only what exists: every identifier the architecture
page quotes is in the code, every `ngt` command built on the test harnesses is in their row, and every module a
package's docstring lists (a paragraph that speaks of its modules) is one of its modules."""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "architecture.md"
LIBRARY_ROOTS = ("nemo_gym_tok", "responses_api_models", "resources_servers", "responses_api_agents")
IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _library_text() -> str:
    return "\n".join(path.read_text(encoding="utf-8") for root in LIBRARY_ROOTS for path in (ROOT / root).rglob("*.py"))


def quoted_identifiers(text: str) -> set[str]:
    """Backticked spans of the page that are one Python identifier with an underscore or a capital inside (a
    function, class or constant, not a word of prose), `name(...)` and `Class.method` read as their parts."""
    names = set()
    for span in re.findall(r"`([^`\n]+)`", text):
        for part in re.sub(r"\(.*\)$", "", span).split("."):
            if IDENTIFIER.fullmatch(part) and ("_" in part.strip("_") or re.search(r"[a-z][A-Z]|^[A-Z][a-z]", part)):
                names.add(part)
    return names


def test_every_identifier_the_architecture_page_quotes_is_in_the_code() -> None:
    code = _library_text()
    names = quoted_identifiers(DOC.read_text(encoding="utf-8"))
    assert len(names) > 60, sorted(names)
    missing = sorted(name for name in names if not re.search(rf"\b{re.escape(name)}\b", code))
    assert not missing, f"docs/architecture.md quotes names no library module has: {missing}"


def _commands_of(module: Path) -> list[str]:
    return re.findall(r"add_parser\(\s*\"([a-z-]+)\"", module.read_text(encoding="utf-8"))


def test_every_command_built_on_the_test_harnesses_is_in_their_row() -> None:
    row = next(line for line in DOC.read_text(encoding="utf-8").splitlines() if line.startswith("| test harnesses |"))
    built_on_harnesses = [
        command
        for module in sorted((ROOT / "nemo_gym_tok" / "cli").glob("*.py"))
        if "nemo_gym_tok.testing" in module.read_text(encoding="utf-8")
        for command in _commands_of(module)
    ]
    assert len(built_on_harnesses) >= 4, built_on_harnesses
    unnamed = [command for command in built_on_harnesses if f"`ngt {command}`" not in row]
    assert not unnamed, f"the test harnesses row of docs/architecture.md leaves out: {unnamed}"


def test_package_docstrings_list_only_their_own_modules() -> None:
    wrong = []
    for init in sorted(path for root in LIBRARY_ROOTS for path in (ROOT / root).rglob("__init__.py")):
        docstring = ast.get_docstring(ast.parse(init.read_text(encoding="utf-8"))) or ""
        listing = " ".join(paragraph for paragraph in docstring.split("\n\n") if "modules" in paragraph)
        package_name = ".".join(init.parent.relative_to(ROOT).parts)
        package = importlib.import_module(package_name)
        for name in re.findall(r"`([a-z_][a-z0-9_]*)`", listing):
            module_there = (init.parent / f"{name}.py").is_file() or (init.parent / name / "__init__.py").is_file()
            if not module_there and not hasattr(package, name):
                wrong.append(f"{init.relative_to(ROOT)} names `{name}`, which is neither a module nor a name of it")
    assert not wrong, "\n".join(wrong)
