"""Gym configuration: YAML merging, interpolation, overrides, and the error they raise."""

from nemo_gym_tok.config.config_error import ConfigError
from nemo_gym_tok.config.loader import SERVER_KINDS, GymConfig, ServerInstance, load_config

__all__ = ["SERVER_KINDS", "ConfigError", "GymConfig", "ServerInstance", "load_config"]
