"""NeMo Gym's config shape: its server-level keys, `{type, name}` references, `config_paths` and inherit directives.

NeMo Gym 0.7.0 (nemo_gym/config_types.py, global_config.py) writes the same `instance -> kind -> implementation` tree
with keys its own machinery reads on every server (`entrypoint`, `domain`, `datasets`...), names other servers as
`{type: <kind>, name: <instance>}`, pulls other files in with top-level `config_paths`, and copies subtrees with
`_inherit_from` / `_copy` / `_delete_key` (or `${inherit_from:path}` / `${copy:path}` as a whole value).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

from nemo_gym_tok.config.config_error import ConfigError

KeyPath = tuple[str, ...]

ENVIRONMENT_SERVERS = "environment_servers"
"""NeMo Gym's fourth server kind (rollout dispatch in front of agents); no implementation of it lives here."""

NEMO_GYM_SERVER_KEYS = (
    "entrypoint",
    "domain",
    "verified",
    "verified_url",
    "description",
    "value",
    "datasets",
    "num_workers",
    "allowed_agents",
    "allowed_model_types",
    "skip_verification",
    "skip_verification_reward",
)
"""Keys NeMo Gym's own machinery (parser, launcher, registry listings, dataset tools) reads on any server. This
project's servers do not read them: they are taken out of the fields this project's config classes validate (which
forbid unknown keys, so a typo is still refused) and carried on `ServerInstance.nemo_gym`."""

DOMAINS = (
    "math",
    "coding",
    "agent",
    "knowledge",
    "instruction_following",
    "long_context",
    "safety",
    "games",
    "translation",
    "e2e",
    "rlhf",
    "other",
)
"""The values NeMo Gym 0.7.0's `Domain` enum accepts; NeMo Gym requires one on every resources server."""

CONFIG_PATHS_KEY = "config_paths"
INHERIT_KEY = "_inherit_from"
COPY_KEY = "_copy"
DELETE_KEY = "_delete_key"
INHERIT_PREFIX = "${inherit_from:"
COPY_PREFIX = "${copy:"

REF_KEYS = frozenset({"type", "name"})

DATASET_TYPES = ("train", "validation", "example", "benchmark")
LICENSES = (
    "Apache 2.0",
    "MIT",
    "Creative Commons Attribution 4.0 International",
    "Creative Commons Attribution-ShareAlike 4.0 International",
    "CC BY-SA 4.0",
    "CC BY-NC 3.0",
    "NVIDIA Internal Use Only, Do Not Distribute",
    "NVIDIA Evaluation Dataset License Agreement",
    "TBD",
    "GNU General Public License v3.0",
)
"""The dataset licenses NeMo Gym 0.7.0 accepts; it requires one on `train` and `validation` datasets."""


def not_implemented_here(kind: str) -> str:
    """What `ngt run` says of an instance in NeMo Gym's shape whose implementation this project does not have."""
    return (
        f"not an implementation of this project (no {kind} of that name here): a NeMo Gym server, which "
        f"`ngt run` does not start; run it with NeMo Gym and give this instance `url: http://HOST:PORT`"
    )


def include_paths(data: dict[str, Any], including: Path) -> list[Path]:
    """The files a config's top-level `config_paths` pulls in, found like NeMo Gym finds them: as given when
    absolute, else under the working directory, else under the nearest folder above the including file that holds
    the path (NeMo Gym's own configs name paths from its install root: `environment_servers/x/configs/x.yaml`)."""
    entries = data.get(CONFIG_PATHS_KEY) or []
    if not isinstance(entries, list) or not all(isinstance(e, str) for e in entries):
        raise ConfigError(str(including), CONFIG_PATHS_KEY, f"must be a list of paths, got {entries!r}")
    found = []
    for entry in entries:
        candidates = (
            [Path(entry)]
            if Path(entry).is_absolute()
            else [Path.cwd() / entry, *(folder / entry for folder in including.resolve().parents)]
        )
        path = next((c for c in candidates if c.is_file()), None)
        if path is None:
            raise ConfigError(
                str(including),
                CONFIG_PATHS_KEY,
                f"{entry!r} not found (looked in the working directory and the folders above the file)",
            )
        found.append(path)
    return found


def apply_directives(root: dict[str, Any], sources: dict[KeyPath, str]) -> None:
    """NeMo Gym's `_inherit_from` / `_copy` / `_delete_key` and `${inherit_from:...}` / `${copy:...}`, in place.

    A mapping with `_inherit_from: a.b` becomes the value at `a.b` with the mapping's own keys merged over it, and
    `a.b` is removed (`_copy` keeps it); `_delete_key: "x, y"` drops those keys from the result. Paths are read from
    the config as it was before any directive ran, as NeMo Gym does."""
    frozen = copy.deepcopy(root)
    _walk_directives(root, root, frozen, sources, ())


def _walk_directives(
    node: dict[str, Any], root: dict[str, Any], frozen: dict[str, Any], sources: dict[KeyPath, str], path: KeyPath
) -> None:
    for key, value in list(node.items()):
        here = (*path, key)
        to_delete: list[str] = []
        if isinstance(value, dict) and DELETE_KEY in value:
            to_delete = [k.strip() for k in str(value.pop(DELETE_KEY)).split(",") if k.strip()]
            for name in [k for k in to_delete if k in value]:
                del value[name]
                to_delete.remove(name)
        if isinstance(value, dict):
            _walk_directives(value, root, frozen, sources, here)
        elif isinstance(value, list):
            for i, item in enumerate(value):
                if isinstance(item, dict):
                    _walk_directives(item, root, frozen, sources, (*here, str(i)))
        source_path, keep_source = _directive_of(value)
        if source_path is None:
            continue
        where = sources.get(here) or _nearest(sources, here)
        target = source_path.split(".")
        inherited = _index(frozen, target, where, ".".join(here))
        if not keep_source:
            parent = _index(root, target[:-1], where, ".".join(here)) if len(target) > 1 else root
            if isinstance(parent, dict):
                parent.pop(target[-1], None)
        result = copy.deepcopy(inherited)
        for stale in [p for p in sources if p[: len(here)] == here]:
            del sources[stale]
        for origin, file in [(p, f) for p, f in sources.items() if p[: len(target)] == tuple(target)]:
            sources[(*here, *origin[len(target) :])] = file
        if isinstance(value, dict):
            if not isinstance(result, dict):
                raise ConfigError(where, ".".join(here), f"{source_path} is not a mapping, so it cannot be merged into")
            _merge(result, value)
            for name in to_delete:
                if name not in result:
                    raise ConfigError(where, ".".join(here), f"{DELETE_KEY}: {name!r} is not a key of the result")
                del result[name]
        node[key] = result
        if where:
            sources.setdefault(here, where)


def _directive_of(value: Any) -> tuple[str | None, bool]:
    """(source path, whether the source stays) of a value carrying a directive; (None, True) otherwise."""
    if isinstance(value, str):
        for prefix, keep in ((INHERIT_PREFIX, False), (COPY_PREFIX, True)):
            if value.startswith(prefix) and value.endswith("}"):
                return value[len(prefix) : -1].strip(), keep
        return None, True
    if isinstance(value, dict):
        for key, keep in ((INHERIT_KEY, False), (COPY_KEY, True)):
            if key in value:
                return str(value.pop(key)), keep
    return None, True


def _index(tree: dict[str, Any], parts: list[str], where: str | None, key: str) -> Any:
    node: Any = tree
    for part in parts:
        if not isinstance(node, dict) or part not in node:
            raise ConfigError(where, key, f"inherits or copies {'.'.join(parts)}, which is not in the config")
        node = node[part]
    return node


def _merge(target: dict[str, Any], update: dict[str, Any]) -> None:
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(target.get(key), dict):
            _merge(target[key], value)
        else:
            target[key] = copy.deepcopy(value)


def _nearest(sources: dict[KeyPath, str], path: KeyPath) -> str | None:
    for end in range(len(path), 0, -1):
        if path[:end] in sources:
            return sources[path[:end]]
    return None


def server_ref(value: Any, field: str, kind: str, kinds: tuple[str, ...]) -> str | None:
    """The kind a field's `{type, name}` value references, or None when the value is not a reference. An
    environment server's `agent_server` may leave `type` out (NeMo Gym reads it as an agent)."""
    if not isinstance(value, dict):
        return None
    if set(value) == REF_KEYS and value["type"] in kinds:
        return str(value["type"])
    if kind == ENVIRONMENT_SERVERS and field == "agent_server" and set(value) in ({"name"}, REF_KEYS):
        return "responses_api_agents" if value.get("type") in (None, "responses_api_agents") else None
    return None


def split_fields(
    name: str,
    kind: str,
    implementation: str,
    fields: dict[str, Any],
    kinds: tuple[str, ...],
    where: Callable[[KeyPath], str | None],
    source_dir: Path | None,
) -> tuple[dict[str, Any], dict[str, Any], dict[str, tuple[str, str]]]:
    """(fields this project validates, NeMo Gym's server keys, {field: (kind, instance)} of `{type, name}` refs).

    `entrypoint` stays among the fields when it names this project's own meaning (a module, or a file next to the
    config file that sets it, which `ngt run` imports); NeMo Gym's meaning (a file in the implementation's folder,
    `app.py`) goes with NeMo Gym's keys, and the implementation is found by its folder name."""
    ours: dict[str, Any] = {}
    theirs: dict[str, Any] = {}
    refs: dict[str, tuple[str, str]] = {}
    base = (name, kind, implementation)
    for field, value in fields.items():
        ref_kind = server_ref(value, field, kind, kinds)
        if ref_kind is not None:
            target = value["name"]
            if not isinstance(target, str) or not target:
                raise ConfigError(
                    where((*base, field)),
                    ".".join((*base, field, "name")),
                    f"a server reference needs an instance name, got {target!r}",
                )
            refs[field] = (ref_kind, target)
            ours[field] = target
        elif field == "entrypoint" and _own_entrypoint(value, source_dir):
            ours[field] = value
        elif field in NEMO_GYM_SERVER_KEYS:
            theirs[field] = value
        else:
            ours[field] = value
    domain = theirs.get("domain")
    if domain is not None and domain not in DOMAINS:
        raise ConfigError(
            where((*base, "domain")),
            ".".join((*base, "domain")),
            f"{domain!r} is not a NeMo Gym domain (one of: {', '.join(DOMAINS)})",
        )
    if "datasets" in theirs:
        _check_datasets(theirs["datasets"], where((*base, "datasets")), ".".join((*base, "datasets")))
    # Only NeMo Gym's entrypoint (a file in the implementation's folder) makes it a config NeMo Gym launches.
    if kind == "resources_servers" and "entrypoint" in theirs and domain is None:
        raise ConfigError(
            where(base),
            ".".join(base),
            f"NeMo Gym requires `domain` on a resources server that has an entrypoint (one of: {', '.join(DOMAINS)})",
        )
    return ours, theirs, refs


def _own_entrypoint(value: Any, source_dir: Path | None) -> bool:
    if not isinstance(value, str) or not value:
        return False
    if not value.endswith(".py"):
        return True  # a module path: NeMo Gym's entrypoints are always files
    return Path(value).is_absolute() or (source_dir is not None and (source_dir / value).is_file())


def _check_datasets(datasets: Any, where: str | None, key: str) -> None:
    """The checks NeMo Gym's parser makes on a server's `datasets` (it refuses the whole config otherwise)."""
    if datasets is None:
        return
    if not isinstance(datasets, list):
        raise ConfigError(where, key, f"must be a list of datasets, got {type(datasets).__name__}")
    for i, dataset in enumerate(datasets):
        here = f"{key}.{i}"
        if not isinstance(dataset, dict):
            raise ConfigError(where, here, "a dataset is a mapping with name, type and jsonl_fpath")
        for required in ("name", "type", "jsonl_fpath"):
            if not isinstance(dataset.get(required), str):
                raise ConfigError(where, f"{here}.{required}", "required (a string)")
        if dataset["type"] not in DATASET_TYPES:
            raise ConfigError(where, f"{here}.type", f"{dataset['type']!r} is not one of {', '.join(DATASET_TYPES)}")
        license_ = dataset.get("license")
        if license_ is not None and license_ not in LICENSES:
            raise ConfigError(
                where,
                f"{here}.license",
                f"{license_!r} is not a license NeMo Gym accepts (one of: {'; '.join(LICENSES)})",
            )
        if license_ is None and dataset["type"] in ("train", "validation"):
            raise ConfigError(where, f"{here}.license", f"NeMo Gym requires a license on a {dataset['type']} dataset")
