"""Resolves `${...}` in config values: `${a.b}` references and the OmegaConf resolvers NeMo Gym configs use.

Supported: `${key.path}` (absolute), `${oc.env:VAR}` / `${oc.env:VAR,default}`, `${oc.select:key}` /
`${oc.select:key,default}`, `${oc.decode:text}`, nested forms (`${oc.select:a,${oc.env:B,x}}`) and `\\${` for a
literal `${`. Anything else (relative `${.key}`, other resolvers) is refused with a ConfigError saying what is read.
Results follow OmegaConf's: a value that is one interpolation keeps the referenced type, `oc.env` gives a string (or
None for a `null` default), resolver arguments are typed like YAML scalars (`null`, `false`, `8`, `1e-6`, text).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterator
from typing import Any

import yaml

from nemo_gym_tok.config.config_error import ConfigError

KeyPath = tuple[str, ...]

MISSING = "???"
"""OmegaConf's (and NeMo Gym's) mark of a value the user must set."""

SUPPORTED_RESOLVERS = ("oc.env", "oc.select", "oc.decode")
MAX_DEPTH = 20

_KEY = re.compile(r"^[A-Za-z_][\w\-]*(\.[A-Za-z_0-9][\w\-]*)*$")
_RESOLVER = re.compile(r"^([A-Za-z_][\w.]*):(.*)$", re.DOTALL)
_INT = re.compile(r"^[-+]?\d+$")
_FLOAT = re.compile(r"^[-+]?(\d+\.\d*|\.\d+|\d+)([eE][-+]?\d+)?$|^[-+]?(inf|nan)$", re.IGNORECASE)
_NO_DEFAULT = object()


class Interpolator:
    """Resolves every `${...}` of a merged config tree against that tree (`root`)."""

    def __init__(self, root: dict[str, Any], where: Callable[[KeyPath], str | None]) -> None:
        self.root = root
        self.where = where
        """The file that set a key path (for error messages)."""

    def resolve_tree(self, value: Any, path: KeyPath = (), depth: int = 0) -> Any:
        if isinstance(value, dict):
            return {k: self.resolve_tree(v, (*path, k), depth) for k, v in value.items()}
        if isinstance(value, list):
            return [self.resolve_tree(v, (*path, str(i)), depth) for i, v in enumerate(value)]
        if isinstance(value, str) and "${" in value:
            return self.resolve_text(value, path, depth)
        return value

    def error(self, path: KeyPath, detail: str) -> ConfigError:
        return ConfigError(self.where(path), ".".join(path), detail)

    def resolve_text(self, text: str, path: KeyPath, depth: int) -> Any:
        """A string holding `${...}`: the typed value when it is one interpolation, else the joined text."""
        if depth > MAX_DEPTH:
            raise self.error(path, "interpolation does not terminate (a cycle?)")
        parts = split_interpolations(text, lambda detail: self.error(path, f"{detail} in {text!r}"))
        if len(parts) == 1 and isinstance(parts[0], Expression):
            return self.evaluate(parts[0].body, path, depth)
        pieces = []
        for part in parts:
            if isinstance(part, str):
                pieces.append(part)
                continue
            found = self.evaluate(part.body, path, depth)
            if isinstance(found, (dict, list)):
                raise self.error(path, f"${{{part.body}}} is a mapping or list inside a string")
            pieces.append(str(found))
        return "".join(pieces)

    def evaluate(self, body: str, path: KeyPath, depth: int) -> Any:
        """The value of one `${body}`."""
        resolver = _RESOLVER.match(body)
        if resolver and not _KEY.match(body):
            name, raw_args = resolver.group(1), resolver.group(2)
            if name not in SUPPORTED_RESOLVERS:
                raise self.error(
                    path,
                    f"${{{name}:...}}: resolver not supported (ngt reads "
                    f"{', '.join(SUPPORTED_RESOLVERS)} and ${{key.path}} references)",
                )
            args = [self.argument(arg, path, depth) for arg in split_arguments(raw_args)]
            return getattr(self, "_" + name.replace(".", "_"))(args, body, path, depth)
        key = body.strip()
        if key.startswith("."):
            raise self.error(path, f"${{{key}}}: relative interpolation is not supported; write the absolute key")
        if not _KEY.match(key):
            raise self.error(path, f"${{{body}}} is not a key path nor a supported resolver call")
        found, value = self.lookup(key)
        if not found:
            raise self.error(path, f"${{{key}}} is not defined (set it in a config file or with --set {key}=...)")
        return self.resolve_tree(value, path, depth + 1)

    def lookup(self, key: str) -> tuple[bool, Any]:
        node: Any = self.root
        for part in key.split("."):
            if not isinstance(node, dict) or part not in node:
                return False, None
            node = node[part]
        return True, node

    def argument(self, raw: str, path: KeyPath, depth: int) -> Any:
        """One resolver argument, typed the way OmegaConf's grammar types it."""
        text = raw.strip()
        if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
            inner = text[1:-1].replace("\\" + text[0], text[0])
            return str(self.resolve_text(inner, path, depth + 1)) if "${" in inner else inner
        if "${" in text:
            return self.resolve_text(text, path, depth + 1)
        return scalar(text.replace("\\,", ","))

    def _oc_env(self, args: list[Any], body: str, path: KeyPath, depth: int) -> Any:
        if not 1 <= len(args) <= 2 or not isinstance(args[0], str):
            raise self.error(path, f"${{{body}}}: oc.env takes a variable name and an optional default")
        if args[0] in os.environ:
            return os.environ[args[0]]
        if len(args) == 1:
            raise self.error(
                path,
                f"environment variable {args[0]} is not set (${{{body}}}); set it, or give a "
                f"default: ${{oc.env:{args[0]},DEFAULT}}",
            )
        default = args[1]
        return None if default is None else str(default)

    def _oc_select(self, args: list[Any], body: str, path: KeyPath, depth: int) -> Any:
        if not 1 <= len(args) <= 2 or not isinstance(args[0], str):
            raise self.error(path, f"${{{body}}}: oc.select takes a key and an optional default")
        found, value = self.lookup(args[0])
        if not found or value == MISSING:
            return args[1] if len(args) == 2 else None
        return self.resolve_tree(value, path, depth + 1)

    def _oc_decode(self, args: list[Any], body: str, path: KeyPath, depth: int) -> Any:
        if len(args) != 1 or not (args[0] is None or isinstance(args[0], str)):
            raise self.error(path, f"${{{body}}}: oc.decode takes one string")
        text = args[0]
        if text is None or not text.strip():
            return text
        try:
            return yaml.safe_load(text)
        except yaml.YAMLError:
            raise self.error(path, f"${{{body}}}: cannot decode {text!r}") from None


class Expression:
    """One `${...}` found in a string; `body` is the text between the braces."""

    def __init__(self, body: str) -> None:
        self.body = body


def split_interpolations(text: str, fail: Callable[[str], ConfigError]) -> list[str | Expression]:
    """`text` cut into literal strings and `${...}` expressions (nesting and quotes respected, `\\${` literal)."""
    parts: list[str | Expression] = []
    literal: list[str] = []
    i = 0
    while i < len(text):
        if text.startswith("\\${", i):
            literal.append("${")
            i += 3
        elif text.startswith("${", i):
            end = _closing_brace(text, i + 2)
            if end < 0:
                raise fail("unclosed ${")
            if literal:
                parts.append("".join(literal))
                literal = []
            parts.append(Expression(text[i + 2 : end]))
            i = end + 1
        else:
            literal.append(text[i])
            i += 1
    if literal:
        parts.append("".join(literal))
    return parts


def _top_level(text: str, start: int = 0) -> Iterator[tuple[int, str]]:
    """The characters of `text` from `start` that stand outside quotes, escapes (`\\x`) and nested `${...}`, with
    their positions: where an expression closes and where its arguments split."""
    depth, quote, i = 0, "", start
    while i < len(text):
        char = text[i]
        if char == "\\":
            i += 2
            continue
        if quote:
            quote = "" if char == quote else quote
        elif char in "'\"":
            quote = char
        elif text.startswith("${", i):
            depth += 1
            i += 1
        elif char == "}" and depth:
            depth -= 1
        elif not depth:
            yield i, char
        i += 1


def _closing_brace(text: str, start: int) -> int:
    return next((i for i, char in _top_level(text, start) if char == "}"), -1)


def split_arguments(raw: str) -> list[str]:
    """Resolver arguments: split on the commas outside quotes and nested `${...}` (`\\,` stays in its argument)."""
    cuts = [i for i, char in _top_level(raw) if char == ","]
    return [raw[a + 1 : b] for a, b in zip([-1, *cuts], [*cuts, len(raw)])]


def scalar(text: str) -> Any:
    """An unquoted resolver argument as OmegaConf types it: null, bool, int, float, else the text."""
    lowered = text.lower()
    if lowered in ("null", "~"):
        return None
    if lowered in ("true", "false"):
        return lowered == "true"
    if _INT.match(text):
        return int(text)
    if _FLOAT.match(text):
        return float(text)
    return text


def missing_paths(value: Any, path: KeyPath = ()) -> list[KeyPath]:
    """Every key whose value is still `???` (NeMo Gym's unset mark), in order."""
    if isinstance(value, dict):
        return [p for k, v in value.items() for p in missing_paths(v, (*path, str(k)))]
    if isinstance(value, list):
        return [p for i, v in enumerate(value) for p in missing_paths(v, (*path, str(i)))]
    return [path] if value == MISSING else []
