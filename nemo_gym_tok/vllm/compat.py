"""The hook against stock vLLM wheels: reads each release's source from its wheel with `ast` (no install, no import).

`ngt vllm-compat` (`make vllm-compat`) downloads the `vllm` wheel of every supported release once (`pip download
--no-deps`, cached), and checks, from the source in the zip, what `nemo_gym_tok.vllm.hook` needs: every wrapped
method (PATCHED_METHODS, inherited ones too), the parameters the splice reads (PREPROCESS_CHAT_PARAMETERS,
HARMONY_PARAMETERS), every USED_SYMBOLS name, vLLM's token-in path (`_reused_prompt_token_ids` reading
`kv_transfer_params['prompt_token_ids']` in preprocess_chat), and how preprocess_chat uses its request parser: since
0.33 it hands the parser the prompt ids (`set_prompt_token_ids`), which the hook holds back until the splice is
applied, so the parser may only be asked what the hook's stand-in holds back (PARSER_METHODS_HELD).
It is the static twin of `hook.check_internals()`, which checks the vLLM that is installed.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import zipfile
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from nemo_gym_tok.tiny_model._cache import cache_root
from nemo_gym_tok.vllm.hook import (
    HARMONY_PARAMETERS,
    PARSER_METHODS_HELD,
    PATCHED_METHODS,
    PREPROCESS_CHAT_PARAMETERS,
    PREPROCESS_CHAT_PARSER_PARAMETER,
    SUPPORTED_VLLM,
    USED_SYMBOLS,
    is_supported_vllm,
)

# vLLM's token-in path: the function preprocess_chat calls to take forwarded prompt ids instead of rendering.
TOKEN_IN_FUNCTION = "_reused_prompt_token_ids"
TOKEN_IN_FIELDS = ("kv_transfer_params", "prompt_token_ids")
PARSER_PROMPT_METHOD = PARSER_METHODS_HELD[0]
# How deep to follow base classes and re-exports; vLLM's chains are two or three long.
_MAX_HOPS = 8

_Function = ast.FunctionDef | ast.AsyncFunctionDef


def supported_releases() -> list[str]:
    """The first release of every minor version in SUPPORTED_VLLM: 0.30.0, 0.31.0, 0.32.0, 0.33.0."""
    (low_major, low_minor), (high_major, high_minor) = SUPPORTED_VLLM
    if low_major != high_major:
        raise ValueError(f"SUPPORTED_VLLM spans major versions ({SUPPORTED_VLLM}); name the releases to check")
    return [f"{low_major}.{minor}.0" for minor in range(low_minor, high_minor)]


def wheel_cache_dir() -> Path:
    """Where downloaded wheels are kept: `vllm-wheels` in the nemo_gym_tok cache ($NGT_CACHE_DIR or ~/.cache/...)."""
    return cache_root() / "vllm-wheels"


class ModuleSources:
    """Python source of vLLM's modules by dotted name, parsed once each; read from a wheel's zip or a dict (tests)."""

    def __init__(self, read: Callable[[str], str | None]) -> None:
        self._read = read
        self._trees: dict[str, tuple[ast.Module, bool] | None] = {}

    @classmethod
    def from_files(cls, files: Mapping[str, str]) -> ModuleSources:
        """From {path in the wheel: source}, e.g. {"vllm/exceptions.py": "class VLLMValidationError: ..."}."""
        return cls(files.get)

    @classmethod
    def from_zip(cls, archive: zipfile.ZipFile) -> ModuleSources:
        """From an open wheel; only the modules the check looks at are read."""
        names = set(archive.namelist())

        def read(path: str) -> str | None:
            return archive.read(path).decode("utf-8") if path in names else None

        return cls(read)

    def module(self, name: str) -> tuple[ast.Module, bool] | None:
        """The parsed module and whether it is a package (its `__init__.py`), or None when the wheel lacks it."""
        if name not in self._trees:
            base = name.replace(".", "/")
            parsed = None
            for path, is_package in ((f"{base}.py", False), (f"{base}/__init__.py", True)):
                text = self._read(path)
                if text is not None:
                    parsed = (ast.parse(text, filename=path), is_package)
                    break
            self._trees[name] = parsed
        return self._trees[name]


def _runtime_statements(body: Iterable[ast.stmt]) -> Iterator[ast.stmt]:
    """A module's top-level statements that run at import, with `if`/`try` blocks opened; `if TYPE_CHECKING:` bodies
    are left out, since names bound only there do not exist at run time."""
    for statement in body:
        if isinstance(statement, ast.If):
            test = statement.test
            if (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
                isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
            ):
                yield from _runtime_statements(statement.orelse)
                continue
            yield from _runtime_statements(statement.body)
            yield from _runtime_statements(statement.orelse)
        elif isinstance(statement, ast.Try):
            for block in (statement.body, *(handler.body for handler in statement.handlers), statement.orelse,
                          statement.finalbody):
                yield from _runtime_statements(block)
        else:
            yield statement


def _absolute(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The module an `ImportFrom` names, relative imports resolved against `module`."""
    if not node.level:
        return node.module or ""
    parts = module.split(".")
    package = parts if is_package else parts[:-1]
    package = package[: len(package) - (node.level - 1)]
    return ".".join([*package, node.module] if node.module else package)


@dataclass(frozen=True)
class _Found:
    """Where a module-level name is bound: the module and the statement (a def, an assignment, an import)."""

    module: str
    node: ast.stmt


class _Reader:
    """Name and class lookups across one release's modules, following re-exports and base classes."""

    def __init__(self, sources: ModuleSources) -> None:
        self.sources = sources

    def top_level(self, module: str, name: str, hops: int = 0) -> _Found | None:
        """The statement that binds `name` in `module`, following `from x import name` into vLLM's own modules."""
        parsed = self.sources.module(module)
        if parsed is None or hops > _MAX_HOPS:
            return None
        tree, is_package = parsed
        found: _Found | None = None
        for statement in _runtime_statements(tree.body):  # the last binding wins, as at import
            if isinstance(statement, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and statement.name == name:
                found = _Found(module, statement)
            elif isinstance(statement, ast.Assign) and any(
                isinstance(target, ast.Name) and target.id == name for target in statement.targets
            ):
                found = _Found(module, statement)
            elif (isinstance(statement, ast.AnnAssign) and statement.value is not None
                  and isinstance(statement.target, ast.Name) and statement.target.id == name):
                found = _Found(module, statement)
            elif isinstance(statement, (ast.Import, ast.ImportFrom)) and any(
                (alias.asname or alias.name.split(".")[0]) == name for alias in statement.names
            ):
                found = _Found(module, statement)
        if found is not None and isinstance(found.node, ast.ImportFrom):
            source = _absolute(module, is_package, found.node)
            original = next(alias.name for alias in found.node.names if (alias.asname or alias.name) == name)
            if source.split(".")[0] == "vllm":
                # Bound by the import even when the wheel cannot show the definition (a compiled module).
                return self.top_level(source, original, hops + 1) or found
        return found

    def class_def(self, module: str, name: str, hops: int = 0) -> tuple[str, ast.ClassDef] | None:
        found = self.top_level(module, name, hops)
        if found is not None and isinstance(found.node, ast.ClassDef):
            return found.module, found.node
        return None

    def method(self, module: str, class_name: str, method: str, hops: int = 0) -> ast.stmt | None:
        """The def (or class-level assignment) of `method` on the class or the first base class that has it."""
        located = self.class_def(module, class_name, hops)
        if located is None or hops > _MAX_HOPS:
            return None
        owner_module, node = located
        for statement in node.body:
            if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef)) and statement.name == method:
                return statement
            if isinstance(statement, ast.Assign) and any(
                isinstance(target, ast.Name) and target.id == method for target in statement.targets
            ):
                return statement
        for base in node.bases:  # in MRO order for single inheritance, which is what vLLM uses here
            if isinstance(base, ast.Subscript):  # Generic[...] and friends: the class is the subscripted name
                base = base.value
            base_name = base.id if isinstance(base, ast.Name) else None
            if base_name is not None:
                inherited = self.method(owner_module, base_name, method, hops + 1)
                if inherited is not None:
                    return inherited
        return None


def parameter_names(function: _Function) -> list[str]:
    """Every parameter a caller can pass by name (positional-only ones too, as inspect.signature lists them)."""
    arguments = function.args
    return [argument.arg for argument in (*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs)]


@dataclass(frozen=True)
class ParserUse:
    """How preprocess_chat uses the request-parser class it is given."""

    has_parameter: bool
    sets_prompt_ids: bool
    """It calls `set_prompt_token_ids` on a parser it built (vLLM 0.33+)."""
    methods: tuple[str, ...]
    """Methods called on the parsers it builds."""
    escapes: bool
    """The parser class, or a parser built from it, is used otherwise than the hook's stand-in allows: the class
    otherwise than by reading an attribute, calling it or testing it against None; a built parser otherwise than by
    calling its methods (stored on an object, passed on, returned)."""


def parser_use(function: _Function) -> ParserUse:
    """Read from preprocess_chat's body what it asks of its `parser` parameter and of the parsers it builds."""
    parameter = PREPROCESS_CHAT_PARSER_PARAMETER
    if parameter not in parameter_names(function):
        return ParserUse(False, False, (), False)
    parents = {id(child): node for node in ast.walk(function) for child in ast.iter_child_nodes(node)}

    def is_parameter(node: ast.AST) -> bool:
        return isinstance(node, ast.Name) and node.id == parameter and isinstance(node.ctx, ast.Load)

    def builds_parser(node: ast.AST) -> bool:
        return isinstance(node, ast.Call) and is_parameter(node.func)

    instances = {
        target.id
        for node in ast.walk(function) if isinstance(node, ast.Assign) and builds_parser(node.value)
        for target in node.targets if isinstance(target, ast.Name)
    }
    methods: set[str] = set()
    escapes = False
    for node in ast.walk(function):
        parent = parents.get(id(node))
        if is_parameter(node):
            # The stand-in class answers attribute reads, calls and `is None` tests; anything else (issubclass,
            # passing it on) would see the stand-in instead of vLLM's class.
            escapes |= not (
                (isinstance(parent, ast.Attribute) and parent.value is node)
                or (isinstance(parent, ast.Call) and parent.func is node)
                or (isinstance(parent, ast.Compare) and all(isinstance(op, (ast.Is, ast.IsNot)) for op in parent.ops))
            )
        elif builds_parser(node) or (isinstance(node, ast.Name) and node.id in instances
                                     and isinstance(node.ctx, ast.Load)):
            grandparent = parents.get(id(parent)) if parent is not None else None
            if (isinstance(parent, ast.Attribute) and parent.value is node and isinstance(grandparent, ast.Call)
                    and grandparent.func is parent):
                methods.add(parent.attr)
            elif not (builds_parser(node) and isinstance(parent, ast.Assign)
                      and all(isinstance(target, ast.Name) for target in parent.targets)):
                escapes = True  # a built parser stored elsewhere, passed on, returned, or read without a call
    return ParserUse(True, PARSER_PROMPT_METHOD in methods, tuple(sorted(methods)), escapes)


def _mentions(node: ast.AST, text: str) -> bool:
    """Whether `text` appears in the code as a string constant or an attribute name."""
    return any(
        (isinstance(child, ast.Constant) and child.value == text) or (isinstance(child, ast.Attribute)
                                                                       and child.attr == text)
        for child in ast.walk(node)
    )


def _calls(function: ast.AST, name: str) -> bool:
    return any(
        isinstance(node, ast.Call) and (
            (isinstance(node.func, ast.Name) and node.func.id == name)
            or (isinstance(node.func, ast.Attribute) and node.func.attr == name)
        )
        for node in ast.walk(function)
    )


@dataclass
class ReleaseReport:
    """What one vLLM release's source offers the hook; `problems` is empty when the hook fits it."""

    version: str
    wheel: str = ""
    patched_found: int = 0
    symbols_found: int = 0
    signatures_ok: bool = True
    token_in: bool = False
    parser: ParserUse | None = None
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def in_supported_range(self) -> bool:
        return is_supported_vllm(self.version)


def check_release(sources: ModuleSources, version: str = "", wheel: str = "") -> ReleaseReport:
    """Check one release's source against what the hook wraps and uses (the same names `check_internals()` uses)."""
    reader = _Reader(sources)
    report = ReleaseReport(version=version, wheel=wheel)
    methods: dict[str, ast.stmt | None] = {}
    for module_name, class_name, method in PATCHED_METHODS:
        found = methods[method] = reader.method(module_name, class_name, method)
        if found is None:
            report.problems.append(f"missing {module_name}.{class_name}.{method}")
        else:
            report.patched_found += 1
    for method, expected in (("preprocess_chat", PREPROCESS_CHAT_PARAMETERS),
                             ("_make_request_with_harmony", HARMONY_PARAMETERS)):
        found = methods.get(method)
        if isinstance(found, (ast.FunctionDef, ast.AsyncFunctionDef)):
            present = parameter_names(found)
            for name in expected:
                if name not in present:
                    report.signatures_ok = False
                    report.problems.append(f"{method} has no parameter {name}=")
        elif found is not None:
            report.signatures_ok = False
            report.problems.append(f"{method} is not a def here; its parameters cannot be read")
    for module_name, symbol in USED_SYMBOLS:
        if reader.top_level(module_name, symbol) is None:
            report.problems.append(f"missing {module_name}.{symbol}")
        else:
            report.symbols_found += 1
    preprocess = methods.get("preprocess_chat")
    if isinstance(preprocess, (ast.FunctionDef, ast.AsyncFunctionDef)):
        renderer_module = next(module for module, _, method in PATCHED_METHODS if method == "preprocess_chat")
        report.token_in = _token_in_path(reader, renderer_module, preprocess)
        if not report.token_in:
            report.problems.append(
                f"preprocess_chat no longer takes kv_transfer_params['prompt_token_ids'] through {TOKEN_IN_FUNCTION}: "
                "re-check how the hook meets vLLM's token-in path"
            )
        report.parser = parser_use(preprocess)
        report.problems.extend(_parser_problems(report.parser))
    return report


def _token_in_path(reader: _Reader, module: str, preprocess: _Function) -> bool:
    """preprocess_chat calls TOKEN_IN_FUNCTION, and that function reads kv_transfer_params['prompt_token_ids']."""
    if not _calls(preprocess, TOKEN_IN_FUNCTION):
        return False
    found = reader.top_level(module, TOKEN_IN_FUNCTION)
    return found is not None and all(_mentions(found.node, text) for text in TOKEN_IN_FIELDS)


def _parser_problems(use: ParserUse) -> list[str]:
    """What would break the hook's stand-in parser (hook._DeferredParser), which holds back PARSER_METHODS_HELD."""
    if not use.has_parameter:
        # Without the parameter there is no parser to keep in step, unless the parser comes from elsewhere.
        return []
    problems = [
        f"preprocess_chat calls {method}() on its request parser; the hook's stand-in holds back only "
        f"{', '.join(PARSER_METHODS_HELD)}"
        for method in use.methods if method not in PARSER_METHODS_HELD
    ]
    if use.escapes:
        problems.append("preprocess_chat uses its request parser otherwise than reading the class, building parsers "
                        "and calling their methods; the hook's stand-in would leak out of it")
    return problems


def download_wheel(version: str, directory: Path) -> Path:
    """The stock `vllm` wheel of `version` in `directory`, downloaded by pip (no dependencies) unless already there."""
    cached = sorted(directory.glob(f"vllm-{version}-*.whl"))
    if cached:
        return cached[0]
    directory.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
               f"vllm=={version}", "--dest", str(directory)]
    completed = subprocess.run(command, capture_output=True, text=True)
    cached = sorted(directory.glob(f"vllm-{version}-*.whl"))
    if completed.returncode != 0 or not cached:
        # pip's warnings about this machine's index configuration would bury the reason.
        reason = "\n".join(line for line in completed.stderr.splitlines() if not line.startswith("WARNING:"))
        raise RuntimeError(f"pip could not download vllm=={version}: {reason.strip()[-2000:]}")
    return cached[0]


def check_wheel(wheel: Path, version: str) -> ReleaseReport:
    with zipfile.ZipFile(wheel) as archive:
        return check_release(ModuleSources.from_zip(archive), version=version, wheel=wheel.name)


def format_reports(reports: list[ReleaseReport]) -> str:
    """The per-release table, then every problem found, release by release."""
    total_patched, total_symbols = len(PATCHED_METHODS), len(USED_SYMBOLS)
    header = ("vLLM", "patched methods", "signatures", "used symbols", "token-in path", "parser prompt ids", "result")
    rows = [header]
    for report in reports:
        if report.parser is None or not report.parser.has_parameter:
            parser = "no parser parameter"
        elif report.parser.sets_prompt_ids:
            parser = "set in preprocess_chat (hook replays spliced ids)"
        else:
            parser = "not set in preprocess_chat"
        result = "ok" if report.ok else "INCOMPATIBLE"
        if not report.in_supported_range:
            result += " (outside SUPPORTED_VLLM)"
        rows.append((
            report.version, f"{report.patched_found}/{total_patched}", "ok" if report.signatures_ok else "changed",
            f"{report.symbols_found}/{total_symbols}", "yes" if report.token_in else "no", parser, result,
        ))
    widths = [max(len(row[column]) for row in rows) for column in range(len(header))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * width for width in widths))
    for report in reports:
        for problem in report.problems:
            lines.append(f"vLLM {report.version}: {problem}")
    return "\n".join(lines)
