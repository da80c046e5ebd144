"""Finds the server class of a config instance: `<kind folder>/<implementation>/app.py`, or an explicit entrypoint."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

from nemo_gym_tok.config import ConfigError, ServerInstance
from nemo_gym_tok.config.nemo_gym import not_implemented_here
from nemo_gym_tok.servers.base import BaseServer, BaseServerConfig

# Every server kind but the head is a folder at the repo root, one implementation per subfolder.
KIND_PACKAGES = {
    "responses_api_models": "responses_api_models",
    "resources_servers": "resources_servers",
    "responses_api_agents": "responses_api_agents",
    "head": "nemo_gym_tok.servers",
}

ENTRYPOINT_KEY = "entrypoint"
"""Optional implementation field: `package.module` or `path/to/app.py` defining `SERVER` (servers outside this repo)."""


def resolve_entrypoint(instance: ServerInstance) -> str | None:
    """The instance's explicit entrypoint; a relative file path is taken relative to the config file naming it."""
    entrypoint = instance.fields.get(ENTRYPOINT_KEY)
    if entrypoint and entrypoint.endswith(".py") and not Path(entrypoint).is_absolute():
        source = instance.sources.get((instance.name, instance.kind, instance.implementation, ENTRYPOINT_KEY))
        if source and Path(source).is_file():
            return str(Path(source).parent.resolve() / entrypoint)
    return entrypoint


def resolve_server_class(instance: ServerInstance) -> type[BaseServer]:
    entrypoint = resolve_entrypoint(instance)
    where = f"{instance.name}.{instance.kind}.{instance.implementation}"
    if instance.kind not in KIND_PACKAGES:  # NeMo Gym's environment_servers
        raise ConfigError(instance.sources.get((instance.name,)), where, not_implemented_here(instance.kind))
    try:
        module = (
            _load_module(entrypoint)
            if entrypoint
            else _load_module(
                f"{KIND_PACKAGES[instance.kind]}.{instance.implementation}.app"
                if instance.kind != "head"
                else "nemo_gym_tok.servers.head"
            )
        )
    except ModuleNotFoundError as exc:
        source = instance.sources.get((instance.name,))
        module_path = f"{KIND_PACKAGES[instance.kind]}.{instance.implementation}.app"
        missing_itself = bool(exc.name) and module_path.startswith(str(exc.name))  # not a dependency it imports
        detail = (
            not_implemented_here(instance.kind)
            if instance.nemo_gym and missing_itself and not entrypoint
            else f"no implementation found ({exc.msg})"
        )
        raise ConfigError(source, where, detail) from None
    server_class = getattr(module, "SERVER", None)
    if not (isinstance(server_class, type) and issubclass(server_class, BaseServer)):
        raise ConfigError(None, where, f"{module.__name__} must define SERVER = <a BaseServer subclass>")
    if server_class.kind not in (instance.kind, "head"):
        raise ConfigError(
            None, where, f"{server_class.__name__} is a {server_class.kind} server, configured under {instance.kind}"
        )
    return server_class


def validate_instance(instance: ServerInstance) -> tuple[type[BaseServer], BaseServerConfig]:
    """Resolve the implementation and validate its fields; raises ConfigError naming file and key."""
    server_class = resolve_server_class(instance)
    fields = {k: v for k, v in instance.fields.items() if k != ENTRYPOINT_KEY}
    stripped = ServerInstance(instance.name, instance.kind, instance.implementation, fields, instance.sources)
    config = stripped.validate(server_class.config_class)
    return server_class, config  # type: ignore[return-value]


def _load_module(target: str) -> ModuleType:
    if target.endswith(".py"):
        path = Path(target).resolve()
        if not path.is_file():
            raise ModuleNotFoundError(f"no file {target}")
        name = f"_ngt_entrypoint_{abs(hash(str(path)))}"
        if name in sys.modules:
            return sys.modules[name]
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec and spec.loader
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        return module
    return importlib.import_module(target)
