"""Standalone script run by a Python with NeMo Gym installed: resolve one server instance's config with its parser.

`python nemo_gym_resolve.py SPEC_JSON`, SPEC_JSON being NeMo Gym's config for one instance (`{name: {kind: {impl:
{...}}}}`). Prints a JSON object: `root` (the site-packages folder holding nemo_gym/ and the shipped server folders)
and `config_yaml` (what NeMo Gym's parser made of the instance, the NEMO_GYM_CONFIG_DICT its server process reads:
its servers read keys that have no defaults). Imports nothing of nemo_gym_tok: that package is not installed there.
"""

import json
import sys
from pathlib import Path


def main() -> None:
    import nemo_gym
    from nemo_gym.global_config import GlobalConfigDictParser, GlobalConfigDictParserConfig
    from omegaconf import OmegaConf

    spec = OmegaConf.create(json.loads(sys.argv[1]))
    parser_config = GlobalConfigDictParserConfig(
        initial_global_config_dict=spec,
        skip_load_from_cli=True,
        skip_load_from_dotenv=True,
    )
    resolved = GlobalConfigDictParser().parse(parser_config)
    root = Path(nemo_gym.__file__).resolve().parent.parent
    json.dump({"root": str(root), "config_yaml": OmegaConf.to_yaml(resolved, resolve=True)}, sys.stdout)


if __name__ == "__main__":
    main()
