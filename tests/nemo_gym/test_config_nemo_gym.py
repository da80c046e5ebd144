"""One config language: NeMo Gym 0.7.0's own parser and this project's loader read the same files the same way.

Needs .venv-nemo-gym (`make test-nemo-gym` builds it; no vLLM): `config_servers.py` runs NeMo Gym's parser there and
prints the server instances it finds, which the tests compare with `load_config`'s, over
- every config file of this repository (configs/, resources_servers/*/configs, responses_api_models/*/configs,
  responses_api_agents/*/configs);
- every resources server config NeMo Gym ships (with its own vllm_model.yaml for `policy_model`);
- every `${...}` value written in NeMo Gym's shipped YAML, resolved by OmegaConf and by this loader.
The unit tests of the loader's NeMo Gym shape are tests/test_config_nemo_gym.py (no venv needed).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from nemo_gym_tok.config import ConfigError, GymConfig, load_config
from nemo_gym_tok.config.interpolation import Interpolator
from tests.nemo_gym import gym

REPO = Path(__file__).resolve().parents[2]
SERVERS_SCRIPT = Path(__file__).with_name("config_servers.py")
ENV = REPO / "configs" / "env.yaml"
VALUES = {
    "policy_base_url": "http://127.0.0.1:8000/v1",
    "policy_api_key": "key",
    "policy_model_name": "m",
    "judge_base_url": "http://127.0.0.1:8001/v1",
    "judge_api_key": "key",
    "judge_model_name": "judge",
}


def nemo_gym_answers(requests: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One answer per request from NeMo Gym's own parser / OmegaConf, run in .venv-nemo-gym."""
    out = subprocess.run(
        [str(gym.NEMO_GYM_PYTHON), str(SERVERS_SCRIPT), json.dumps(requests)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    answers = [json.loads(line) for line in out.stdout.splitlines()]
    assert len(answers) == len(requests)
    return answers


def our_servers(paths: list[Path], values_file: Path | None = None) -> dict[str, Any]:
    """The same summary as config_servers.py prints, from this project's loader."""
    try:
        config: GymConfig = load_config([*([values_file] if values_file else []), *paths])
    except ConfigError as exc:
        return {"error": str(exc)}
    return {
        "servers": [
            {
                "name": i.name,
                "kind": i.kind,
                "implementation": i.implementation,
                "entrypoint": i.nemo_gym.get("entrypoint", i.fields.get("entrypoint")),
                "domain": i.nemo_gym.get("domain"),
                "refs": {field: list(ref) for field, ref in i.refs.items()},
            }
            for i in config.instances.values()
        ]
    }


def generated_relays(theirs: list[dict[str, Any]], ours: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """NeMo Gym's servers the loader does not have: the `legacy_agent` relays NeMo Gym generates (with a deprecation
    warning) for every agent no environment server names."""
    names = {s["name"] for s in ours}
    return [s for s in theirs if s["name"] not in names]


def by_name(servers: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {s["name"]: s for s in servers}


def repo_config_sets() -> list[list[Path]]:
    own = [
        *sorted(REPO.glob("configs/*.yaml")),
        *sorted(REPO.glob("resources_servers/*/configs/*.yaml")),
        *sorted(REPO.glob("responses_api_models/*/configs/*.yaml")),
        *sorted(REPO.glob("responses_api_agents/*/configs/*.yaml")),
    ]
    return [[ENV, path] if path != ENV else [ENV] for path in own]


def test_every_config_of_this_repo_resolves_through_nemo_gyms_parser_to_the_same_servers() -> None:
    sets = repo_config_sets()
    assert len(sets) >= 7
    answers = nemo_gym_answers([{"config_paths": [str(p) for p in paths]} for paths in sets])
    servers_seen = 0
    for paths, theirs in zip(sets, answers):
        label = " + ".join(p.relative_to(REPO).as_posix() for p in paths)
        assert "servers" in theirs, f"NeMo Gym refuses {label}: {theirs.get('error')}"
        ours = our_servers(paths)
        assert "servers" in ours, f"ngt refuses {label}: {ours.get('error')}"
        relays = generated_relays(theirs["servers"], ours["servers"])
        agents = {s["name"] for s in ours["servers"] if s["kind"] == "responses_api_agents"}
        assert {s["implementation"] for s in relays} <= {"legacy_agent"}, label
        assert {s["refs"]["agent_server"][1] for s in relays} == agents, label
        kept = [s for s in theirs["servers"] if s not in relays]
        assert by_name(kept) == by_name(ours["servers"]), label
        servers_seen += len(kept)
        print(f"{label}: NeMo Gym and ngt find the same {len(kept)} servers (+{len(relays)} generated relays)")
    assert servers_seen >= 12  # demo.yaml alone has 7; before NeMo Gym's shape, NeMo Gym counted none


SHIPPED_EXAMPLES = {
    "resources_servers/example_single_tool_call/configs/example_single_tool_call.yaml": {
        "example_single_tool_call": ("resources_servers", "example_single_tool_call", {}),
        "example_single_tool_call_simple_agent": (
            "responses_api_agents",
            "simple_agent",
            {
                "resources_server": ["resources_servers", "example_single_tool_call"],
                "model_server": ["responses_api_models", "policy_model"],
            },
        ),
        "example_single_tool_call_environment_server": (
            "environment_servers",
            "legacy_agent",
            {"agent_server": ["responses_api_agents", "example_single_tool_call_simple_agent"]},
        ),
    },
    # config_paths to NeMo Gym's environment_servers/ tree, then `_inherit_from` of the template it pulls in.
    "resources_servers/example_single_tool_call/configs/example_single_tool_call_single_agent_turn.yaml": {
        "example_single_tool_call_single_agent_turn": (
            "environment_servers",
            "single_agent_turn_legacy",
            {
                "resources_server": ["resources_servers", "example_single_tool_call"],
                "agent_server": ["responses_api_agents", "example_single_tool_call_session_agent"],
            },
        ),
    },
    "resources_servers/example_multi_step/configs/example_multi_step.yaml": {
        "example_multi_step_resources_server": ("resources_servers", "example_multi_step", {}),
        "example_multi_step_simple_agent": (
            "responses_api_agents",
            "simple_agent",
            {
                "resources_server": ["resources_servers", "example_multi_step_resources_server"],
                "model_server": ["responses_api_models", "policy_model"],
            },
        ),
    },
    # A judge model server beside the policy model, `${oc.select:...}` defaults on the judge's settings.
    "resources_servers/math_with_judge/configs/math_with_judge.yaml": {
        "math_with_judge": (
            "resources_servers",
            "math_with_judge",
            {"judge_model_server": ["responses_api_models", "policy_model"]},
        ),
    },
}


@pytest.fixture(scope="module")
def shipped(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, list[Path], list[dict[str, Any]]]:
    """Every resources server config NeMo Gym ships, each with its vllm_model.yaml: (root, values file, files,
    NeMo Gym's answers)."""
    root = gym.package_root()
    values_file = tmp_path_factory.mktemp("values") / "values.yaml"
    values_file.write_text(yaml.safe_dump(VALUES))
    files = sorted(root.glob("resources_servers/*/configs/*.yaml"))
    model = root / "responses_api_models/vllm_model/configs/vllm_model.yaml"
    answers = nemo_gym_answers([{"config_paths": [str(model), str(f)], "values": VALUES} for f in files])
    return root, values_file, files, answers


def test_nemo_gyms_example_configs_load_with_the_right_instances_kinds_and_refs(shipped) -> None:
    root, values_file, files, answers = shipped
    model = root / "responses_api_models/vllm_model/configs/vllm_model.yaml"
    for relative, expected in SHIPPED_EXAMPLES.items():
        config = load_config([values_file, model, root / relative])
        for name, (kind, implementation, refs) in expected.items():
            instance = config.instance(name)
            assert (instance.kind, instance.implementation) == (kind, implementation), relative
            assert {f: list(r) for f, r in instance.refs.items()} == refs, relative
            assert instance.nemo_gym["entrypoint"] == "app.py", relative
            for field, (ref_kind, target) in instance.refs.items():
                assert instance.fields[field] == target and config.instance(target).kind == ref_kind
        theirs = by_name(answers[files.index(root / relative)]["servers"])
        ours = by_name(our_servers([model, root / relative], values_file)["servers"])
        assert ours == {name: theirs[name] for name in ours}, relative


def test_every_shipped_resources_server_config_reads_as_nemo_gym_reads_it(shipped) -> None:
    root, values_file, files, answers = shipped
    model = root / "responses_api_models/vllm_model/configs/vllm_model.yaml"
    same = refused_by_both = overlays = 0
    differences = []
    for path, theirs in zip(files, answers):
        ours = our_servers([model, path], values_file)
        label = path.relative_to(root).as_posix()
        if "error" in ours or "error" in theirs:
            refused_by_both += "error" in ours and "error" in theirs
            if ("error" in ours) != ("error" in theirs):
                differences.append(
                    f"{label}: ngt {ours.get('error', 'accepts')} / NeMo Gym {theirs.get('error', 'accepts')}"
                )
            continue
        relays = generated_relays(theirs["servers"], ours["servers"])
        kept = by_name([s for s in theirs["servers"] if s not in relays])
        mine = by_name(ours["servers"])
        # The one documented difference: a kind block without an entrypoint (an overlay meant to be merged over the
        # file that has it) is a server for ngt, not for NeMo Gym.
        overlay = {n for n, s in mine.items() if s["entrypoint"] is None and n not in kept}
        if {n: s for n, s in mine.items() if n not in overlay} != kept or any(
            s["implementation"] != "legacy_agent" for s in relays
        ):
            differences.append(f"{label}: ngt {sorted(mine)} / NeMo Gym {sorted(kept)}")
            continue
        same += 1
        overlays += bool(overlay)
    print(
        f"NeMo Gym's {len(files)} shipped resources server configs: {same} read to the same servers by both "
        f"({overlays} of them with an entrypoint-less overlay block that only ngt counts), {refused_by_both} "
        f"refused by both, {len(differences)} read differently"
    )
    assert differences == []
    assert same >= 200 and len(files) >= 200


def interpolated_values(root: Path) -> list[str]:
    """Every distinct string holding `${` in NeMo Gym's shipped YAML (inherit/copy directives aside)."""
    found: set[str] = set()

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)
        elif isinstance(node, str) and "${" in node and not node.startswith(("${inherit_from:", "${copy:")):
            found.add(node)

    for folder in (
        "resources_servers",
        "responses_api_models",
        "responses_api_agents",
        "environment_servers",
        "benchmarks",
    ):
        for path in (root / folder).rglob("*.yaml"):
            try:
                walk(yaml.safe_load(path.read_text()))
            except yaml.YAMLError:
                continue
    return sorted(found)


def test_every_interpolation_nemo_gyms_configs_write_resolves_as_omegaconf_resolves_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    strings = interpolated_values(gym.package_root())
    assert len(strings) >= 100
    # Some referenced keys and variables set, most not: defaults and failures both get compared.
    tree: dict[str, Any] = {**VALUES, "tavily_api_key": "t", "nested": {"key": 5}}
    compared = {f"interpolated_{i}": text for i, text in enumerate(strings)}
    tree.update(compared)
    env = {"JUDGE_BASE_URL": "http://judge/v1", "NEMO_SKILLS_SANDBOX_PORT": "6001", "TAVILY_API_KEY": "tk"}
    for name in list(os.environ):
        if name not in env and any(name in s for s in strings):
            monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    [answer] = nemo_gym_answers([{"resolve": tree}])
    interpolator = Interpolator(tree, lambda path: None)
    agree = failures = 0
    differences = []
    for key, theirs in answer["values"].items():
        if key not in compared:
            continue  # the values the strings refer to
        try:
            ours: dict[str, Any] = {"value": interpolator.resolve_tree(tree[key], (key,))}
        except ConfigError:
            ours = {"error": True}
        if "error" in theirs and "error" in ours:
            failures += 1
        elif ours.get("value", object()) == theirs.get("value", object()):
            agree += 1
        else:
            differences.append(f"{tree[key]!r}: ngt {ours} / OmegaConf {theirs}")
    print(
        f"{len(strings)} distinct ${{...}} values of NeMo Gym's YAML: {agree} resolve to the same value, "
        f"{failures} fail in both (unset keys or variables), {len(differences)} differ"
    )
    assert differences == []
    assert agree >= 100


def test_nemo_gyms_training_config_for_vllm_model_starts_this_adapter(shipped) -> None:
    """NeMo Gym's vllm_model_for_training.yaml (what its training recipes put in front of vLLM) sets
    `uses_reasoning_parser`, which this adapter once refused as an unknown key; it now takes the file whole."""
    from responses_api_models.vllm_model.config import VLLMModelConfig

    root, values_file, _, _ = shipped
    path = root / "responses_api_models/vllm_model/configs/vllm_model_for_training.yaml"
    instance = load_config([values_file, path]).instance("policy_model")
    assert instance.fields["uses_reasoning_parser"] is True
    adapter = VLLMModelConfig.model_validate(instance.fields)
    assert adapter.uses_reasoning_parser is True and adapter.return_token_id_information is True
