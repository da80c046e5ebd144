"""A vLLM release's modules read as source with `ast`: where a name, a class or a method is defined, following
re-exports and base classes (no install, no import)."""

from __future__ import annotations

import ast
import zipfile
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass

# How deep to follow base classes and re-exports; vLLM's chains are two or three long.
MAX_HOPS = 8

FunctionNode = ast.FunctionDef | ast.AsyncFunctionDef
"""A parsed `def` or `async def`: what the checks read parameters and calls from."""


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
            for block in (
                statement.body,
                *(handler.body for handler in statement.handlers),
                statement.orelse,
                statement.finalbody,
            ):
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
class Binding:
    """Where a module-level name is bound: the module and the statement (a def, an assignment, an import)."""

    module: str
    node: ast.stmt


class SourceReader:
    """Name and class lookups across one release's modules, following re-exports and base classes."""

    def __init__(self, sources: ModuleSources) -> None:
        self.sources = sources

    def top_level(self, module: str, name: str, hops: int = 0) -> Binding | None:
        """The statement that binds `name` in `module`, following `from x import name` into vLLM's own modules."""
        parsed = self.sources.module(module)
        if parsed is None or hops > MAX_HOPS:
            return None
        tree, is_package = parsed
        found: Binding | None = None
        for statement in _runtime_statements(tree.body):  # the last binding wins, as at import
            if isinstance(statement, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and statement.name == name:
                found = Binding(module, statement)
            elif isinstance(statement, ast.Assign) and any(
                isinstance(target, ast.Name) and target.id == name for target in statement.targets
            ):
                found = Binding(module, statement)
            elif (
                isinstance(statement, ast.AnnAssign)
                and statement.value is not None
                and isinstance(statement.target, ast.Name)
                and statement.target.id == name
            ):
                found = Binding(module, statement)
            elif isinstance(statement, (ast.Import, ast.ImportFrom)) and any(
                (alias.asname or alias.name.split(".")[0]) == name for alias in statement.names
            ):
                found = Binding(module, statement)
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
        if located is None or hops > MAX_HOPS:
            return None
        owner_module, node = located
        own: ast.stmt | None = None
        for statement in node.body:  # the last binding wins, as when the class body runs (after any @overload stubs)
            if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef)) and statement.name == method:
                own = statement
            elif isinstance(statement, ast.Assign) and any(
                isinstance(target, ast.Name) and target.id == method for target in statement.targets
            ):
                own = statement
        if own is not None:
            return own
        for base in node.bases:  # in MRO order for single inheritance, which is what vLLM uses here
            if isinstance(base, ast.Subscript):  # Generic[...] and friends: the class is the subscripted name
                base = base.value
            base_name = base.id if isinstance(base, ast.Name) else None
            if base_name is not None:
                inherited = self.method(owner_module, base_name, method, hops + 1)
                if inherited is not None:
                    return inherited
        return None


def parameter_names(function: FunctionNode) -> list[str]:
    """Every parameter a caller can pass by name (positional-only ones too, as inspect.signature lists them)."""
    arguments = function.args
    return [argument.arg for argument in (*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs)]


def is_call_of(node: ast.AST, name: str) -> bool:
    """A call of `name(...)` or `<anything>.name(...)`."""
    return isinstance(node, ast.Call) and (
        (isinstance(node.func, ast.Name) and node.func.id == name)
        or (isinstance(node.func, ast.Attribute) and node.func.attr == name)
    )


def calls(code: ast.AST, name: str) -> bool:
    """Whether `code` calls `name(...)` or `<anything>.name(...)` anywhere inside it."""
    return any(is_call_of(node, name) for node in ast.walk(code))


def mentions(code: ast.AST, text: str) -> bool:
    """Whether `text` appears in `code` as a string constant or an attribute name."""
    return any(
        (isinstance(child, ast.Constant) and child.value == text)
        or (isinstance(child, ast.Attribute) and child.attr == text)
        for child in ast.walk(code)
    )
