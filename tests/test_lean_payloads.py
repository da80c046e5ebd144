"""Lean payloads (issue 11, point 2): the agent sends the model only the latest call's bundle, environments none,
and the rollout record (schema_version 2) stores each call's ids once; version 1 and 2 records read the same."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from hypothesis import given
from hypothesis import strategies as st

from nemo_gym_tok.cli.main import main
from nemo_gym_tok.collect import ResumeError, collect, read_failures, repair_output
from nemo_gym_tok.records.contiguity import bundled_turns, check_contiguous, check_file
from nemo_gym_tok.records.rollout_record import (
    PROMPT_PREFIX_LENGTH_KEY,
    PROMPT_SUFFIX_KEY,
    UnknownSchemaVersionError,
    full_output,
    packed_record,
)
from nemo_gym_tok.records.training import rollout_to_training_sequence, rollout_to_training_sequences
from nemo_gym_tok.servers.client import SESSION_HEADER, ServerClient
from nemo_gym_tok.servers.http_pool import pool_limits
from nemo_gym_tok.servers.inprocess import serve_in_thread
from nemo_gym_tok.splice import PREFIX_KEY, find_prefix_source
from nemo_gym_tok.types.tokens import BUNDLE_FIELDS, TELEMETRY_FIELDS
from resources_servers.number_guess.app import SERVER as NumberGuess
from responses_api_agents.simple_agent.app import SimpleAgent, SimpleAgentConfig
from responses_api_models.vllm_model.app import VLLMModel, VLLMModelConfig
from tests.fixtures.collect_agent import AgentBehaviour, create_agent_app

TURNS = 20
TURN_PROMPT_IDS = 1200
"""Ids each call's prompt adds (the new user turn and template text): 20 turns reach a ~30k context, as in the issue."""
TURN_GENERATION_IDS = 300
TOKEN_FIELDS = {*BUNDLE_FIELDS, *TELEMETRY_FIELDS}
ROW = {
    "responses_create_params": {
        "input": [{"role": "user", "content": "Guess a number from 1 to 100."}],
        "max_output_tokens": TURN_GENERATION_IDS,
    },
    "secret": 50,  # the stand-in always answers 42: "Higher." every round, so the episode runs all TURNS
}


def turn_ids(prefix_length: int, count: int, base: int) -> list[int]:
    """Ids that differ from turn to turn, so a prompt rebuilt from the wrong call's ids would show."""
    return [base + (prefix_length + i) % 997 for i in range(count)]


def says_42(messages: list[dict[str, Any]]) -> dict[str, Any]:
    return {"role": "assistant", "content": "42"}


def hooked_vllm_stand_in(
    answer: Callable[[list[dict[str, Any]]], dict[str, Any]] = says_42, received: list[dict[str, Any]] | None = None
) -> FastAPI:
    """vLLM with the hook, as the adapter sees it: the prompt is the required prefix (explicit, or the last bundled
    message's) plus this turn's ids; without a bundle the prefix is lost, and the record shows it. `answer` gives the
    assistant message for the chat messages received; `received` collects the bodies."""
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> JSONResponse:
        body = await request.json()
        if received is not None:
            received.append(body)
        source = find_prefix_source(body["messages"], body.get(PREFIX_KEY))
        prefix = [] if source is None else source.prefix
        prompt = prefix + turn_ids(len(prefix), TURN_PROMPT_IDS, 1000)
        generated = turn_ids(len(prompt), TURN_GENERATION_IDS, 3000)
        return JSONResponse(
            {
                "id": "chatcmpl-stand-in",
                "object": "chat.completion",
                "created": 0,
                "model": body["model"],
                "prompt_token_ids": prompt,
                "choices": [
                    {
                        "index": 0,
                        "finish_reason": "stop",
                        "token_ids": generated,
                        "logprobs": {"content": [{"token": f"token_id:{t}", "logprob": -0.25} for t in generated]},
                        "message": answer(body["messages"]),
                    }
                ],
                "usage": {
                    "prompt_tokens": len(prompt),
                    "completion_tokens": len(generated),
                    "total_tokens": len(prompt) + len(generated),
                },
            }
        )

    return app


@dataclass
class Recorded:
    """What the agent sent: raw bodies to the model, and /step and /verify bodies to the environment."""

    model_requests: list[bytes] = field(default_factory=list)
    environment_bodies: list[tuple[str, dict[str, Any]]] = field(default_factory=list)


def recording_relay(target: str, recorded: Recorded, before: Callable[[int], None] | None = None) -> FastAPI:
    """Between the agent and the adapter: keeps each request's bytes as the agent sent them, forwards it whole;
    `before` is called with each request's number first."""
    app = FastAPI()
    client = httpx.AsyncClient(base_url=target, timeout=120, limits=pool_limits())

    @app.post("/{path:path}")
    async def forward(path: str, request: Request) -> Response:
        raw = await request.body()
        if before is not None:
            before(len(recorded.model_requests))
        recorded.model_requests.append(raw)
        headers = {"content-type": "application/json", SESSION_HEADER: request.headers.get(SESSION_HEADER, "")}
        answer = await client.post(f"/{path}", content=raw, headers=headers)
        return Response(answer.content, status_code=answer.status_code, media_type="application/json")

    @app.delete("/{path:path}")
    async def forward_delete(path: str) -> Response:  # the agent's goodbye to its kept response: not recorded
        answer = await client.delete(f"/{path}")
        return Response(answer.content, status_code=answer.status_code, media_type="application/json")

    return app


def recording_number_guess(recorded: Recorded) -> NumberGuess:
    class RecordingNumberGuess(NumberGuess):
        async def step(self, session_id: str, body: dict[str, Any]) -> dict[str, Any]:
            recorded.environment_bodies.append(("/step", body))
            return await super().step(session_id, body)

        async def verify(self, session_id: str, body: dict[str, Any]) -> dict[str, Any]:
            recorded.environment_bodies.append(("/verify", body))
            return await super().verify(session_id, body)

    return RecordingNumberGuess("env", NumberGuess.config_class(max_rounds=TURNS))


@dataclass
class Episode:
    record: dict[str, Any]
    recorded: Recorded


def play(
    send_token_bundles: bool = True,
    chain_responses: bool = False,
    received: list[dict[str, Any]] | None = None,
    before: Callable[[int, VLLMModel], None] | None = None,
) -> Episode:
    """One 20-call episode through agent, adapter and the stand-in. Chaining is off by default here: these tests are
    about the whole-history requests an agent sends a server that keeps no responses (tests/test_response_chain.py
    has the chained ones). `received` collects the bodies the stand-in got; `before(n, adapter)` runs before the agent's
    n-th request reaches the adapter."""
    recorded = Recorded()
    with ExitStack() as stack:
        vllm = stack.enter_context(serve_in_thread(hooked_vllm_stand_in(received=received)))
        adapter = VLLMModel(
            "policy_model", VLLMModelConfig(base_url=vllm, model="m", splice="hook", return_token_id_information=True)
        )
        adapter_url = stack.enter_context(serve_in_thread(adapter.build_app()))
        servers = {
            "policy_model": stack.enter_context(
                serve_in_thread(
                    recording_relay(adapter_url, recorded, None if before is None else lambda n: before(n, adapter))
                )
            ),
            "env": stack.enter_context(serve_in_thread(recording_number_guess(recorded).build_app())),
        }
        config = SimpleAgentConfig(
            model_server="policy_model",
            resources_server="env",
            max_steps=TURNS,
            send_token_bundles=send_token_bundles,
            chain_responses=chain_responses,
        )
        agent = stack.enter_context(serve_in_thread(SimpleAgent("agent", config, ServerClient(servers)).build_app()))
        answer = httpx.post(f"{agent}/run", json=ROW, timeout=120)
    assert answer.status_code == 200, answer.text
    return Episode(answer.json(), recorded)


@pytest.fixture(scope="module")
def episode() -> Episode:
    return play()


def bundled_inputs(request: dict[str, Any]) -> list[dict[str, Any]]:
    return [item for item in request["input"] if any(key in item for key in BUNDLE_FIELDS)]


def token_keys(value: Any) -> set[str]:
    """Every key anywhere in `value` that is a bundle, telemetry or packed-prompt field."""
    if isinstance(value, dict):
        found = {key for key in value if key in TOKEN_FIELDS or key in (PROMPT_PREFIX_LENGTH_KEY, PROMPT_SUFFIX_KEY)}
        return found.union(*(token_keys(v) for v in value.values()))
    if isinstance(value, list):
        return set().union(*(token_keys(v) for v in value))
    return set()


def test_each_model_request_carries_only_the_previous_calls_bundle(episode: Episode) -> None:
    requests = [json.loads(raw) for raw in episode.recorded.model_requests]
    turns = bundled_turns(episode.record)
    assert len(requests) == len(turns) == TURNS
    assert bundled_inputs(requests[0]) == []
    for number, request in enumerate(requests[1:], start=1):
        (bundled,) = bundled_inputs(request)  # one item: the previous call's last output item
        previous = turns[number - 1]
        assert bundled["prompt_token_ids"] == previous.prompt_token_ids
        assert bundled["generation_token_ids"] == previous.generation_token_ids
        assert bundled["content"][0]["text"] == "42"
        ids_sent = sum(len(item.get(name) or ()) for item in request["input"] for name in BUNDLE_FIELDS[:2])
        assert ids_sent == len(previous.prompt_token_ids) + len(previous.generation_token_ids)
    # ...and the hook still got its prefix: every call's prompt extends the one before it.
    check_contiguous(turns)


def test_request_bytes_grow_only_by_the_new_turn(episode: Episode) -> None:
    """P5's measurement: request bytes at turns 1, 10 and 20 of one ~30k-id episode, against what resending every
    bundle (the agent before lean payloads) would have sent."""
    sizes = [len(raw) for raw in episode.recorded.model_requests]
    turns = bundled_turns(episode.record)
    resent = [
        len(json.dumps(every_bundle_request(json.loads(raw), turns[:k])))
        for k, raw in enumerate(episode.recorded.model_requests)
    ]
    print(
        f"\nagent -> model request bytes at turn 1/10/20: {sizes[0]}/{sizes[9]}/{sizes[19]} "
        f"(every bundle resent: {resent[0]}/{resent[9]}/{resent[19]}); "
        f"prompt ids at turn 20: {len(turns[19].prompt_token_ids)}"
    )
    growth = [later - earlier for earlier, later in zip(sizes[1:], sizes[2:])]
    # Each turn adds one prompt's and one generation's ids (and two short items): the same bytes every turn, give or
    # take the ids' digits. Resending every bundle added the whole history again each turn.
    assert max(growth) < 1.2 * min(growth)
    assert sizes[19] - sizes[9] < 1.2 * 10 * growth[0]
    assert resent[19] > 8 * sizes[19]


def every_bundle_request(request: dict[str, Any], turns: list[Any]) -> dict[str, Any]:
    """`request` as the agent sent it before lean payloads: every earlier call's bundle on its item."""
    bundled = iter(turns)
    items = []
    for item in request["input"]:
        if item.get("type") == "message" and item.get("role") == "assistant":
            turn = next(bundled)
            item = {
                **item,
                "prompt_token_ids": turn.prompt_token_ids,
                "generation_token_ids": turn.generation_token_ids,
                "generation_log_probs": turn.generation_log_probs,
            }
        items.append(item)
    return {**request, "input": items}


def test_environments_get_no_token_fields(episode: Episode) -> None:
    paths = [path for path, _ in episode.recorded.environment_bodies]
    assert paths == ["/step"] * TURNS + ["/verify"]
    for path, body in episode.recorded.environment_bodies:
        assert token_keys(body) == set(), path
    steps = [body for path, body in episode.recorded.environment_bodies if path == "/step"]
    answers = [item["content"][0]["text"] for item in steps[-1]["output"] if item.get("role") == "assistant"]
    assert answers == ["42"] * TURNS
    assert episode.record["guesses"] == [42] * TURNS  # the environment judged the episode as before


def test_record_is_version_2_and_stores_each_id_once(episode: Episode) -> None:
    record = episode.record
    assert record["schema_version"] == 2
    output = record["response"]["output"]
    packed = [item for item in output if PROMPT_PREFIX_LENGTH_KEY in item]
    assert len(packed) == record["response"]["model_calls"] == TURNS
    assert not any("prompt_token_ids" in item for item in output)
    stored = sum(len(item[PROMPT_SUFFIX_KEY]) + len(item["generation_token_ids"]) for item in packed)
    last = bundled_turns(record)[-1]
    assert stored == len(last.prompt_token_ids) + len(last.generation_token_ids)  # linear: every id once
    assert packed[0][PROMPT_PREFIX_LENGTH_KEY] == 0
    assert all(
        p[PROMPT_PREFIX_LENGTH_KEY] == TURN_PROMPT_IDS * (n + 1) + TURN_GENERATION_IDS * (n + 1)
        for n, p in enumerate(packed[1:])
    )
    assert all(item["token_source"] for item in packed)  # telemetry stays on its call's item


def test_stripped_bundles_lose_the_prefix_and_the_record_shows_it() -> None:
    """send_token_bundles: false (the ablation) sends no bundle at all; the record keeps every call's ids."""
    stripped = play(send_token_bundles=False)
    requests = [json.loads(raw) for raw in stripped.recorded.model_requests]
    assert all(token_keys(request) == set() for request in requests)
    turns = bundled_turns(stripped.record)
    assert len(turns) == TURNS
    assert all(len(turn.prompt_token_ids) == TURN_PROMPT_IDS for turn in turns)  # no prefix reached the stand-in


def write_jsonl(path: Path, records: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


def as_version_1(record: dict[str, Any]) -> dict[str, Any]:
    """The same record as an older agent wrote it: full prompt ids on each bundled item, no schema_version."""
    unversioned = {key: value for key, value in record.items() if key != "schema_version"}
    return {**unversioned, "response": {**record["response"], "output": full_output(record)}}


def test_version_1_and_2_files_check_and_train_the_same(
    episode: Episode, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    version_2 = episode.record
    version_1 = as_version_1(version_2)
    assert "schema_version" not in version_1 and version_1["response"]["output"][0]["prompt_token_ids"]
    assert packed_record(version_1)["response"]["output"] == version_2["response"]["output"]
    v1_file = write_jsonl(tmp_path / "v1.jsonl", [version_1])
    v2_file = write_jsonl(tmp_path / "v2.jsonl", [version_2])
    for path in (v1_file, v2_file):
        assert main(["check", str(path)]) == 0
        assert "token-contiguous rollouts: 1/1" in capsys.readouterr().out
    assert check_file(v1_file) == check_file(v2_file)
    assert rollout_to_training_sequence(version_1) == rollout_to_training_sequence(version_2)
    assert len(v2_file.read_bytes()) * 5 < len(v1_file.read_bytes())


def segmented_v1_record() -> dict[str, Any]:
    """A hand-built version 1 record with what packing must keep: a prompt that replaces the previous end token,
    and a call that starts a new token segment."""

    def item(prompt: list[int], generation: list[int], **splice: Any) -> dict[str, Any]:
        return {
            "type": "message",
            "role": "assistant",
            "content": "x",
            "prompt_token_ids": prompt,
            "generation_token_ids": generation,
            "generation_log_probs": [-0.5] * len(generation),
            "prefix_splice": {"applied": True, "template_differed": False, "replaced_tokens": 0, **splice},
        }

    return {
        "response": {
            "output": [
                {"type": "message", "role": "user", "content": "hi"},
                item([1, 2], [3, 9]),
                item([1, 2, 3, 8, 4], [5], end_token_replaced=True),  # 9 gave way to the template's closing 8
                item([1, 6], [7], new_segment=True),  # the harness edited history: ids start afresh
            ]
        },
        "reward": 0.5,
    }


def test_packing_keeps_replaced_end_tokens_and_new_segments() -> None:
    version_1 = segmented_v1_record()
    version_2 = packed_record(version_1)
    packed = [item for item in version_2["response"]["output"] if PROMPT_PREFIX_LENGTH_KEY in item]
    assert [(p[PROMPT_PREFIX_LENGTH_KEY], p[PROMPT_SUFFIX_KEY]) for p in packed] == [(0, [1, 2]), (3, [8, 4]), (1, [6])]
    assert rollout_to_training_sequences(version_1) == rollout_to_training_sequences(version_2)
    assert len(rollout_to_training_sequences(version_2)) == 2


ids = st.lists(st.integers(0, 5), max_size=6)


@given(st.lists(st.tuples(st.integers(0, 12), ids, ids), min_size=1, max_size=6))
def test_packing_is_lossless_for_any_prompts(calls: list[tuple[int, list[int], list[int]]]) -> None:
    """Prompts that keep some of the ids before them, or drift from them anywhere, rebuild exactly."""
    output: list[dict[str, Any]] = []
    before: list[int] = []
    for kept, added, generated in calls:
        prompt = before[:kept] + added
        output.append(
            {
                "type": "message",
                "role": "assistant",
                "prompt_token_ids": prompt,
                "generation_token_ids": generated,
                "generation_log_probs": [-1.0] * len(generated),
            }
        )
        output.append({"type": "message", "role": "user", "content": "next"})
        before = prompt + generated
    version_1 = {"response": {"output": output}}
    version_2 = packed_record(version_1)
    assert version_2["schema_version"] == 2
    assert full_output(version_2) == output
    stored = sum(len(item[PROMPT_SUFFIX_KEY]) for item in version_2["response"]["output"] if PROMPT_SUFFIX_KEY in item)
    assert stored <= sum(len(item.get("prompt_token_ids", ())) for item in output)


def test_a_non_contiguous_record_stays_non_contiguous_once_packed(tmp_path: Path) -> None:
    version_1 = segmented_v1_record()
    version_1["response"]["output"][2]["prefix_splice"]["end_token_replaced"] = False
    version_2 = packed_record(version_1)
    reports = [
        check_file(write_jsonl(tmp_path / f"{name}.jsonl", [record]))
        for name, record in (("v1", version_1), ("v2", version_2))
    ]
    assert reports[0] == reports[1] and reports[1].contiguous == 0
    assert "model call 1 is not token-contiguous" in reports[1].failures[0]


def test_an_unknown_version_is_refused_naming_it(
    episode: Episode, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    newer = {**episode.record, "schema_version": 3}
    with pytest.raises(UnknownSchemaVersionError, match="schema_version 3 is newer than this nemo_gym_tok reads"):
        rollout_to_training_sequence(newer)
    path = write_jsonl(tmp_path / "newer.jsonl", [episode.record, newer])
    assert main(["check", str(path)]) == 1
    out = capsys.readouterr().out
    assert "token-contiguous rollouts: 1/2" in out and "line 2: rollout record schema_version 3 is newer" in out
    with pytest.raises(UnknownSchemaVersionError, match="'2' is not a rollout record version"):
        bundled_turns({**episode.record, "schema_version": "2"})


def test_resume_reads_both_versions_and_refuses_an_unknown_one(episode: Episode, tmp_path: Path) -> None:
    rollout_id = {"row": 0, "repeat": 0, "row_hash": "0" * 16, "occurrence": 0, "agent": "agent"}
    version_2 = {**episode.record, "rollout_id": rollout_id}
    version_1 = {**as_version_1(episode.record), "rollout_id": {**rollout_id, "repeat": 1}}
    output = write_jsonl(tmp_path / "out.jsonl", [version_1, version_2])
    ids, truncated = repair_output(output)
    assert [rid.key.repeat for rid in ids] == [1, 0] and not truncated
    write_jsonl(output, [version_2, {**version_2, "schema_version": 7}])
    with pytest.raises(ResumeError, match=r"out.jsonl:2: rollout record schema_version 7 is newer .* another --output"):
        repair_output(output)


def test_collect_does_not_write_a_record_it_could_not_read_back(tmp_path: Path) -> None:
    """The stand-in agent echoes the row's fields into its record, so this row makes a version 9 record."""
    rows = write_jsonl(tmp_path / "rows.jsonl", [{"id": 1}, {"id": 2, "schema_version": 9}])
    with serve_in_thread(create_agent_app(AgentBehaviour())) as agent_url:
        summary = asyncio.run(collect(rows, tmp_path / "out.jsonl", agent_url, progress=False, timeout=30))
    assert (summary.done_now, summary.failed) == (1, 1)
    (failure,) = read_failures(summary.failures_path).values()
    assert "cannot read back: rollout record schema_version 9 is newer" in failure["reason"]
