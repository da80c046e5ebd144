"""non_ascii over HTTP: per-answer shares in the user turns, the turn limit, the reward, mistakes, the example rows."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from pydantic import ValidationError

from nemo_gym_tok.config import load_config
from nemo_gym_tok.servers.registry import validate_instance
from resources_servers.non_ascii.app import SERVER, NonAscii, NonAsciiConfig, character_counts, share

FOLDER = Path(__file__).resolve().parents[1]
ROWS = [json.loads(line) for line in (FOLDER / "data" / "example.jsonl").read_text().splitlines() if line.strip()]


class Episode:
    """Plays the agent's part: keeps the episode's items, sends each model answer to /step, appends the user turns."""

    def __init__(self, http: TestClient, row: dict[str, Any], session: str = "s") -> None:
        self.http, self.headers, self.row = http, {"x-session-id": session}, row
        assert http.post("/seed_session", json=row, headers=self.headers).status_code == 200
        self.items: list[dict[str, Any]] = [{"type": "message", **row["responses_create_params"]["input"][-1]}]

    def answer(self, text: str | None) -> dict[str, Any]:
        if text is None:  # a turn with reasoning only
            self.items.append({"type": "reasoning", "summary": [{"type": "summary_text", "text": "ü"}]})
        else:
            content = [{"type": "output_text", "text": text}]
            self.items.append({"type": "message", "role": "assistant", "content": content})
        stepped = self.http.post("/step", json={"output": self.items}, headers=self.headers)
        assert stepped.status_code == 200, stepped.text
        result = stepped.json()
        if not result["done"]:
            self.items.append({"type": "message", "role": "user", "content": result["user_message"]})
        return result

    def verify(self) -> dict[str, Any]:
        body = {**self.row, "response": {"object": "response", "output": self.items}}
        verified = self.http.post("/verify", json=body, headers=self.headers)
        assert verified.status_code == 200, verified.text
        return verified.json()


def client(**fields: Any) -> TestClient:
    return TestClient(SERVER("non_ascii", NonAsciiConfig(**fields)).build_app())


@pytest.mark.parametrize(
    ("text", "counts"),
    [
        ("abc", (0, 3)),
        ("海と空", (3, 3)),
        (" a é\n", (1, 2)),  # whitespace is not counted
        ("\ufffd!", (1, 2)),  # a detokenizer's replacement character is beyond ASCII too
        ("", (0, 0)),
        ("  \t", (0, 0)),
    ],
)
def test_characters_beyond_ascii_are_counted_without_whitespace(text: str, counts: tuple[int, int]) -> None:
    assert character_counts(text) == counts


def test_an_episode_is_scored_over_every_answer() -> None:
    game = Episode(client(), ROWS[0])
    assert game.answer("ab海") == {"done": False, "user_message": "33% beyond ASCII. Another line."}
    assert game.answer("海空") == {"done": False, "user_message": "100% beyond ASCII. Another line."}
    assert game.answer("abcde") == {"done": True, "user_message": "0% beyond ASCII. Done."}
    # 3 of 10 characters overall (not the mean of the three shares).
    assert game.verify() == {"reward": pytest.approx(0.3), "shares": [pytest.approx(1 / 3), 1.0, 0.0], "characters": 10}


def test_answers_without_characters_count_as_nothing_written() -> None:
    game = Episode(client(turns=2), ROWS[0])
    assert game.answer(None)["user_message"] == "0% beyond ASCII. Another line."
    assert game.answer("   ") == {"done": True, "user_message": "0% beyond ASCII. Done."}
    assert game.verify() == {"reward": 0.0, "shares": [0.0, 0.0], "characters": 0}


def test_only_the_latest_answer_is_judged() -> None:
    game = Episode(client(), ROWS[0])
    game.answer("海")
    assert game.answer(None)["user_message"] == "0% beyond ASCII. Another line."  # the earlier answer is not re-read
    assert game.verify()["shares"] == [1.0, 0.0]


def test_string_content_is_read_too() -> None:
    http = client()
    game = Episode(http, ROWS[0])
    game.items.append({"type": "message", "role": "assistant", "content": "海a"})
    answer = http.post("/step", json={"output": game.items}, headers=game.headers).json()
    assert answer["user_message"] == "50% beyond ASCII. Another line."


def test_caller_mistakes_are_400() -> None:
    http = client(turns=1)
    for path in ("/step", "/verify"):
        unknown = http.post(path, json={"output": [], "response": {"output": []}}, headers={"x-session-id": "nobody"})
        assert unknown.status_code == 400
        assert unknown.json()["error"]["message"] == "unknown session 'nobody'; call /seed_session first"
    game = Episode(http, ROWS[0])
    no_output = http.post("/step", json={}, headers=game.headers)
    assert no_output.status_code == 400 and "output" in no_output.json()["error"]["message"]
    game.answer("a")
    after_the_end = http.post("/step", json={"output": game.items}, headers=game.headers)
    assert after_the_end.status_code == 400
    assert after_the_end.json()["error"]["message"] == "the episode of session 's' is over; call /verify"


def test_verify_frees_the_session_and_sessions_are_independent() -> None:
    server = NonAscii("non_ascii", NonAsciiConfig())
    http = TestClient(server.build_app())
    first, second = Episode(http, ROWS[0], session="a"), Episode(http, ROWS[1], session="b")
    first.answer("海")
    second.answer("a")
    assert first.verify()["reward"] == 1.0 and second.verify()["reward"] == 0.0
    assert len(server.writings) == 0


def test_share_of_nothing_is_zero() -> None:
    assert share(0, 0) == 0.0 and share(1, 4) == 0.25


def test_turns_must_be_positive() -> None:
    with pytest.raises(ValidationError):
        NonAsciiConfig(turns=0)


def test_example_rows_have_distinct_prompts_and_no_tools() -> None:
    assert len(ROWS) >= 6
    prompts = {json.dumps(row["responses_create_params"]["input"]) for row in ROWS}
    assert len(prompts) == len(ROWS)  # a GRPO rollout_func finds a row by its prompt
    for row in ROWS:
        params = row["responses_create_params"]
        assert set(params) == {"input", "max_output_tokens"}  # free sampling: no tools, no tool_choice, no grammar
        assert [m["role"] for m in params["input"]] == ["system", "user"]


def test_config_file_loads() -> None:
    config = load_config([FOLDER / "configs" / "non_ascii.yaml"])
    [(server_class, server_config)] = [validate_instance(instance) for instance in config.instances.values()]
    assert server_class is NonAscii and server_config == NonAsciiConfig(turns=3)
