"""capital_lookup over HTTP: seeding, the lookup tool, verify's reward, caller mistakes, and the example rows."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from nemo_gym_tok.config import load_config
from nemo_gym_tok.servers.registry import validate_instance
from resources_servers.capital_lookup.app import (
    CAPITALS,
    LOOKUP_CAPITAL_TOOL,
    SERVER,
    CapitalLookup,
    CapitalLookupConfig,
)

FOLDER = Path(__file__).resolve().parents[1]
ROWS = [json.loads(line) for line in (FOLDER / "data" / "example.jsonl").read_text().splitlines() if line.strip()]
FRANCE = next(row for row in ROWS if row["expected_answer"] == "Paris")


def client(**fields: Any) -> TestClient:
    return TestClient(SERVER("capital_lookup", CapitalLookupConfig(**fields)).build_app())


def headers(session: str) -> dict[str, str]:
    return {"x-session-id": session}


def episode(answer: str | list[dict[str, str]] | None, *, tool_call: bool = True) -> dict[str, Any]:
    """A Responses object for one episode: the question, optionally a lookup, then the model's final answer."""
    items: list[dict[str, Any]] = [{"type": "message", "role": "user", "content": "What is the capital of France?"}]
    if tool_call:
        items += [
            {"type": "function_call", "name": "lookup_capital", "arguments": '{"country": "France"}', "call_id": "c1"},
            {"type": "function_call_output", "call_id": "c1", "output": "The capital of France is Paris."},
        ]
    if answer is not None:
        content = answer if isinstance(answer, list) else [{"type": "output_text", "text": answer}]
        items.append({"type": "message", "role": "assistant", "content": content})
    return {"id": "resp_1", "object": "response", "output": items}


def play(http: TestClient, session: str, answer: Any, *, lookups: int = 1) -> dict[str, Any]:
    assert http.post("/seed_session", json=FRANCE, headers=headers(session)).status_code == 200
    for _ in range(lookups):
        assert http.post("/lookup_capital", json={"country": "France"}, headers=headers(session)).status_code == 200
    verified = http.post("/verify", json={**FRANCE, "response": episode(answer)}, headers=headers(session))
    assert verified.status_code == 200, verified.text
    return verified.json()


def play_verify(http: TestClient, session: str) -> dict[str, Any]:
    return http.post("/verify", json={**FRANCE, "response": episode("Paris")}, headers=headers(session)).json()


def country_of(row: dict[str, Any]) -> str:
    question = row["responses_create_params"]["input"][-1]["content"]
    return question.removeprefix("What is the capital of ").removesuffix("?")


def assert_enum_only(tool: dict[str, Any]) -> None:
    """The tiny random test model must be able to finish every argument: enums only, all required, nothing extra."""
    assert tool["type"] == "function" and tool["strict"] is True
    parameters = tool["parameters"]
    assert parameters["type"] == "object" and parameters["additionalProperties"] is False
    assert sorted(parameters.get("required", [])) == sorted(parameters["properties"])
    for spec in parameters["properties"].values():
        assert spec["enum"] and all(isinstance(v, str) or type(v) is int for v in spec["enum"])


def test_winning_episode_gets_full_reward() -> None:
    http = client()
    assert http.post("/seed_session", json=FRANCE, headers=headers("s1")).json() == {}
    looked_up = http.post("/lookup_capital", json={"country": "France"}, headers=headers("s1"))
    assert looked_up.json() == {"output": "The capital of France is Paris."}
    assert http.post("/step", json={"output": []}, headers=headers("s1")).json() == {"done": True}
    result = http.post(
        "/verify", json={**FRANCE, "response": episode("The capital of France is PARIS.")}, headers=headers("s1")
    ).json()
    assert result == {"reward": 1.0, "answered": True, "tool_calls": 1}


@pytest.mark.parametrize(
    ("answer", "reward", "answered"),
    [
        ("It is Lyon.", 0.0, True),
        ("Parisian food is great.", 0.0, True),  # the capital must appear as a whole word
        ("", 0.0, False),
        (None, 0.0, False),  # no assistant message at all
        ([{"type": "output_text", "text": "It is "}, {"type": "output_text", "text": "paris"}], 1.0, True),
    ],
)
def test_reward_reads_the_final_assistant_message(answer: Any, reward: float, answered: bool) -> None:
    result = play(client(), "s", answer)
    assert (result["reward"], result["answered"]) == (reward, answered)


def test_only_the_last_assistant_message_counts() -> None:
    http = client()
    http.post("/seed_session", json=FRANCE, headers=headers("s"))
    response = episode("Paris")
    response["output"].append({"type": "message", "role": "assistant", "content": "Actually, Marseille."})
    assert http.post("/verify", json={**FRANCE, "response": response}, headers=headers("s")).json()["reward"] == 0.0


def test_string_content_is_read_too() -> None:
    http = client()
    http.post("/seed_session", json=FRANCE, headers=headers("s"))
    response = episode(None)
    response["output"].append({"type": "message", "role": "assistant", "content": "Paris"})
    assert http.post("/verify", json={**FRANCE, "response": response}, headers=headers("s")).json()["reward"] == 1.0


def test_require_tool_call_withholds_reward_from_recall() -> None:
    assert play(client(require_tool_call=True), "s", "Paris", lookups=0) == {
        "reward": 0.0,
        "answered": True,
        "tool_calls": 0,
    }
    assert play(client(require_tool_call=True), "s", "Paris", lookups=2)["reward"] == 1.0
    assert play(client(), "s", "Paris", lookups=0)["reward"] == 1.0


@pytest.mark.parametrize(
    ("arguments", "hint"),
    [
        ({"country": "Atlantis"}, 'unknown country "Atlantis"; country must be one of: France, Germany'),
        ({"country": "france"}, 'unknown country "france"'),
        ({"country": 3}, "unknown country 3"),
        ({}, "no country; country must be one of"),
        ({"country": "France", "city": "x"}, "takes only `country`, not city"),
    ],
)
def test_wrong_arguments_are_told_to_the_model(arguments: dict[str, Any], hint: str) -> None:
    http = client()
    http.post("/seed_session", json=FRANCE, headers=headers("s"))
    answer = http.post("/lookup_capital", json=arguments, headers=headers("s"))
    assert answer.status_code == 200
    assert answer.json()["output"].startswith("error: ") and hint in answer.json()["output"]
    # A wrong call is still a call the model made.
    assert play_verify(http, "s")["tool_calls"] == 1


def test_missing_header_and_unknown_session_are_400() -> None:
    http = client()
    for path, body in [("/seed_session", FRANCE), ("/lookup_capital", {"country": "France"}), ("/verify", {})]:
        answer = http.post(path, json=body)
        assert answer.status_code == 400
        assert answer.json()["error"]["message"] == "missing the x-session-id header that names the episode"
    for path, body in [("/lookup_capital", {"country": "France"}), ("/verify", {"response": episode("Paris")})]:
        answer = http.post(path, json=body, headers=headers("nobody"))
        assert answer.status_code == 400
        assert answer.json()["error"]["message"] == "unknown session 'nobody'; call /seed_session first"


def test_caller_mistakes_in_bodies_are_400() -> None:
    http = client()
    bad_seed = http.post("/seed_session", json={"responses_create_params": {}}, headers=headers("s"))
    assert bad_seed.status_code == 400 and "expected_answer" in bad_seed.json()["error"]["message"]
    http.post("/seed_session", json=FRANCE, headers=headers("s"))
    bad_verify = http.post("/verify", json={"response": {"output": "Paris"}}, headers=headers("s"))
    assert bad_verify.status_code == 400 and "response.output" in bad_verify.json()["error"]["message"]
    # The malformed verify did not end the episode: a corrected one still scores it.
    assert play_verify(http, "s")["reward"] == 1.0


def test_verify_frees_the_session() -> None:
    server = CapitalLookup("capital_lookup", CapitalLookupConfig())
    http = TestClient(server.build_app())
    http.post("/seed_session", json=FRANCE, headers=headers("s"))
    play_verify(http, "s")
    assert len(server.episodes) == 0
    assert http.post("/verify", json={"response": episode("Paris")}, headers=headers("s")).status_code == 400
    assert http.post("/lookup_capital", json={"country": "France"}, headers=headers("s")).status_code == 400


def test_sessions_are_independent() -> None:
    http = client()
    kenya = next(row for row in ROWS if row["expected_answer"] == "Nairobi")
    http.post("/seed_session", json=FRANCE, headers=headers("a"))
    http.post("/seed_session", json=kenya, headers=headers("b"))
    assert play_verify(http, "b")["reward"] == 0.0  # "Paris" is wrong for Kenya
    assert play_verify(http, "a")["reward"] == 1.0


def test_example_rows_follow_the_row_rules() -> None:
    assert len(ROWS) >= 6
    for row in ROWS:
        params = row["responses_create_params"]
        assert [m["role"] for m in params["input"]] == ["system", "user"]
        assert (params["tool_choice"], params["parallel_tool_calls"]) == ("required", False)
        assert params["max_output_tokens"] == 64
        assert params["tools"] == [LOOKUP_CAPITAL_TOOL]
        assert row["expected_answer"] in CAPITALS.values()
        country = next(c for c, capital in CAPITALS.items() if capital == row["expected_answer"])
        assert country in params["input"][-1]["content"]
        for tool in params["tools"]:
            assert_enum_only(tool)


def test_every_row_is_solvable_through_the_tool() -> None:
    http = client()
    for index, row in enumerate(ROWS):
        session = f"row{index}"
        http.post("/seed_session", json=row, headers=headers(session))
        country = country_of(row)
        output = http.post("/lookup_capital", json={"country": country}, headers=headers(session)).json()["output"]
        verified = http.post("/verify", json={**row, "response": episode(output)}, headers=headers(session))
        assert verified.json()["reward"] == 1.0


def test_config_file_loads() -> None:
    config = load_config([FOLDER / "configs" / "capital_lookup.yaml"])
    [(server_class, server_config)] = [validate_instance(instance) for instance in config.instances.values()]
    assert server_class is CapitalLookup and isinstance(server_config, CapitalLookupConfig)
