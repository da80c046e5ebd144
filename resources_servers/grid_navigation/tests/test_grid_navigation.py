"""grid_navigation over HTTP: moves, walls, items, the reward from the final state, mistakes, and the example rows."""

from __future__ import annotations

import json
from collections import deque
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from nemo_gym_tok.config import load_config
from nemo_gym_tok.servers.registry import validate_instance
from resources_servers.grid_navigation.app import SERVER, TOOLS, GridNavigation, GridNavigationConfig

FOLDER = Path(__file__).resolve().parents[1]
ROWS = [json.loads(line) for line in (FOLDER / "data" / "example.jsonl").read_text().splitlines() if line.strip()]

# The north-west corner of a 5x5 grid:   S . K    S start [0, 0], G goal [2, 2], # wall, K key, C coin;
#                                        . # .    the goal counts only while holding the key.
#                                        C . G
GRID = {
    "size": 5,
    "start": [0, 0],
    "goal": [2, 2],
    "walls": [[1, 1]],
    "items": {"key": [0, 2], "coin": [2, 0]},
    "requires_key": True,
}


def client(**fields: Any) -> TestClient:
    return TestClient(SERVER("grid_navigation", GridNavigationConfig(**fields)).build_app())


def seeded(grid: dict[str, Any] = GRID, session: str = "s", **fields: Any) -> TestClient:
    http = client(**fields)
    answer = http.post("/seed_session", json={"grid": grid}, headers={"x-session-id": session})
    assert answer.status_code == 200, answer.text
    return http


def call(http: TestClient, tool: str, arguments: dict[str, Any], session: str = "s") -> str:
    answer = http.post(f"/{tool}", json=arguments, headers={"x-session-id": session})
    assert answer.status_code == 200, answer.text
    return answer.json()["output"]


def verify(http: TestClient, session: str = "s") -> dict[str, Any]:
    answer = http.post("/verify", json={"grid": GRID, "response": {"output": []}}, headers={"x-session-id": session})
    assert answer.status_code == 200, answer.text
    return answer.json()


def test_winning_episode_gets_full_reward() -> None:
    http = seeded()
    assert call(http, "look", {}) == (
        "you are at [0, 0]; the goal is at [2, 2] and needs the key; "
        "blocked: north (the edge of the grid), west (the edge of the grid); "
        "items: key at [0, 2], coin at [2, 0]; holding: nothing"
    )
    assert call(http, "move", {"direction": "east", "steps": 2}) == "moved 2 of 2 east; now at [0, 2]"
    assert call(http, "pick_up", {"item": "key"}) == "picked up the key"
    assert call(http, "move", {"direction": "south", "steps": 2}) == (
        "moved 2 of 2 south; now at [2, 2]; you are on the goal"
    )
    assert "items: coin at [2, 0]; holding: key" in call(http, "look", {})
    assert http.post("/step", json={"output": []}, headers={"x-session-id": "s"}).json() == {"done": True}
    assert verify(http) == {
        "reward": 1.0,
        "final_position": [2, 2],
        "reached_goal": True,
        "moves": 2,
        "holding": ["key"],
    }


def test_goal_without_the_required_key_earns_only_partial_credit() -> None:
    http = seeded()
    call(http, "move", {"direction": "south", "steps": 2})
    call(http, "move", {"direction": "east", "steps": 2})
    result = verify(http)
    assert (result["reward"], result["reached_goal"], result["holding"]) == (0.5, True, [])


@pytest.mark.parametrize(
    ("moves", "fields", "reward"),
    [
        ([], {}, 0.5 * (1 - 4 / 8)),  # start: 4 cells from the goal, the longest distance on 5x5 is 8
        ([("east", 1)], {}, 0.5 * (1 - 3 / 8)),
        ([("east", 1)], {"partial_credit": 1.0}, 1 - 3 / 8),
        ([("east", 1)], {"partial_credit": 0.0}, 0.0),
        ([("south", 3), ("east", 3)], {}, 0.5 * (1 - 2 / 8)),  # overshooting the goal costs distance too
    ],
)
def test_missing_the_goal_earns_credit_shrinking_with_distance(moves: list, fields: dict, reward: float) -> None:
    http = seeded(**fields)
    for direction, steps in moves:
        call(http, "move", {"direction": direction, "steps": steps})
    result = verify(http)
    assert result["reward"] == pytest.approx(reward)
    assert (result["reached_goal"], result["moves"]) == (False, len(moves))


def test_walls_and_edges_stop_a_move() -> None:
    http = seeded()
    assert call(http, "move", {"direction": "north", "steps": 3}) == (
        "moved 0 of 3 north; now at [0, 0]; stopped by the edge of the grid"
    )
    call(http, "move", {"direction": "east", "steps": 1})
    assert call(http, "move", {"direction": "south", "steps": 2}) == (
        "moved 0 of 2 south; now at [0, 1]; stopped by a wall at [1, 1]"
    )
    assert call(http, "move", {"direction": "east", "steps": 3}) == ("moved 3 of 3 east; now at [0, 4]")
    assert call(http, "move", {"direction": "east", "steps": 1}).endswith("stopped by the edge of the grid")
    assert verify(http)["moves"] == 5  # blocked moves are moves the model made


def test_pick_up_tells_what_went_wrong() -> None:
    http = seeded()
    assert call(http, "pick_up", {"item": "key"}) == "there is no key at [0, 0]; look() tells where items are"
    call(http, "move", {"direction": "east", "steps": 2})
    call(http, "pick_up", {"item": "key"})
    assert call(http, "pick_up", {"item": "key"}) == "you already hold the key"
    keyless = seeded({"size": 3, "start": [0, 0], "goal": [2, 2]})
    assert call(keyless, "pick_up", {"item": "coin"}) == "there is no coin on this grid"


@pytest.mark.parametrize(
    ("tool", "arguments", "output"),
    [
        (
            "move",
            {"direction": "up", "steps": 1},
            'error: direction must be one of "north", "south", "east", "west", got "up"',
        ),
        ("move", {"direction": "east", "steps": 5}, "error: steps must be one of 1, 2, 3, got 5"),
        ("move", {"direction": "east", "steps": "2"}, 'error: steps must be one of 1, 2, 3, got "2"'),
        ("move", {"direction": "east", "steps": 2.0}, "error: steps must be one of 1, 2, 3, got 2.0"),
        ("move", {"direction": "east", "steps": True}, "error: steps must be one of 1, 2, 3, got true"),
        ("move", {"direction": "east"}, "error: move needs steps, one of 1, 2, 3"),
        (
            "move",
            {"direction": "east", "steps": 1, "run": True},
            "error: move has no argument run; it takes direction, steps",
        ),
        ("look", {"where": "north"}, "error: look has no argument where; it takes no arguments"),
        ("pick_up", {"item": "sword"}, 'error: item must be one of "key", "coin", got "sword"'),
        ("pick_up", {}, 'error: pick_up needs item, one of "key", "coin"'),
    ],
)
def test_wrong_arguments_are_told_to_the_model(tool: str, arguments: dict[str, Any], output: str) -> None:
    http = seeded()
    assert call(http, tool, arguments) == output
    # A rejected call changes nothing.
    assert verify(http) == {"reward": 0.25, "final_position": [0, 0], "reached_goal": False, "moves": 0, "holding": []}


def test_missing_header_and_unknown_session_are_400() -> None:
    http = client()
    for path, body in [("/seed_session", {"grid": GRID}), ("/move", {"direction": "east", "steps": 2}), ("/look", {})]:
        answer = http.post(path, json=body)
        assert answer.status_code == 400
        assert answer.json()["error"]["message"] == "missing the x-session-id header that names the episode"
    for path, body in [("/look", {}), ("/pick_up", {"item": "key"}), ("/verify", {"response": {"output": []}})]:
        answer = http.post(path, json=body, headers={"x-session-id": "nobody"})
        assert answer.status_code == 400
        assert answer.json()["error"]["message"] == "unknown session 'nobody'; call /seed_session first"


@pytest.mark.parametrize(
    ("grid", "message"),
    [
        (None, "the row's grid is invalid: Input should be a valid dictionary"),
        ({**GRID, "goal": [5, 2]}, "the row's grid is invalid: goal [5, 2] is outside the 5x5 grid"),
        ({**GRID, "walls": [[0, 2]]}, "the row's grid is invalid: items.key [0, 2] is on a wall"),
        ({**GRID, "items": {}}, "the row's grid is invalid: requires_key is true but items has no key"),
        ({**GRID, "items": {"gem": [1, 2]}}, "the row's grid is invalid: items.gem: Input should be 'key' or 'coin'"),
        ({**GRID, "size": 1}, "the row's grid is invalid: size: Input should be greater than or equal to 2"),
    ],
)
def test_an_invalid_grid_is_a_400_naming_the_problem(grid: Any, message: str) -> None:
    answer = client().post("/seed_session", json={"grid": grid}, headers={"x-session-id": "s"})
    assert answer.status_code == 400
    assert answer.json()["error"]["message"].startswith(message)


def test_verify_frees_the_session_and_seeding_again_restarts() -> None:
    server = GridNavigation("grid_navigation", GridNavigationConfig())
    http = TestClient(server.build_app())
    http.post("/seed_session", json={"grid": GRID}, headers={"x-session-id": "s"})
    call(http, "move", {"direction": "east", "steps": 2})
    http.post("/seed_session", json={"grid": GRID}, headers={"x-session-id": "s"})
    assert "you are at [0, 0]" in call(http, "look", {})
    verify(http)
    assert len(server.walkers) == 0
    assert http.post("/look", json={}, headers={"x-session-id": "s"}).status_code == 400


def test_a_verify_body_without_the_episode_is_400_and_keeps_the_session() -> None:
    http = seeded()
    call(http, "move", {"direction": "east", "steps": 2})
    # What a model reaches by calling a tool named "verify": its arguments, no episode.
    answer = http.post("/verify", json={"reason": "done"}, headers={"x-session-id": "s"})
    assert answer.status_code == 400 and "response.output" in answer.json()["error"]["message"]
    assert verify(http)["final_position"] == [0, 2]


def test_sessions_are_independent() -> None:
    http = seeded(session="a")
    http.post("/seed_session", json={"grid": GRID}, headers={"x-session-id": "b"})
    call(http, "move", {"direction": "east", "steps": 2}, session="a")
    assert "you are at [0, 0]" in call(http, "look", {}, session="b")
    assert verify(http, "a")["final_position"] == [0, 2]


def test_example_rows_follow_the_row_rules() -> None:
    assert len(ROWS) >= 6
    for row in ROWS:
        params = row["responses_create_params"]
        assert [m["role"] for m in params["input"]] == ["system", "user"]
        assert (params["tool_choice"], params["parallel_tool_calls"], params["max_output_tokens"]) == (
            "required",
            False,
            64,
        )
        assert params["tools"] == list(TOOLS.values())
        for tool in params["tools"]:
            assert tool["type"] == "function" and tool["strict"] is True
            parameters = tool["parameters"]
            assert parameters["type"] == "object" and parameters["additionalProperties"] is False
            assert sorted(parameters["required"]) == sorted(parameters["properties"])
            for spec in parameters["properties"].values():
                assert spec["enum"] and all(isinstance(v, str) or type(v) is int for v in spec["enum"])


def shortest_plan(grid: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """Tool calls of a shortest winning episode, found by breadth-first search over (cell, holding the key)."""
    steps = {"north": (-1, 0), "south": (1, 0), "east": (0, 1), "west": (0, -1)}
    walls = {tuple(wall) for wall in grid.get("walls", [])}
    key = tuple(grid["items"]["key"]) if grid.get("requires_key") else None
    start = (tuple(grid["start"]), key is None)
    plans: dict[Any, list[tuple[str, dict[str, Any]]]] = {start: []}
    queue = deque([start])
    while queue:
        cell, has_key = state = queue.popleft()
        if cell == tuple(grid["goal"]) and has_key:
            return plans[state]
        options = [((cell, True), ("pick_up", {"item": "key"}))] if cell == key and not has_key else []
        for name, (d_row, d_col) in steps.items():
            ahead = (cell[0] + d_row, cell[1] + d_col)
            if all(0 <= v < grid["size"] for v in ahead) and ahead not in walls:
                options.append(((ahead, has_key), ("move", {"direction": name, "steps": 1})))
        for next_state, action in options:
            if next_state not in plans:
                plans[next_state] = [*plans[state], action]
                queue.append(next_state)
    raise AssertionError(f"no winning episode for {grid}")


@pytest.mark.parametrize("index", range(len(ROWS)))
def test_every_example_row_can_be_won(index: int) -> None:
    row = ROWS[index]
    http = client()
    assert http.post("/seed_session", json=row, headers={"x-session-id": "s"}).status_code == 200
    for tool, arguments in shortest_plan(row["grid"]):
        assert not call(http, tool, arguments).startswith("error")
    assert verify(http)["reward"] == 1.0


def test_config_file_loads() -> None:
    config = load_config([FOLDER / "configs" / "grid_navigation.yaml"])
    [(server_class, server_config)] = [validate_instance(instance) for instance in config.instances.values()]
    assert server_class is GridNavigation and isinstance(server_config, GridNavigationConfig)


def test_look_shows_a_picture_of_the_grid_when_configured() -> None:
    import base64
    import io

    from PIL import Image

    from resources_servers.grid_navigation.picture import CELL_PIXELS, COLOURS

    http = seeded(look_shows_picture=True)
    text, picture = call(http, "look", {})
    assert text == {"type": "input_text", "text": call(seeded(), "look", {})}
    assert picture["type"] == "input_image" and picture["image_url"].startswith("data:image/png;base64,")
    image = Image.open(io.BytesIO(base64.b64decode(picture["image_url"].split(",", 1)[1])))
    assert image.size == (5 * CELL_PIXELS, 5 * CELL_PIXELS)
    centre = CELL_PIXELS // 2
    assert image.getpixel((centre, centre)) == COLOURS["walker"]  # [0, 0]
    assert image.getpixel((CELL_PIXELS + centre, CELL_PIXELS + centre)) == COLOURS["wall"]  # [1, 1]
    assert image.getpixel((2 * CELL_PIXELS + centre, 2 * CELL_PIXELS + centre)) == COLOURS["goal"]  # [2, 2]
    assert call(http, "move", {"direction": "east", "steps": 1}) == "moved 1 of 1 east; now at [0, 1]"  # text only
