"""The server instances NeMo Gym's own parser finds in config files; runs in .venv-nemo-gym, prints JSON.

Usage: python config_servers.py SPEC_JSON. SPEC_JSON is a JSON list of requests, each `{"config_paths": [...],
"values": {...}}`: the files (absolute, or relative to NeMo Gym's install root or the working directory, as
`gym --config` takes them) and top-level values merged first (`policy_base_url`...). For each request it prints one
JSON line: `{"servers": [...]}`, each server `{name, kind, implementation, entrypoint, domain, refs}` (refs: field ->
[type, name] of every `{type, name}` value), or `{"error": "<exception class>: <first line>"}` when NeMo Gym refuses.
The parse is offline (NeMo Gym's static mode: no port probing, no exporters) and reads neither the command line nor
an env.yaml. A request `{"resolve": {...}}` instead prints `{"values": {key: {"value": ...} or {"error": ...}}}`: each
top-level key of that mapping resolved by OmegaConf with NeMo Gym's resolvers registered (its `${...}` semantics).
"""

import json
import sys

from nemo_gym.config_types import is_server_ref
from nemo_gym.global_config import GlobalConfigDictParser, GlobalConfigDictParserConfig
from omegaconf import OmegaConf


def servers_of(request: dict) -> dict:
    initial = OmegaConf.create({**request.get("values", {}), "config_paths": request["config_paths"]})
    parser = GlobalConfigDictParser()
    try:
        resolved = parser.parse(
            GlobalConfigDictParserConfig(
                initial_global_config_dict=initial,
                skip_load_from_cli=True,
                skip_load_from_dotenv=True,
                offline=True,
            )
        )
        found = []
        for server in parser.filter_for_server_instance_configs(resolved):
            inner = server.get_inner_run_server_config_dict()
            fields = OmegaConf.to_container(inner, resolve=True)
            refs = {}
            for key, value in fields.items():
                ref = is_server_ref(value) if isinstance(value, dict) else None
                if ref is not None:
                    refs[key] = [ref.type, ref.name]
            found.append(
                {
                    "name": server.name,
                    "kind": server.SERVER_TYPE,
                    "implementation": next(iter(getattr(server, server.SERVER_TYPE))),
                    "entrypoint": fields.get("entrypoint"),
                    "domain": fields.get("domain"),
                    "refs": refs,
                }
            )
        return {"servers": found}
    except Exception as exc:  # every refusal is reported, whatever NeMo Gym raises
        first = (str(exc).strip().splitlines() or [""])[0]
        return {"error": f"{type(exc).__name__}: {first}"}


def values_of(request: dict) -> dict:
    config = OmegaConf.create(request["resolve"])
    values = {}
    for key in request["resolve"]:
        try:
            node = config[key]
            # A child node keeps its parent, so its interpolations resolve against the whole config.
            values[key] = {"value": OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else node}
        except Exception as exc:  # a failing resolution is the answer for that key
            values[key] = {"error": type(exc).__name__}
    return {"values": values}


def main() -> None:
    for request in json.loads(sys.argv[1]):
        answer = values_of(request) if "resolve" in request else servers_of(request)
        sys.stdout.write(json.dumps(answer) + "\n")


if __name__ == "__main__":
    main()
