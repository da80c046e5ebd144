"""Config loading: merge order, interpolation, overrides, and one-line errors naming file and key."""

from pathlib import Path

import pytest

from nemo_gym_tok.config import ConfigError, load_config
from nemo_gym_tok.servers.base import BaseServerConfig


class ExampleConfig(BaseServerConfig):
    model: str
    max_steps: int = 3
    tags: list[str] = []


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


BASE = """
policy_model_name: tiny
env:
  resources_servers:
    example:
      model: ${policy_model_name}
      max_steps: 5
"""


def test_later_file_wins_and_nested_mappings_merge(tmp_path: Path) -> None:
    a = write(tmp_path, "a.yaml", BASE)
    b = write(tmp_path, "b.yaml", "env:\n  resources_servers:\n    example:\n      max_steps: 9\n")
    config = load_config([a, b])
    fields = config.instance("env").fields
    assert fields == {"model": "tiny", "max_steps": 9}
    assert config.values == {"policy_model_name": "tiny"}


def test_set_override_parses_yaml_scalars_and_beats_files(tmp_path: Path) -> None:
    a = write(tmp_path, "a.yaml", BASE)
    config = load_config([a], ["env.resources_servers.example.max_steps=12", "policy_model_name=other"])
    assert config.instance("env").fields == {"model": "other", "max_steps": 12}


def test_whole_value_reference_keeps_type_and_embedded_reference_is_text(tmp_path: Path) -> None:
    text = (
        "n: 4\nurl_base: http://h\nenv:\n  resources_servers:\n    x:\n"
        "      steps: ${n}\n      url: ${url_base}:${n}/v1\n"
    )
    config = load_config([write(tmp_path, "a.yaml", text)])
    assert config.instance("env").fields == {"steps": 4, "url": "http://h:4/v1"}


def test_dotted_reference(tmp_path: Path) -> None:
    text = "policy:\n  name: m\nenv:\n  resources_servers:\n    x:\n      model: ${policy.name}\n"
    assert load_config([write(tmp_path, "a.yaml", text)]).instance("env").fields == {"model": "m"}


def test_validation_into_pydantic_config(tmp_path: Path) -> None:
    config = load_config([write(tmp_path, "a.yaml", BASE)])
    validated = config.instance("env").validate(ExampleConfig)
    assert isinstance(validated, ExampleConfig) and validated.max_steps == 5 and validated.host == "127.0.0.1"


def test_malformed_yaml_names_file_and_line(tmp_path: Path) -> None:
    bad = write(tmp_path, "bad.yaml", "env:\n  resources_servers: [unclosed\n")
    with pytest.raises(ConfigError) as info:
        load_config([bad])
    message = str(info.value)
    assert message.startswith(f"{bad}: malformed YAML: line ")
    assert "\n" not in message


def test_missing_variable_names_file_key_and_variable(tmp_path: Path) -> None:
    a = write(tmp_path, "a.yaml", "env:\n  resources_servers:\n    x:\n      model: ${nowhere}\n")
    with pytest.raises(ConfigError) as info:
        load_config([a])
    assert str(info.value) == (
        f"{a}: env.resources_servers.x.model: ${{nowhere}} is not defined "
        "(set it in a config file or with --set nowhere=...)"
    )


def test_wrong_type_names_the_file_that_set_the_key(tmp_path: Path) -> None:
    a = write(tmp_path, "a.yaml", BASE)
    b = write(tmp_path, "b.yaml", "env:\n  resources_servers:\n    example:\n      max_steps: lots\n")
    with pytest.raises(ConfigError) as info:
        load_config([a, b]).instance("env").validate(ExampleConfig)
    message = str(info.value)
    assert message.startswith(f"{b}: env.resources_servers.example.max_steps: Input should be a valid integer")
    assert "'lots'" in message and "\n" not in message


def test_wrong_type_from_set_names_the_override(tmp_path: Path) -> None:
    a = write(tmp_path, "a.yaml", BASE)
    with pytest.raises(ConfigError) as info:
        load_config([a], ["env.resources_servers.example.tags=7"]).instance("env").validate(ExampleConfig)
    assert str(info.value).startswith("--set: env.resources_servers.example.tags: Input should be a valid list")


def test_unknown_field_is_rejected(tmp_path: Path) -> None:
    a = write(tmp_path, "a.yaml", BASE + "      max_stepz: 1\n")
    with pytest.raises(ConfigError, match=r"a\.yaml: env\.resources_servers\.example\.max_stepz: Extra inputs"):
        load_config([a]).instance("env").validate(ExampleConfig)


def test_missing_required_field(tmp_path: Path) -> None:
    a = write(tmp_path, "a.yaml", "env:\n  resources_servers:\n    example: {}\n")
    with pytest.raises(ConfigError, match=r"env\.resources_servers\.example\.model: Field required$"):
        load_config([a]).instance("env").validate(ExampleConfig)


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("env:\n  resources_servers: {a: {}, b: {}}\n", "expected exactly one implementation"),
        ("env:\n  resources_servers: {a: {}}\n  resources_servers_x: 1\n", "exactly one server kind"),
        ("- 1\n- 2\n", "top level must be a mapping"),
        ("a: ${b}\nb: ${a}\n", "does not terminate"),
    ],
)
def test_structural_errors(tmp_path: Path, text: str, fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment):
        load_config([write(tmp_path, "a.yaml", text)])


def test_bad_override_syntax() -> None:
    with pytest.raises(ConfigError, match="expected KEY.PATH=VALUE"):
        load_config([], ["no_equals_sign"])


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read file"):
        load_config([tmp_path / "absent.yaml"])
