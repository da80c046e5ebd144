"""Resolve a NeMo Gym config with NeMo Gym's own parser; runs in .venv-nemo-gym, prints the YAML servers read.

Usage: python resolve_config.py SPEC_JSON. SPEC_JSON is a JSON object: `config_paths` (NeMo Gym's shipped YAML files,
relative to the installed package root) and `overrides` (a nested dict merged over them: ports, URLs, flags).
The servers read their keys without defaults, so they must get the config as NeMo Gym's parser resolves it, not the
raw YAML files.
"""

import json
import sys
from pathlib import Path

from nemo_gym.global_config import GlobalConfigDictParser, GlobalConfigDictParserConfig
from omegaconf import OmegaConf


def main() -> None:
    spec = json.loads(sys.argv[1])
    # The shipped configs live beside the nemo_gym package (resources_servers/, responses_api_models/, ...).
    root = Path(__import__("nemo_gym").__file__).resolve().parent.parent
    merged = OmegaConf.create({})
    for relative in spec["config_paths"]:
        merged = OmegaConf.merge(merged, OmegaConf.load(root / relative))
    merged = OmegaConf.merge(merged, OmegaConf.create(spec.get("overrides", {})))
    parser_config = GlobalConfigDictParserConfig(
        initial_global_config_dict=merged, skip_load_from_cli=True, skip_load_from_dotenv=True
    )
    resolved = GlobalConfigDictParser().parse(parser_config)
    sys.stdout.write(OmegaConf.to_yaml(resolved, resolve=True))


if __name__ == "__main__":
    main()
