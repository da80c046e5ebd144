"""docs/architecture.md stays true: every repo path it names exists, and the code keeps the layering it states."""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "architecture.md"
LIBRARY_ROOTS = ("nemo_gym_tok", "responses_api_models", "resources_servers", "responses_api_agents")
SERVING_PACKAGES = {"vllm", "fastapi", "starlette", "uvicorn", "httpx", "aiohttp", "transformers", "torch"}
VLLM_IMPORTERS = ("nemo_gym_tok/vllm/", "nemo_gym_tok/cli/vllm_serve.py")


def _doc() -> str:
    return DOC.read_text(encoding="utf-8")


def _looks_like_path(span: str) -> bool:
    if span.startswith("/") or re.search(r"\s", span) or "://" in span:
        return False  # HTTP routes (`/v1/responses`), commands, config snippets
    return "/" in span or span.endswith((".py", ".md", ".yaml"))


def doc_paths(text: str) -> list[str]:
    """Every backticked span that names a repo path; `<name>` placeholders become `*`."""
    spans = re.findall(r"`([^`\n]+)`", text)
    return sorted({re.sub(r"<[^>]+>", "*", span) for span in spans if _looks_like_path(span)})


def test_every_path_the_doc_names_exists() -> None:
    paths = doc_paths(_doc())
    assert len(paths) >= 60, f"the path extraction found only {len(paths)} paths: {paths}"
    missing = [p for p in paths if not (any(ROOT.glob(p.rstrip("/"))) if "*" in p else (ROOT / p).exists())]
    assert not missing, f"docs/architecture.md names paths that do not exist: {missing}"


def test_where_to_change_what_names_files() -> None:
    section = _doc().split("## Where to change what", 1)[1]
    named = [p for p in doc_paths(section) if p.endswith((".py", ".md", ".yaml"))]
    assert len(named) >= 25, named
    for topic in ("chat-template quirk", "vLLM release", "new environment", "model server option", "NeMo Gym", "`ngt`"):
        assert topic in section, f"'where to change what' lost its paragraph on {topic!r}"


def _cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def layer_rows(text: str) -> list[tuple[str, list[str]]]:
    """(layer, its path prefixes) for each row of the layers table, bottom first."""
    section = text.split("## The layers, bottom up", 1)[1].split("\n## ", 1)[0]
    table = section.split("\n\n| layer |", 1)[1].split("\n\n", 1)[0]
    rows = []
    for line in table.splitlines()[2:]:  # header remainder and separator
        name, where = _cells(line)[:2]
        prefixes = [p for p in re.findall(r"`([^`]+)`", where) if p.endswith(("/", ".py"))]
        rows.append((name, prefixes))
    return rows


def library_files() -> list[str]:
    """The modules of LIBRARY_ROOTS, tests left out, as paths from the repo root (test_exact_json.py scans them too)."""
    files = []
    for root in LIBRARY_ROOTS:
        for path in (ROOT / root).rglob("*.py"):
            relative = path.relative_to(ROOT)
            if "tests" not in relative.parts:
                files.append(relative.as_posix())
    return sorted(files)


def _layer_of(file: str, rows: list[tuple[str, list[str]]]) -> int | None:
    best: tuple[int, int] | None = None  # (prefix length, row)
    for index, (_, prefixes) in enumerate(rows):
        for prefix in prefixes:
            if (file == prefix or (prefix.endswith("/") and file.startswith(prefix))) and (
                best is None or len(prefix) > best[0]
            ):
                best = (len(prefix), index)
    return None if best is None else best[1]


def _module_file(module: str) -> str | None:
    base = module.replace(".", "/")
    for candidate in (f"{base}.py", f"{base}/__init__.py"):
        if (ROOT / candidate).is_file():
            return candidate
    return None


def imports(file: str) -> list[tuple[str, bool]]:
    """(imported module, at module level) for every absolute import; `from X import Y` also yields X.Y."""
    tree = ast.parse((ROOT / file).read_text(encoding="utf-8"))
    found: list[tuple[str, bool]] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            nested = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                found.extend((alias.name, not in_function) for alias in child.names)
            elif isinstance(child, ast.ImportFrom) and child.level == 0 and child.module:
                found.append((child.module, not in_function))
                found.extend((f"{child.module}.{alias.name}", not in_function) for alias in child.names)
            visit(child, nested)

    visit(tree, False)
    return found


def test_the_layers_table_covers_every_module() -> None:
    rows = layer_rows(_doc())
    assert len(rows) >= 10 and all(prefixes for _, prefixes in rows), f"the layers table did not parse: {rows}"
    unplaced = [f for f in library_files() if _layer_of(f, rows) is None]
    assert not unplaced, f"modules in no row of docs/architecture.md's layers table: {unplaced}"


def test_no_layer_imports_a_later_one() -> None:
    rows = layer_rows(_doc())
    upward = []
    for file in library_files():
        own = _layer_of(file, rows)
        for module, _ in imports(file):
            target = _module_file(module) if module.split(".")[0] in LIBRARY_ROOTS else None
            if target is None:
                continue
            their = _layer_of(target, rows)
            if their is not None and own is not None and their > own:
                upward.append(f"{file} ({rows[own][0]}) imports {module} ({rows[their][0]})")
    assert not upward, "imports against the layer order of docs/architecture.md:\n" + "\n".join(upward)


def _files_under(prefix: str) -> list[str]:
    return [f for f in library_files() if f.startswith(prefix)]


def _in_hook(module: str) -> bool:
    """nemo_gym_tok.vllm or a module in it; not nemo_gym_tok.vllm_wheels or nemo_gym_tok.vllm_server beside it."""
    return module == "nemo_gym_tok.vllm" or module.startswith("nemo_gym_tok.vllm.")


@pytest.mark.parametrize(
    ("prefix", "forbidden", "rule"),
    [
        ("nemo_gym_tok/splice/", lambda m: m.split(".")[0] in SERVING_PACKAGES, "no vLLM, HTTP, FastAPI, transformers"),
        (
            "nemo_gym_tok/splice_host/",
            lambda m: m.split(".")[0] in SERVING_PACKAGES - {"transformers"} or _in_hook(m),
            "no vLLM, HTTP, FastAPI or torch, not nemo_gym_tok/vllm/: both hosts hand it their renderer",
        ),
        (
            "nemo_gym_tok/types/",
            lambda m: m.startswith("nemo_gym_tok.") and not m.startswith("nemo_gym_tok.types"),
            "nothing of this project",
        ),
        (
            "nemo_gym_tok/servers/",
            lambda m: m.startswith("nemo_gym_tok.splice") or _in_hook(m),
            "not the splice core, not nemo_gym_tok/vllm/",
        ),
        (
            "nemo_gym_tok/config/",
            lambda m: m.startswith("nemo_gym_tok.splice") or _in_hook(m),
            "not the splice core, not nemo_gym_tok/vllm/",
        ),
        (
            "nemo_gym_tok/vllm_wheels/",
            lambda m: m.split(".")[0] == "vllm",
            "not vllm: a wheel's source is read as text, never imported",
        ),
        (
            "nemo_gym_tok/router/",
            lambda m: m.split(".")[0] == "vllm" or m.startswith("nemo_gym_tok.splice") or _in_hook(m),
            "not vllm, not the splice core, not nemo_gym_tok/vllm/",
        ),
        (
            "nemo_gym_tok/vllm_server.py",
            lambda m: m.split(".")[0] == "vllm" or m.startswith("nemo_gym_tok.splice") or _in_hook(m),
            "not vllm, not the splice core, not nemo_gym_tok/vllm/: vLLM runs in the process it starts",
        ),
        (
            "resources_servers/",
            lambda m: (
                m.split(".")[0] in LIBRARY_ROOTS and not m.startswith(("nemo_gym_tok.servers", "resources_servers"))
            ),
            "of this project, only nemo_gym_tok/servers/",
        ),
        (
            "responses_api_agents/",
            lambda m: m.split(".")[0] in ("vllm", "resources_servers", "responses_api_models") or _in_hook(m),
            "not vllm, not nemo_gym_tok/vllm/, not the other server folders (reached over HTTP)",
        ),
    ],
)
def test_layer_rules(prefix: str, forbidden, rule: str) -> None:
    assert _files_under(prefix), prefix
    broken = [f"{file}: {module}" for file in _files_under(prefix) for module, _ in imports(file) if forbidden(module)]
    assert not broken, f"{prefix} ({rule}):\n" + "\n".join(broken)


def test_vllm_is_imported_only_by_the_vllm_package_and_inside_functions() -> None:
    vllm_imports = [
        (file, module, top)
        for file in library_files()
        for module, top in imports(file)
        if module.split(".")[0] == "vllm"
    ]
    assert any(file.startswith("nemo_gym_tok/vllm/") for file, _, _ in vllm_imports)  # the scan sees them at all
    outside = [f"{file}: {module}" for file, module, _ in vllm_imports if not file.startswith(VLLM_IMPORTERS)]
    assert not outside, "vllm imported outside nemo_gym_tok/vllm/:\n" + "\n".join(outside)
    at_import_time = [f"{file}: {module}" for file, module, top in vllm_imports if top]
    assert not at_import_time, "vllm imported at module level (importing the module would need vLLM):\n" + "\n".join(
        at_import_time
    )


def test_only_commands_reach_the_test_harnesses_and_only_when_run() -> None:
    """Serving, collecting and the splice never import nemo_gym_tok/testing/; a CLI command may, inside its function."""
    reaching = [
        (file, module, top)
        for file in library_files()
        if not file.startswith("nemo_gym_tok/testing/")
        for module, top in imports(file)
        if module.startswith("nemo_gym_tok.testing")
    ]
    assert any(file.startswith("nemo_gym_tok/cli/") for file, _, _ in reaching)  # the scan sees them at all
    outside = [f"{file}: {module}" for file, module, _ in reaching if not file.startswith("nemo_gym_tok/cli/")]
    assert not outside, "test harnesses imported outside nemo_gym_tok/cli/:\n" + "\n".join(outside)
    at_import_time = [f"{file}: {module}" for file, module, top in reaching if top]
    assert not at_import_time, "test harnesses imported at module level:\n" + "\n".join(at_import_time)


def _python_files() -> list[str]:
    """Every .py file git knows of or would add (library, tests, bench, conftest), as paths from the repo root."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "--", "*.py"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    return sorted(f for f in listed if (ROOT / f).is_file())


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


SCRIPT_FOLDERS = ("bench",)
"""Folders of scripts that put themselves on sys.path: their modules are imported as top-level names."""


def _resolve(module: str, folder: str) -> str | None:
    """The repo file of `module` (its __init__.py for a package): from the root, beside the importing file, else in a
    script folder (a test importing bench's modules as bench's scripts do)."""
    base = module.replace(".", "/")
    for prefix in ("", f"{folder}/" if folder else "", *(f"{script}/" for script in SCRIPT_FOLDERS)):
        for candidate in (f"{prefix}{base}.py", f"{prefix}{base}/__init__.py"):
            if (ROOT / candidate).is_file():
                return candidate
    return None


def _home(file: str) -> str:
    """The folder a repo file sits in ("" at the root)."""
    return Path(file).parent.as_posix().removeprefix(".")


def _private_owner(parts: list[str], index: int, folder: str) -> str | None:
    """The folder whose code may use `parts[index]`, a private module or name; None when it is not this project's."""
    module = _resolve(".".join(parts[: index + 1]), folder)
    if module is not None:  # a private module (or package): it belongs to the folder it sits in
        return _home(module.removesuffix("/__init__.py") if module.endswith("/__init__.py") else module)
    holder = _resolve(".".join(parts[:index]), folder) if index else None
    if holder is None:
        return None
    return _home(holder) if not holder.endswith("/__init__.py") else holder.removesuffix("/__init__.py")


def _docstrings(tree: ast.AST) -> set[int]:
    nodes = [tree, *(n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)))]
    return {
        id(node.body[0].value)
        for node in nodes
        if node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)
    }


def private_imports(file: str, source: str | None = None) -> list[str]:
    """This project's private modules that `file` imports from a folder other than its own, and private names it
    imports from another module.

    A private module (`x._y`) belongs to the folder it sits in; a private name (`from x import _y`) to the module that
    holds it. A dotted string naming one (a monkeypatch target) and a private module reached as an
    attribute of an imported package (`splice._splice`) count as imports of it.
    """
    folder = _home(file)
    tree = ast.parse(source if source is not None else (ROOT / file).read_text(encoding="utf-8"))
    docstrings = _docstrings(tree)
    found: list[str] = []

    def check(dotted: str, line: int, *, modules_only: bool = False) -> None:
        parts = dotted.split(".")
        for index in (i for i, part in enumerate(parts) if _is_private(part)):
            private = ".".join(parts[: index + 1])
            module = _resolve(private, folder)
            if module is None and (modules_only or _private_owner(parts, index, folder) is None):
                return  # not this project's, or an attribute of a name (checked where it is defined)
            if module is None:  # a private name: its own module's alone
                holder = _resolve(".".join(parts[:index]), folder)
                hit = None if holder == file else f"{file}:{line}: {private} (private to {holder})"
            else:
                owner = _private_owner(parts, index, folder)
                hit = None if owner == folder else f"{file}:{line}: {private} (private to {owner or 'the root'}/)"
            if hit is not None and hit not in found:
                found.append(hit)
            if hit is not None or module is None:
                return

    bound: dict[str, str] = {}  # a name an import binds -> what it names, for `package._module` reached through it
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                check(alias.name, node.lineno)
                bound[alias.asname or alias.name.split(".")[0]] = (
                    alias.name if alias.asname else alias.name.split(".")[0]
                )
        elif isinstance(node, ast.ImportFrom):
            package = Path(file).parent.parts
            base = package[: len(package) - node.level + 1] if node.level else ()
            module = ".".join([*base, *(node.module.split(".") if node.module else [])])
            for alias in node.names:
                check(f"{module}.{alias.name}", node.lineno)
                bound[alias.asname or alias.name] = f"{module}.{alias.name}"
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _is_private(node.attr):
            chain, value = [node.attr], node.value
            while isinstance(value, ast.Attribute):
                chain, value = [value.attr, *chain], value.value
            if isinstance(value, ast.Name) and value.id in bound:  # a private module reached as an attribute
                check(".".join([bound[value.id], *chain]), node.lineno, modules_only=True)
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            for dotted in re.findall(
                r"\b(?:nemo_gym_tok|responses_api_models|resources_servers|responses_api_agents)(?:\.\w+)+", node.value
            ):
                check(dotted, node.lineno)
    return found


def test_no_private_import_across_packages() -> None:
    files = _python_files()
    assert "tests/test_architecture_doc.py" in files and any(f.startswith("bench/") for f in files), files[:5]
    crossing = [hit for file in files for hit in private_imports(file)]
    assert not crossing, "private modules or names used outside their own folder:\n" + "\n".join(crossing)


@pytest.mark.parametrize(
    ("file", "source", "flagged"),
    [
        ("tests/planted.py", "from PKG.splice._splice import splice_prompt", True),
        ("tests/planted.py", "from PKG.splice import _splice", True),
        ("tests/planted.py", "import PKG.splice._render as render", True),
        ("tests/planted.py", "from PKG.vllm.hook import _splice", True),
        ("tests/planted.py", "monkeypatch.setattr('PKG.splice._splice.splice_prompt', None)", True),
        ("tests/gpt_oss/planted.py", "from tests.splice_plants import _plant", True),
        ("nemo_gym_tok/vllm/planted.py", "from PKG.splice._profile import TERMINATOR_ENV", True),
        ("nemo_gym_tok/splice/planted.py", "from PKG.splice._splice import splice_prompt", False),
        ("nemo_gym_tok/splice/planted.py", "from ._render import ChatRenderer", False),
        ("nemo_gym_tok/vllm/planted.py", "from ..splice._render import ChatRenderer", True),
        ("bench/planted.py", "from benchkit.server import MODEL", False),
        ("nemo_gym_tok/splice/planted.py", "from PKG.splice._splice import _private_helper", True),
        ("nemo_gym_tok/servers/planted.py", "from PKG.servers.http_pool import _pooled", True),
        ("tests/planted.py", "from PKG import splice\nsplice._splice.splice_prompt = None", True),
        ("tests/planted.py", "import PKG.testing.tiny_model as tm\ntm._cache.file_sha256", True),
        ("tests/planted.py", "from PKG.splice import SplicedPrompt\nSplicedPrompt._verify", False),
        ("tests/planted.py", "from PKG.splice import splice_prompt", False),
        ("tests/planted.py", "from _pytest.monkeypatch import MonkeyPatch", False),
    ],
)
def test_the_private_import_scan_sees_a_planted_one(file: str, source: str, flagged: bool) -> None:
    # PKG stands for the package so that the scan of this very file does not read the plants as its imports.
    found = private_imports(file, source.replace("PKG", "nemo_gym_tok"))
    assert bool(found) is flagged, found


def test_a_test_importing_a_private_module_of_a_script_folder_is_seen(tmp_path: Path) -> None:
    # bench/ puts itself on sys.path; a test doing the same reaches its modules as top-level names.
    probe = ROOT / "bench" / f"_probe_{tmp_path.name}.py"
    probe.write_text("VALUE = 1\n", encoding="utf-8")
    try:
        assert private_imports("tests/planted.py", f"from {probe.stem} import VALUE")
        assert not private_imports("bench/planted.py", f"from {probe.stem} import VALUE")
    finally:
        probe.unlink()
