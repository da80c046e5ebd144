"""Loads gym configs: merges YAML files in order, applies `--set` overrides, interpolates `${name}`."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from nemo_gym_tok.config.errors import ConfigError

SERVER_KINDS = ("responses_api_models", "resources_servers", "responses_api_agents")

KeyPath = tuple[str, ...]

_WHOLE_REFERENCE = re.compile(r"^\$\{([A-Za-z_][\w.\-]*)\}$")
_REFERENCE = re.compile(r"\$\{([A-Za-z_][\w.\-]*)\}")
_OVERRIDE_SOURCE = "--set"


@dataclass(frozen=True)
class ServerInstance:
    """One server of the merged config: `<name>: {<kind>: {<implementation>: {...fields}}}`."""

    name: str
    kind: str
    implementation: str
    fields: dict[str, Any]
    sources: dict[KeyPath, str]

    def validate(self, config_class: type[BaseModel]) -> BaseModel:
        """Validate `fields` into the implementation's config, naming file and key on failure."""
        try:
            return config_class.model_validate(self.fields)
        except ValidationError as exc:
            error = exc.errors()[0]
            local = tuple(str(part) for part in error["loc"])
            key = (self.name, self.kind, self.implementation, *local)
            detail = error["msg"]
            if error["type"] != "missing" and "input" in error:
                detail += f" (got {error['input']!r})"
            raise ConfigError(_source_of(self.sources, key), ".".join(key), detail) from None


@dataclass
class GymConfig:
    """The merged config: top-level plain values and the server instances."""

    values: dict[str, Any]
    instances: dict[str, ServerInstance]
    sources: dict[KeyPath, str] = field(default_factory=dict)

    def instance(self, name: str) -> ServerInstance:
        try:
            return self.instances[name]
        except KeyError:
            known = ", ".join(sorted(self.instances)) or "none"
            raise ConfigError(None, name, f"no server instance of that name (known: {known})") from None


def load_config(paths: list[str | Path], overrides: list[str] | tuple[str, ...] = ()) -> GymConfig:
    """Merge `paths` in order (later wins), apply `a.b.c=value` overrides, interpolate, split instances."""
    merged: dict[str, Any] = {}
    sources: dict[KeyPath, str] = {}
    for path in paths:
        _merge_into(merged, _read_yaml(Path(path)), str(path), sources, ())
    for override in overrides:
        key, value = _parse_override(override)
        _merge_into(merged, _nest(key, value), _OVERRIDE_SOURCE, sources, ())
    resolved = _interpolate(merged, merged, sources, ())
    return _split_instances(resolved, sources)


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(str(path), None, f"cannot read file: {exc.strerror}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(str(path), None, f"malformed YAML: {where}{problem}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(str(path), None, f"top level must be a mapping, got {type(data).__name__}")
    return data


def _merge_into(
    target: dict[str, Any], update: dict[str, Any], source: str, sources: dict[KeyPath, str], prefix: KeyPath
) -> None:
    for raw_key, value in update.items():
        key = str(raw_key)
        path = (*prefix, key)
        if isinstance(value, dict) and isinstance(target.get(key), dict):
            _merge_into(target[key], value, source, sources, path)
            continue
        # A replaced subtree takes the new source for every key below it.
        for stale in [p for p in sources if p[: len(path)] == path]:
            del sources[stale]
        target[key] = _copy_tree(value)
        _record_sources(value, source, sources, path)


def _record_sources(value: Any, source: str, sources: dict[KeyPath, str], path: KeyPath) -> None:
    sources[path] = source
    if isinstance(value, dict):
        for key, child in value.items():
            _record_sources(child, source, sources, (*path, str(key)))


def _copy_tree(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _copy_tree(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_copy_tree(v) for v in value]
    return value


def _parse_override(override: str) -> tuple[KeyPath, Any]:
    key, sep, raw_value = override.partition("=")
    parts = tuple(key.strip().split("."))
    if not sep or not all(parts):
        raise ConfigError(_OVERRIDE_SOURCE, override, "expected KEY.PATH=VALUE, e.g. my_env.resources_servers.x.port=8001")
    try:
        value = yaml.safe_load(raw_value) if raw_value.strip() else ""
    except yaml.YAMLError:
        value = raw_value
    return parts, value


def _nest(key: KeyPath, value: Any) -> dict[str, Any]:
    for part in reversed(key):
        value = {part: value}
    return value


def _interpolate(value: Any, root: dict[str, Any], sources: dict[KeyPath, str], path: KeyPath, depth: int = 0) -> Any:
    if depth > 20:
        raise ConfigError(_source_of(sources, path), ".".join(path), "interpolation does not terminate (a cycle?)")
    if isinstance(value, dict):
        return {k: _interpolate(v, root, sources, (*path, k), depth) for k, v in value.items()}
    if isinstance(value, list):
        return [_interpolate(v, root, sources, (*path, str(i)), depth) for i, v in enumerate(value)]
    if not isinstance(value, str) or "${" not in value:
        return value
    whole = _WHOLE_REFERENCE.match(value)
    if whole:
        # A value that is only a reference keeps the referenced value's type (int, list, ...).
        found = _lookup(whole.group(1), root, sources, path)
        return _interpolate(found, root, sources, path, depth + 1)

    def substitute(match: re.Match[str]) -> str:
        found = _interpolate(_lookup(match.group(1), root, sources, path), root, sources, path, depth + 1)
        if isinstance(found, (dict, list)):
            raise ConfigError(
                _source_of(sources, path), ".".join(path), f"${{{match.group(1)}}} is a mapping or list inside a string"
            )
        return str(found)

    return _REFERENCE.sub(substitute, value)


def _lookup(name: str, root: dict[str, Any], sources: dict[KeyPath, str], path: KeyPath) -> Any:
    node: Any = root
    for part in name.split("."):
        if not isinstance(node, dict) or part not in node:
            raise ConfigError(
                _source_of(sources, path), ".".join(path), f"${{{name}}} is not defined (set it in a config file or with --set {name}=...)"
            )
        node = node[part]
    return node


def _split_instances(merged: dict[str, Any], sources: dict[KeyPath, str]) -> GymConfig:
    values: dict[str, Any] = {}
    instances: dict[str, ServerInstance] = {}
    for name, body in merged.items():
        kinds = [k for k in body if k in SERVER_KINDS] if isinstance(body, dict) else []
        if not kinds:
            values[name] = body
            continue
        source = _source_of(sources, (name,))
        if len(body) != 1:
            raise ConfigError(source, name, f"a server instance holds exactly one server kind, found keys {sorted(body)}")
        kind = kinds[0]
        implementations = body[kind]
        if not isinstance(implementations, dict) or len(implementations) != 1:
            raise ConfigError(source, f"{name}.{kind}", "expected exactly one implementation: {<folder name>: {...fields}}")
        implementation, fields = next(iter(implementations.items()))
        fields = {} if fields is None else fields
        if not isinstance(fields, dict):
            raise ConfigError(source, f"{name}.{kind}.{implementation}", "the implementation's fields must be a mapping")
        instances[name] = ServerInstance(name, kind, implementation, fields, sources)
    return GymConfig(values=values, instances=instances, sources=sources)


def _source_of(sources: dict[KeyPath, str], path: KeyPath) -> str | None:
    # The nearest recorded ancestor names the file that set this key.
    for end in range(len(path), 0, -1):
        if path[:end] in sources:
            return sources[path[:end]]
    return None
