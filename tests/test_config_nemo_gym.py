"""NeMo Gym's config shape in this project's loader: server keys, `{type, name}` refs, resolvers, includes, directives.

No NeMo Gym install needed; tests/nemo_gym/test_config_nemo_gym.py runs NeMo Gym's own parser on the same files.
"""

import subprocess
import sys
from pathlib import Path

import pytest

from nemo_gym_tok.config import ConfigError, load_config
from nemo_gym_tok.servers.base import BaseServerConfig
from nemo_gym_tok.servers.registry import validate_instance

REPO = Path(__file__).resolve().parents[1]


class AgentConfig(BaseServerConfig):
    model_server: str
    resources_server: str
    max_steps: int = 3


def write(folder: Path, name: str, text: str) -> Path:
    path = folder / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


GYM = """
policy_model:
  responses_api_models:
    some_model:
      entrypoint: app.py
env:
  resources_servers:
    some_env:
      entrypoint: app.py
      domain: games
      verified: false
      description: a game
      value: play well
env_agent:
  responses_api_agents:
    some_agent:
      entrypoint: app.py
      resources_server: {type: resources_servers, name: env}
      model_server:
        type: responses_api_models
        name: policy_model
      max_steps: 4
      datasets:
      - {name: example, type: example, jsonl_fpath: data/example.jsonl}
      - {name: train, type: train, jsonl_fpath: data/train.jsonl, license: MIT}
"""


def test_nemo_gym_keys_are_carried_apart_and_refs_become_instance_names(tmp_path: Path) -> None:
    config = load_config([write(tmp_path, "gym.yaml", GYM)])
    agent = config.instance("env_agent")
    assert agent.fields == {"resources_server": "env", "model_server": "policy_model", "max_steps": 4}
    assert agent.refs == {
        "resources_server": ("resources_servers", "env"),
        "model_server": ("responses_api_models", "policy_model"),
    }
    assert agent.nemo_gym["entrypoint"] == "app.py" and len(agent.nemo_gym["datasets"]) == 2
    assert agent.validate(AgentConfig).max_steps == 4  # the class forbids unknown keys: NeMo Gym's are not there
    env = config.instance("env")
    assert env.fields == {}
    assert env.nemo_gym == {
        "entrypoint": "app.py",
        "domain": "games",
        "verified": False,
        "description": "a game",
        "value": "play well",
    }
    rebuilt = agent.nemo_gym_fields()
    assert rebuilt["resources_server"] == {"type": "resources_servers", "name": "env"}
    assert rebuilt["entrypoint"] == "app.py" and rebuilt["max_steps"] == 4


def test_a_typo_in_our_keys_is_still_refused_beside_nemo_gym_keys(tmp_path: Path) -> None:
    path = write(tmp_path, "gym.yaml", GYM.replace("max_steps: 4", "max_stepz: 4"))
    with pytest.raises(ConfigError, match=r"gym\.yaml: env_agent\.responses_api_agents\.some_agent\.max_stepz: Extra"):
        load_config([path]).instance("env_agent").validate(AgentConfig)


@pytest.mark.parametrize(
    "old, new, message",
    [
        (
            "{type: resources_servers, name: env}",
            "{type: resources_servers, name: enn}",
            "env_agent.responses_api_agents.some_agent.resources_server: references resources_servers 'enn', which is "
            "not an instance of the merged config (its resources_servers: env)",
        ),
        (
            "{type: resources_servers, name: env}",
            "{type: resources_servers, name: policy_model}",
            "env_agent.responses_api_agents.some_agent.resources_server: references resources_servers 'policy_model', "
            "but 'policy_model' is a responses_api_models instance",
        ),
        ("name: policy_model", "name: 7", "model_server.name: a server reference needs an instance name, got 7"),
        ("domain: games", "domain: gaming", "env.resources_servers.some_env.domain: 'gaming' is not a NeMo Gym domain"),
        (
            "      domain: games\n",
            "",
            "env.resources_servers.some_env: NeMo Gym requires `domain` on a resources server",
        ),
        ("license: MIT", "license: CC-BY-SA-4.0", "datasets.1.license: 'CC-BY-SA-4.0' is not a license NeMo Gym"),
        (", license: MIT", "", "datasets.1.license: NeMo Gym requires a license on a train dataset"),
        ("type: example,", "type: sample,", "datasets.0.type: 'sample' is not one of train, validation, example"),
    ],
)
def test_bad_refs_and_nemo_gym_keys_name_file_and_key(tmp_path: Path, old: str, new: str, message: str) -> None:
    assert old in GYM
    path = write(tmp_path, "gym.yaml", GYM.replace(old, new, 1))
    with pytest.raises(ConfigError) as info:
        load_config([path])
    assert str(info.value).startswith(f"{path}: ") and message in str(info.value)
    assert "\n" not in str(info.value)


def test_a_ref_is_checked_against_the_merged_config_and_names_the_file_that_wrote_it(tmp_path: Path) -> None:
    base = write(tmp_path, "base.yaml", GYM)
    later = write(
        tmp_path,
        "later.yaml",
        "env_agent:\n  responses_api_agents:\n    some_agent:\n"
        "      model_server: {type: responses_api_models, name: judge}\n",
    )
    with pytest.raises(
        ConfigError,
        match=rf"^{later}: env_agent\..*model_server: references responses_api_models "
        r"'judge', which is not an instance .*\(its responses_api_models: policy",
    ):
        load_config([base, later])
    judge = write(tmp_path, "judge.yaml", "judge:\n  responses_api_models:\n    some_model: {entrypoint: app.py}\n")
    assert load_config([base, later, judge]).instance("env_agent").fields["model_server"] == "judge"


def test_environment_servers_agent_server_may_leave_the_type_out(tmp_path: Path) -> None:
    text = (
        GYM + "relay:\n  environment_servers:\n    legacy_agent:\n      entrypoint: app.py\n"
        "      agent_server: {name: env_agent}\n"
    )
    relay = load_config([write(tmp_path, "gym.yaml", text)]).instance("relay")
    assert relay.kind == "environment_servers" and relay.refs == {"agent_server": ("responses_api_agents", "env_agent")}


def test_oc_resolvers_resolve_like_omegaconf(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NGT_TEST_SET", "from-env")
    monkeypatch.delenv("NGT_TEST_UNSET", raising=False)
    text = r"""
n: 3
root: /data
x:
  env_set: ${oc.env:NGT_TEST_SET,other}
  env_default_int: ${oc.env:NGT_TEST_UNSET,6000}
  env_default_null: ${oc.env:NGT_TEST_UNSET,null}
  env_default_empty: ${oc.env:NGT_TEST_UNSET,''}
  env_in_text: ${oc.env:NGT_TEST_UNSET,/gdpval/refs}/deep
  env_url: ${oc.env:NGT_TEST_UNSET,https://api.example.com/v1}
  select_present: ${oc.select:n,8}
  select_absent_bool: ${oc.select:nowhere,false}
  select_absent_none: ${oc.select:nowhere}
  select_nested: ${oc.select:nowhere,${oc.env:NGT_TEST_UNSET,${root}/x}}
  select_quoted: ${oc.select:nowhere,'a,b'}
  decode: ${oc.decode:${oc.env:NGT_TEST_UNSET,'[1, 2]'}}
  decode_number: ${oc.decode:'3'}
  escaped: cost \${n}
  whole: ${n}
  mixed: n=${n}
"""
    values = load_config([write(tmp_path, "a.yaml", text)]).values["x"]
    assert values == {
        "env_set": "from-env",
        "env_default_int": "6000",
        "env_default_null": None,
        "env_default_empty": "",
        "env_in_text": "/gdpval/refs/deep",
        "env_url": "https://api.example.com/v1",
        "select_present": 3,
        "select_absent_bool": False,
        "select_absent_none": None,
        "select_nested": "/data/x",
        "select_quoted": "a,b",
        "decode": [1, 2],
        "decode_number": 3,
        "escaped": "cost ${n}",
        "whole": 3,
        "mixed": "n=3",
    }


@pytest.mark.parametrize(
    "value, message",
    [
        (
            "${oc.env:NGT_TEST_UNSET}",
            "x: environment variable NGT_TEST_UNSET is not set (${oc.env:NGT_TEST_UNSET}); "
            "set it, or give a default: ${oc.env:NGT_TEST_UNSET,DEFAULT}",
        ),
        ("${oc.create:{a: 1}}", "x: ${oc.create:...}: resolver not supported (ngt reads oc.env, oc.select, oc.decode"),
        ("${now:%H}", "x: ${now:...}: resolver not supported"),
        ("${.sibling}", "x: ${.sibling}: relative interpolation is not supported"),
        ("${oc.env:A,b,c}", "x: ${oc.env:A,b,c}: oc.env takes a variable name and an optional default"),
        ("${unclosed", "x: unclosed ${ in '${unclosed'"),
    ],
)
def test_unsupported_or_failing_interpolation_is_one_clear_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, value: str, message: str
) -> None:
    monkeypatch.delenv("NGT_TEST_UNSET", raising=False)
    path = write(tmp_path, "a.yaml", f"x: '{value}'\n")
    with pytest.raises(ConfigError) as info:
        load_config([path])
    assert str(info.value).startswith(f"{path}: {message}")


def test_missing_mark_names_the_key_and_how_to_set_it(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "a.yaml",
        "agent:\n  responses_api_agents:\n    a:\n      resources_server:\n"
        "        type: resources_servers\n        name: ???\n      other: ???\n",
    )
    with pytest.raises(ConfigError) as info:
        load_config([path])
    assert str(info.value) == (
        f"{path}: agent.responses_api_agents.a.resources_server.name: is required ('???' in the config): set it, "
        "e.g. --set agent.responses_api_agents.a.resources_server.name=VALUE (1 more unset: "
        "agent.responses_api_agents.a.other)"
    )
    env = write(tmp_path, "env.yaml", "e:\n  resources_servers:\n    x: {entrypoint: app.py, domain: math}\n")
    config = load_config(
        [env, path], ["agent.responses_api_agents.a.resources_server.name=e", "agent.responses_api_agents.a.other=1"]
    )
    assert config.instance("agent").fields == {"resources_server": "e", "other": 1}


def test_config_paths_pull_files_in_under_the_including_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path.parent)  # not the tree's root: the path is found above the including file
    write(
        tmp_path,
        "environment_servers/relay/configs/relay.yaml",
        "relay_template:\n  environment_servers:\n    relay:\n      entrypoint: app.py\n      timeout: 5\n"
        "      agent_server:\n        type: responses_api_agents\n        name: ???\n",
    )
    main = write(
        tmp_path,
        "resources_servers/game/configs/game.yaml",
        GYM
        + """
config_paths:
- environment_servers/relay/configs/relay.yaml
my_relay:
  _inherit_from: relay_template
  environment_servers:
    relay:
      agent_server: {type: responses_api_agents, name: env_agent}
""",
    )
    config = load_config([main])
    assert "relay_template" not in config.instances  # inherited away, as NeMo Gym pops it
    relay = config.instance("my_relay")
    assert relay.fields == {"timeout": 5, "agent_server": "env_agent"}
    assert relay.refs == {"agent_server": ("responses_api_agents", "env_agent")}
    bad = write(tmp_path, "bad.yaml", "config_paths: [nowhere/x.yaml]\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml: config_paths: 'nowhere/x\.yaml' not found"):
        load_config([bad])


def test_the_including_file_overrides_what_it_includes(tmp_path: Path) -> None:
    write(tmp_path, "inner.yaml", "a: inner\nb: inner\n")
    outer = write(tmp_path, "outer.yaml", f"config_paths: [{tmp_path / 'inner.yaml'}]\na: outer\n")
    assert {k: v for k, v in load_config([outer]).values.items() if k != "config_paths"} == {"a": "outer", "b": "inner"}


def test_copy_delete_and_inline_directives(tmp_path: Path) -> None:
    text = (
        GYM
        + """
env_copy:
  _copy: env
  resources_servers:
    some_env:
      domain: math
moved: ${inherit_from:settings.inner}
settings:
  inner: {k: 1}
  pair: {a: 1, b: 2}
duplicate: ${copy:settings.pair}
trimmed:
  _copy: settings.pair
  _delete_key: b
"""
    )
    base = write(tmp_path, "a.yaml", text)
    # A later file swaps an instance's implementation: NeMo Gym's `_delete_key` drops the one merged before.
    swap = write(
        tmp_path,
        "b.yaml",
        "policy_model:\n  responses_api_models:\n    _delete_key: some_model\n"
        "    other_model: {entrypoint: app.py, temperature: 0.5}\n",
    )
    config = load_config([base, swap])
    assert config.instance("env").nemo_gym["description"] == "a game"  # a copy keeps its source
    assert config.instance("env_copy").nemo_gym["domain"] == "math"
    assert config.instance("env_copy").nemo_gym["description"] == "a game"
    assert config.values["moved"] == {"k": 1} and "inner" not in config.values["settings"]  # inherit moves it
    assert config.values["duplicate"] == {"a": 1, "b": 2} and config.values["trimmed"] == {"a": 1}
    policy = config.instance("policy_model")
    assert (policy.implementation, policy.fields) == ("other_model", {"temperature": 0.5})
    missing = write(tmp_path, "c.yaml", "x:\n  _inherit_from: nowhere.at_all\n")
    with pytest.raises(ConfigError, match=r"c\.yaml: x: inherits or copies nowhere\.at_all, which is not in the conf"):
        load_config([missing])


def test_entrypoint_next_to_the_config_stays_ours_and_app_py_is_nemo_gyms(tmp_path: Path) -> None:
    write(tmp_path, "mine.py", "")
    path = write(
        tmp_path,
        "a.yaml",
        "a:\n  resources_servers:\n    x: {entrypoint: mine.py, domain: math}\n"
        "b:\n  resources_servers:\n    y: {entrypoint: app.py, domain: math}\n",
    )
    config = load_config([path])
    assert config.instance("a").fields == {"entrypoint": "mine.py"}
    assert config.instance("b").fields == {} and config.instance("b").nemo_gym["entrypoint"] == "app.py"


def test_this_projects_configs_are_in_nemo_gyms_shape_and_validate() -> None:
    config = load_config([REPO / "configs/env.yaml", REPO / "configs/demo.yaml"])
    for instance in config.instances.values():
        validate_instance(instance)
        assert instance.nemo_gym["entrypoint"] == "app.py"
        if instance.kind == "resources_servers":
            assert instance.nemo_gym["domain"]
    agent = config.instance("number_guess_agent")
    assert agent.refs == {
        "model_server": ("responses_api_models", "policy_model"),
        "resources_server": ("resources_servers", "number_guess"),
    }
    for path in [
        *REPO.glob("resources_servers/*/configs/*.yaml"),
        *REPO.glob("responses_api_models/*/configs/*.yaml"),
        *REPO.glob("responses_api_agents/*/configs/*.yaml"),
    ]:
        for instance in load_config([REPO / "configs/env.yaml", path]).instances.values():
            validate_instance(instance)
            assert instance.nemo_gym["entrypoint"] == "app.py", path


@pytest.mark.parametrize(
    "text, kind",
    [
        (
            "elsewhere:\n  resources_servers:\n    not_here_env: {entrypoint: app.py, domain: math}\n",
            "resources_servers",
        ),
        ("relay:\n  environment_servers:\n    legacy_agent: {entrypoint: app.py}\n", "environment_servers"),
    ],
)
def test_ngt_run_refuses_a_nemo_gym_implementation_in_one_line(tmp_path: Path, text: str, kind: str) -> None:
    path = write(tmp_path, "a.yaml", "head_server: {port: 0}\n" + text)
    result = subprocess.run(
        [sys.executable, "-m", "nemo_gym_tok", "run", "-c", str(path)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.startswith(f"ngt: {path}: ") and result.stderr.count("\n") == 1
    assert f"not an implementation of this project (no {kind} of that name here): a NeMo Gym server" in result.stderr
