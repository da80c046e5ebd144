"""number_guess over HTTP: user-turn replies from /step, round limits, the reward, mistakes, and the example rows."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from pydantic import ValidationError

from nemo_gym_tok.config import load_config
from nemo_gym_tok.servers.registry import validate_instance
from resources_servers.number_guess.app import FAR_AWAY, NO_NUMBER, SERVER, NumberGuess, NumberGuessConfig

FOLDER = Path(__file__).resolve().parents[1]
ROWS = [json.loads(line) for line in (FOLDER / "data" / "example.jsonl").read_text().splitlines() if line.strip()]


def row_with(secret: Any) -> dict[str, Any]:
    return {**ROWS[0], "secret": secret}


class Episode:
    """Plays the agent's part: keeps the episode's items, sends each model answer to /step, appends the user turns."""

    def __init__(self, http: TestClient, row: dict[str, Any], session: str = "s") -> None:
        self.http, self.headers = http, {"x-session-id": session}
        assert http.post("/seed_session", json=row, headers=self.headers).status_code == 200
        self.row = row
        opening = row["responses_create_params"]["input"][-1]
        self.items: list[dict[str, Any]] = [{"type": "message", **opening}]

    def answer(self, text: str | None) -> dict[str, Any]:
        """The model's turn (`text` None: a turn with reasoning only), then the environment's step."""
        if text is None:
            self.items.append({"type": "reasoning", "summary": [{"type": "summary_text", "text": "hmm 12"}]})
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
    return TestClient(SERVER("number_guess", NumberGuessConfig(**fields)).build_app())


def test_winning_episode_gets_full_reward() -> None:
    game = Episode(client(), row_with(37))
    assert game.answer("50") == {"done": False, "user_message": "Lower."}
    assert game.answer("25") == {"done": False, "user_message": "Higher."}
    assert game.answer("My guess is 37.") == {"done": True, "user_message": "Correct!"}
    assert game.verify() == {"reward": 1.0, "guesses": [50, 25, 37], "rounds": 3}


def test_binary_search_wins_every_example_row() -> None:
    http = client(max_rounds=7)  # 7 halvings find any number from 1 to 100
    for index, row in enumerate(ROWS):
        game, low, high = Episode(http, row, session=f"row{index}"), 1, 100
        while True:
            guess = (low + high) // 2
            result = game.answer(str(guess))
            if result["done"]:
                break
            low, high = (guess + 1, high) if result["user_message"] == "Higher." else (low, guess - 1)
        assert game.verify()["reward"] == 1.0, row["secret"]


def test_losing_episode_ends_after_max_rounds() -> None:
    game = Episode(client(), row_with(37))
    for _ in range(3):
        assert game.answer("50") == {"done": False, "user_message": "Lower."}
    assert game.answer("50") == {"done": True, "user_message": "Lower."}
    assert game.verify() == {"reward": 0.0, "guesses": [50, 50, 50, 50], "rounds": 4}


def test_answers_without_a_number_still_play_every_round() -> None:
    game = Episode(client(max_rounds=3), row_with(37))
    assert game.answer("the cat sat") == {"done": False, "user_message": NO_NUMBER}
    assert game.answer(None) == {"done": False, "user_message": NO_NUMBER}  # reasoning only: its digits don't count
    assert game.answer("") == {"done": True, "user_message": NO_NUMBER}
    assert game.verify() == {"reward": 0.0, "guesses": [None, None, None], "rounds": 3}


@pytest.mark.parametrize(
    ("text", "guess", "reply"),
    [
        ("I guess 20, or maybe 40", 20, "Higher."),
        ("-5", -5, "Higher."),
        ("37.9", 37, "Correct!"),
        ("x" + "9" * 5000, FAR_AWAY, "Lower."),
        ("between 1 and 100: 99", 1, "Higher."),  # the first integer, whatever it means
    ],
)
def test_the_first_integer_of_the_answer_is_the_guess(text: str, guess: int, reply: str) -> None:
    game = Episode(client(max_rounds=1), row_with(37))
    assert game.answer(text) == {"done": True, "user_message": reply}
    assert game.verify()["guesses"] == [guess]


def test_only_the_latest_answer_is_judged() -> None:
    game = Episode(client(), row_with(37))
    assert game.answer("50")["user_message"] == "Lower."
    # The latest turn has no message: the earlier "50" belongs to the round already answered, not to this one.
    assert game.answer(None) == {"done": False, "user_message": NO_NUMBER}
    assert game.verify()["guesses"] == [50, None]


def test_string_content_is_read_too() -> None:
    http = client()
    game = Episode(http, row_with(37))
    game.items.append({"type": "message", "role": "assistant", "content": "37"})
    assert http.post("/step", json={"output": game.items}, headers=game.headers).json()["user_message"] == "Correct!"


def test_max_rounds_must_be_positive() -> None:
    with pytest.raises(ValidationError):
        NumberGuessConfig(max_rounds=0)


def test_caller_mistakes_are_400() -> None:
    http = client()
    missing = http.post("/step", json={"output": []})
    assert missing.status_code == 400
    assert missing.json()["error"]["message"] == "missing the x-session-id header that names the episode"
    for path in ("/step", "/verify"):
        unknown = http.post(path, json={"output": [], "response": {"output": []}}, headers={"x-session-id": "nobody"})
        assert unknown.status_code == 400
        assert unknown.json()["error"]["message"] == "unknown session 'nobody'; call /seed_session first"
    game = Episode(http, row_with(37))
    no_output = http.post("/step", json={}, headers=game.headers)
    assert no_output.status_code == 400 and "output" in no_output.json()["error"]["message"]
    game.answer("37")
    after_the_end = http.post("/step", json={"output": game.items}, headers=game.headers)
    assert after_the_end.status_code == 400
    assert after_the_end.json()["error"]["message"] == "the game of session 's' is over; call /verify"


@pytest.mark.parametrize("secret", [None, 0, 101, True, "42", 42.0])
def test_a_row_without_a_valid_secret_is_400(secret: Any) -> None:
    row = row_with(secret) if secret is not None else {k: v for k, v in ROWS[0].items() if k != "secret"}
    answer = client().post("/seed_session", json=row, headers={"x-session-id": "s"})
    assert answer.status_code == 400
    assert answer.json()["error"]["message"] == "the row needs secret: an integer from 1 to 100"


def test_verify_frees_the_session() -> None:
    server = NumberGuess("number_guess", NumberGuessConfig())
    http = TestClient(server.build_app())
    game = Episode(http, row_with(37))
    assert game.verify() == {"reward": 0.0, "guesses": [], "rounds": 0}  # verified before any step
    assert len(server.games) == 0
    assert http.post("/step", json={"output": game.items}, headers=game.headers).status_code == 400


def test_a_verify_body_without_the_episode_is_400_and_keeps_the_session() -> None:
    http = client()
    game = Episode(http, row_with(37))
    game.answer("37")
    answer = http.post("/verify", json={"secret": 37}, headers=game.headers)
    assert answer.status_code == 400 and "response.output" in answer.json()["error"]["message"]
    assert game.verify()["reward"] == 1.0


def test_sessions_are_independent() -> None:
    http = client()
    first, second = Episode(http, row_with(37), session="a"), Episode(http, row_with(80), session="b")
    assert first.answer("50")["user_message"] == "Lower."
    assert second.answer("50")["user_message"] == "Higher."
    assert second.answer("80")["done"] and first.verify()["reward"] == 0.0 and second.verify()["reward"] == 1.0


def test_example_rows_follow_the_row_rules() -> None:
    assert len(ROWS) >= 6
    for row in ROWS:
        params = row["responses_create_params"]
        assert "tools" not in params and params["max_output_tokens"] == 24
        assert [m["role"] for m in params["input"]] == ["system", "user"]
        assert "1 to 100" in params["input"][-1]["content"] and "Higher." in params["input"][-1]["content"]
        assert type(row["secret"]) is int and 1 <= row["secret"] <= 100


def test_config_file_loads() -> None:
    config = load_config([FOLDER / "configs" / "number_guess.yaml"])
    [(server_class, server_config)] = [validate_instance(instance) for instance in config.instances.values()]
    assert server_class is NumberGuess and server_config == NumberGuessConfig(max_rounds=4)
