"""Loads gym configs: merges YAML files in order, applies `--set` overrides, interpolates `${...}`, splits servers.

The shape is NeMo Gym's (`instance -> kind -> implementation`), and NeMo Gym's own configs load too: its server keys
(`entrypoint`, `domain`...), `{type, name}` server references, `config_paths`, `_inherit_from` and the OmegaConf
resolvers its configs use (nemo_gym.py, interpolation.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from nemo_gym_tok.config import nemo_gym
from nemo_gym_tok.config.config_error import ConfigError
from nemo_gym_tok.config.interpolation import MISSING, Interpolator, missing_paths

SERVER_KINDS = ("responses_api_models", "resources_servers", "responses_api_agents")
"""The kinds this project implements."""
ALL_KINDS = (*SERVER_KINDS, nemo_gym.ENVIRONMENT_SERVERS)
"""Every kind a config may hold: NeMo Gym's `environment_servers` too, which only NeMo Gym implements."""

KeyPath = tuple[str, ...]

_OVERRIDE_SOURCE = "--set"


@dataclass(frozen=True)
class ServerInstance:
    """One server of the merged config: `<name>: {<kind>: {<implementation>: {...fields}}}`."""

    name: str
    kind: str
    implementation: str
    fields: dict[str, Any]
    """What the implementation's config class validates: `{type, name}` references are the instance's name here,
    and NeMo Gym's server keys are left out (they are in `nemo_gym`)."""
    sources: dict[KeyPath, str]
    nemo_gym: dict[str, Any] = field(default_factory=dict)
    """NeMo Gym's server keys as written (`entrypoint`, `domain`, `verified`, `description`, `datasets`...)."""
    refs: dict[str, tuple[str, str]] = field(default_factory=dict)
    """Fields written as NeMo Gym's `{type, name}` references: field -> (kind, instance name), checked to exist."""

    def nemo_gym_fields(self) -> dict[str, Any]:
        """The fields as NeMo Gym's own servers read them: references as `{type, name}`, NeMo Gym's keys back in."""
        fields = {k: ({"type": self.refs[k][0], "name": v} if k in self.refs else v) for k, v in self.fields.items()}
        return {**fields, **self.nemo_gym}

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
    loaded: set[Path] = set()
    for path in paths:
        for file, data in _read_with_includes(Path(path), loaded, ()):
            _merge_into(merged, data, file, sources, ())
    for override in overrides:
        key, value = _parse_override(override)
        _merge_into(merged, _nest(key, value), _OVERRIDE_SOURCE, sources, ())
    nemo_gym.apply_directives(merged, sources)
    unset = missing_paths(merged)
    if unset:
        key = ".".join(unset[0])
        others = ", ".join(".".join(p) for p in unset[1:4])
        more = f" ({len(unset) - 1} more unset: {others})" if len(unset) > 1 else ""
        raise ConfigError(
            _source_of(sources, unset[0]),
            key,
            f"is required ({MISSING!r} in the config): set it, e.g. --set {key}=VALUE{more}",
        )
    resolved = Interpolator(merged, lambda path: _source_of(sources, path)).resolve_tree(merged)
    return _split_instances(resolved, sources)


def _read_with_includes(path: Path, loaded: set[Path], chain: tuple[Path, ...]) -> list[tuple[str, dict[str, Any]]]:
    """The file and what its `config_paths` pull in, in merge order: a file after the files it includes, so it
    overrides them (NeMo Gym's order). A file already read is not read twice."""
    data = _read_yaml(path)
    key = path.resolve()
    if key in chain:
        raise ConfigError(str(path), nemo_gym.CONFIG_PATHS_KEY, "includes itself (through config_paths)")
    loaded.add(key)
    ordered: list[tuple[str, dict[str, Any]]] = []
    for included in nemo_gym.include_paths(data, path):
        if included.resolve() not in loaded:
            ordered += _read_with_includes(included, loaded, (*chain, key))
    return [*ordered, (str(path), data)]


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
        raise ConfigError(
            _OVERRIDE_SOURCE, override, "expected KEY.PATH=VALUE, e.g. my_env.resources_servers.x.port=8001"
        )
    try:
        value = yaml.safe_load(raw_value) if raw_value.strip() else ""
    except yaml.YAMLError:
        value = raw_value
    return parts, value


def _nest(key: KeyPath, value: Any) -> dict[str, Any]:
    for part in reversed(key):
        value = {part: value}
    return value


def _split_instances(merged: dict[str, Any], sources: dict[KeyPath, str]) -> GymConfig:
    values: dict[str, Any] = {}
    instances: dict[str, ServerInstance] = {}
    for name, body in merged.items():
        kinds = [k for k in body if k in ALL_KINDS] if isinstance(body, dict) else []
        if not kinds:
            values[name] = body
            continue
        source = _source_of(sources, (name,))
        if len(body) != 1:
            raise ConfigError(
                source, name, f"a server instance holds exactly one server kind, found keys {sorted(body)}"
            )
        kind = kinds[0]
        implementations = body[kind]
        if not isinstance(implementations, dict) or len(implementations) != 1:
            raise ConfigError(
                source, f"{name}.{kind}", "expected exactly one implementation: {<folder name>: {...fields}}"
            )
        implementation, raw_fields = next(iter(implementations.items()))
        raw_fields = {} if raw_fields is None else raw_fields
        if not isinstance(raw_fields, dict):
            raise ConfigError(
                source, f"{name}.{kind}.{implementation}", "the implementation's fields must be a mapping"
            )
        entry_source = _source_of(sources, (name, kind, implementation, "entrypoint"))
        source_dir = Path(entry_source).parent if entry_source and Path(entry_source).is_file() else None
        fields, nemo_gym_keys, refs = nemo_gym.split_fields(
            name, kind, implementation, raw_fields, ALL_KINDS, lambda path: _source_of(sources, path), source_dir
        )
        instances[name] = ServerInstance(name, kind, implementation, fields, sources, nemo_gym_keys, refs)
    _check_refs(instances, sources)
    return GymConfig(values=values, instances=instances, sources=sources)


def _check_refs(instances: dict[str, ServerInstance], sources: dict[KeyPath, str]) -> None:
    """Every `{type, name}` reference names an instance of the config, of that kind."""
    for instance in instances.values():
        for ref_field, (kind, target) in instance.refs.items():
            path = (instance.name, instance.kind, instance.implementation, ref_field)
            found = instances.get(target)
            if found is not None and found.kind == kind:
                continue
            if found is not None:
                detail = f"references {kind} {target!r}, but {target!r} is a {found.kind} instance"
            else:
                same_kind = sorted(i.name for i in instances.values() if i.kind == kind)
                detail = (
                    f"references {kind} {target!r}, which is not an instance of the merged config "
                    f"(its {kind}: {', '.join(same_kind) or 'none'})"
                )
            # The name's own source: a later file may change only the name of a reference an earlier file wrote.
            raise ConfigError(_source_of(sources, (*path, "name")), ".".join(path), detail)


def _source_of(sources: dict[KeyPath, str], path: KeyPath) -> str | None:
    # The nearest recorded ancestor names the file that set this key.
    for end in range(len(path), 0, -1):
        if path[:end] in sources:
            return sources[path[:end]]
    return None
