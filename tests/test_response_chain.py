"""`previous_response_id` (issue 40, item 3): the adapter keeps each answered history, the agent sends the new items
only, and vLLM gets what a whole-history request would have given it, bundle for bundle."""

from __future__ import annotations

import json
from contextlib import ExitStack
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request
from hypothesis import given
from hypothesis import strategies as st

from nemo_gym_tok.contract.conversion import responses_to_chat_request
from nemo_gym_tok.records.contiguity import bundled_turns, check_contiguous
from nemo_gym_tok.records.training import rollout_to_training_sequence
from nemo_gym_tok.servers.api_errors import ApiError
from nemo_gym_tok.servers.base import ResourcesServer, ToolHandler
from nemo_gym_tok.servers.client import ServerClient
from nemo_gym_tok.servers.inprocess import serve_in_thread
from nemo_gym_tok.types.responses import PREVIOUS_NOT_FOUND, ResponsesRequest
from responses_api_agents.simple_agent.app import SimpleAgent, SimpleAgentConfig
from responses_api_models.vllm_model.app import VLLMModel, VLLMModelConfig
from responses_api_models.vllm_model.chat_form import chat_form, kept_chat_messages
from responses_api_models.vllm_model.response_chain import ResponseChain
from tests.test_lean_payloads import (
    ROW,
    TURNS,
    Episode,
    Recorded,
    bundled_inputs,
    hooked_vllm_stand_in,
    play,
    recording_number_guess,
    recording_relay,
    token_keys,
)


def answer(response_id: str, text: str, ids: int, start: int = 0) -> dict[str, Any]:
    """A Responses answer whose last item carries a bundle of `ids` prompt ids."""
    item = {
        "type": "message",
        "role": "assistant",
        "content": [{"type": "output_text", "text": text}],
        "prompt_token_ids": list(range(start, start + ids)),
        "generation_token_ids": [7],
        "generation_log_probs": [-0.5],
    }
    return {"id": response_id, "object": "response", "output": [item]}


def kept_turn(chain: ResponseChain, raw: dict[str, Any], response_id: str, ids: int) -> dict[str, Any]:
    call = chain.expand(raw)
    return chain.answered(answer(response_id, "ok", ids), call)


def test_a_continued_call_gets_the_kept_history_with_only_the_latest_bundle() -> None:
    chain = ResponseChain(max_ids=1000)
    first = kept_turn(chain, {"input": "hi", "instructions": "be brief"}, "resp_1", 10)
    assert (first["store"], first["previous_response_id"]) == (True, None)
    second = kept_turn(chain, {"previous_response_id": "resp_1", "input": "more"}, "resp_2", 20)
    assert second["previous_response_id"] == "resp_1"
    call = chain.expand({"previous_response_id": "resp_2", "input": [{"role": "user", "content": "again"}]})
    body = call.body
    assert "previous_response_id" not in body and body["instructions"] == "be brief"
    roles = [item.get("role") for item in body["input"]]
    assert roles == ["user", "assistant", "user", "assistant", "user"]
    bundled = [item for item in body["input"] if "prompt_token_ids" in item]
    assert [len(item["prompt_token_ids"]) for item in bundled] == [20]  # the first call's bundle is not sent again


def test_a_response_is_continued_once_and_a_conversation_holds_one() -> None:
    chain = ResponseChain(max_ids=1000)
    kept_turn(chain, {"input": "hi"}, "resp_1", 10)
    kept_turn(chain, {"previous_response_id": "resp_1", "input": "more"}, "resp_2", 20)
    assert len(chain) == 1
    with pytest.raises(ApiError) as refused:
        chain.expand({"previous_response_id": "resp_1", "input": "again"})
    assert refused.value.error_type == PREVIOUS_NOT_FOUND and "continued already" in refused.value.message
    assert chain.forget("resp_2") and not chain.forget("resp_2") and len(chain) == 0


def test_kept_responses_stay_within_their_id_bound() -> None:
    chain = ResponseChain(max_ids=50)
    for number in range(3):
        kept_turn(chain, {"input": f"conversation {number}"}, f"resp_{number}", 20)  # 21 ids each with the answer
    assert len(chain) == 2
    with pytest.raises(ApiError) as dropped:
        chain.expand({"previous_response_id": "resp_0", "input": "next"})
    assert dropped.value.status == 400 and dropped.value.error_type == PREVIOUS_NOT_FOUND
    assert "response_store_max_ids: 50" in dropped.value.message and "whole input" in dropped.value.message
    too_big = kept_turn(chain, {"input": "long"}, "resp_big", 60)
    assert too_big["store"] is False and len(chain) == 2


@pytest.mark.parametrize(
    ("raw", "param", "says"),
    [
        ({"previous_response_id": "resp_1", "input": "x", "instructions": "other"}, "instructions", "differ"),
        ({"previous_response_id": "resp_1", "input": 5}, "input", "new ones only"),
        ({"previous_response_id": 7, "input": "x"}, "previous_response_id", "a string"),
        ({"input": "x", "store": "yes"}, "store", "true or false"),
        ({"previous_response_id": "resp_unknown", "input": "x"}, "previous_response_id", "not held"),
    ],
)
def test_what_cannot_continue_is_a_400_that_says_what_to_send(raw: dict[str, Any], param: str, says: str) -> None:
    chain = ResponseChain(max_ids=1000)
    kept_turn(chain, {"input": "hi", "instructions": "be brief"}, "resp_1", 10)
    with pytest.raises(ApiError) as refused:
        chain.expand(raw)
    assert (refused.value.status, refused.value.param) == (400, param)
    assert says in refused.value.message


def test_store_false_and_a_store_of_nothing_keep_nothing() -> None:
    chain = ResponseChain(max_ids=1000)
    assert kept_turn(chain, {"input": "hi", "store": False}, "resp_1", 10)["store"] is False
    off = ResponseChain(max_ids=0)
    assert kept_turn(off, {"input": "hi"}, "resp_1", 10)["store"] is False
    with pytest.raises(ApiError) as refused:
        off.expand({"previous_response_id": "resp_1", "input": "x"})
    assert "keeps no responses (response_store_max_ids: 0)" in refused.value.message


@pytest.fixture(scope="module")
def stateless() -> tuple[Episode, list[dict[str, Any]]]:
    received: list[dict[str, Any]] = []
    return play(chain_responses=False, received=received), received


@pytest.fixture(scope="module")
def chained() -> tuple[Episode, list[dict[str, Any]]]:
    received: list[dict[str, Any]] = []
    return play(chain_responses=True, received=received), received


def test_chained_calls_send_the_new_items_only_and_vllm_gets_the_same_requests(stateless, chained) -> None:
    (whole, whole_received), (episode, received) = stateless, chained
    requests = [json.loads(raw) for raw in episode.recorded.model_requests]
    assert len(requests) == TURNS
    assert "previous_response_id" not in requests[0]
    for request in requests[1:]:
        assert request["previous_response_id"].startswith("resp_")
        assert token_keys(request) == set()
        assert [item["role"] for item in request["input"]] == ["user"]  # the environment's "Higher."
    # The adapter rebuilt each call: vLLM got the very bodies a whole-history agent makes it send.
    assert received == whole_received
    assert rollout_to_training_sequence(episode.record) == rollout_to_training_sequence(whole.record)
    check_contiguous(bundled_turns(episode.record))


def test_every_continued_call_after_the_first_takes_the_kept_chat_messages() -> None:
    adapters: list[VLLMModel] = []
    play(chain_responses=True, before=lambda number, adapter: adapters.append(adapter))
    assert adapters[-1].kept_responses.calls_on_kept_chat == TURNS - 1
    assert len(adapters[-1].kept_responses) == 0  # the agent deleted the episode's last kept response at its end


def test_chained_request_bytes_do_not_grow_with_the_history(stateless, chained) -> None:
    """P5's figure, chained: every call after the first is the same size, whatever the history's length."""
    whole = [len(raw) for raw in stateless[0].recorded.model_requests]
    sizes = [len(raw) for raw in chained[0].recorded.model_requests]
    print(f"\nagent -> adapter bytes at turn 1/10/20: chained {sizes[0]}/{sizes[9]}/{sizes[19]}, whole {whole[19]}")
    assert max(sizes[1:]) - min(sizes[1:]) < 16  # the ids' and the round number's digits
    assert sizes[19] * 50 < whole[19]


def test_a_forgotten_response_is_sent_whole_and_the_episode_is_the_same(stateless) -> None:
    def restart_at_ten(number: int, adapter: VLLMModel) -> None:
        if number == 10:  # what an adapter restart does to the kept responses
            adapter.kept_responses = ResponseChain(adapter.config.response_store_max_ids)

    received: list[dict[str, Any]] = []
    episode = play(chain_responses=True, received=received, before=restart_at_ten)
    requests = [json.loads(raw) for raw in episode.recorded.model_requests]
    continued = ["previous_response_id" in request for request in requests]
    # Call 10 is sent twice: refused (not held), then whole; chaining resumes on the answer.
    assert continued == [False] + [True] * 10 + [False] + [True] * (TURNS - 11)
    assert received == stateless[1]
    assert rollout_to_training_sequence(episode.record) == rollout_to_training_sequence(stateless[0].record)


def model_that_ignores_previous_response_id() -> FastAPI:
    """A model server that says it kept its answers (store: true) but answers the new items alone, echoing nothing."""
    app = FastAPI()

    @app.post("/v1/responses")
    async def responses(request: Request) -> dict[str, Any]:
        await request.json()
        return {**answer("resp_same", "42", 3), "store": True}

    return app


def test_an_agent_refuses_a_server_that_does_not_echo_the_response_it_continued() -> None:
    with ExitStack() as stack:
        servers = {
            "policy_model": stack.enter_context(serve_in_thread(model_that_ignores_previous_response_id())),
            "env": stack.enter_context(serve_in_thread(recording_number_guess(Recorded()).build_app())),
        }
        config = SimpleAgentConfig(model_server="policy_model", resources_server="env", max_steps=TURNS)
        agent = stack.enter_context(serve_in_thread(SimpleAgent("agent", config, ServerClient(servers)).build_app()))
        refused = httpx.post(f"{agent}/run", json=ROW, timeout=60)
    assert refused.status_code == 502
    message = refused.json()["error"]["message"]
    assert "without echoing its previous_response_id" in message and "chain_responses: false" in message


def output_items(draw: st.DrawFn, call: int) -> list[dict[str, Any]]:
    """One model call's output items as the adapter answers them: reasoning, at most one message, function calls,
    the bundle on the last item."""
    items: list[dict[str, Any]] = []
    if draw(st.booleans()):
        items.append({"type": "reasoning", "id": f"rs_{call}", "summary": [{"type": "summary_text", "text": "hm"}]})
    calls = draw(st.integers(0, 2))
    if draw(st.booleans()) or not calls:
        items.append({"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": f"a{call}"}]})
    items += [
        {"type": "function_call", "call_id": f"c{call}_{n}", "name": "f", "arguments": "{}"} for n in range(calls)
    ]
    bundle = {"prompt_token_ids": [call, 1, 2], "generation_token_ids": [9], "generation_log_probs": [-0.5]}
    items[-1] = {
        **items[-1],
        **bundle,
        "prefix_splice": {"applied": True, "template_differed": False, "replaced_tokens": 0},
    }
    return items


@st.composite
def conversations(draw: st.DrawFn) -> list[tuple[list[dict[str, Any]], list[dict[str, Any]]]]:
    """Calls of one conversation: (the new items sent, the answer's items). New items are mostly the caller's (tool
    results, user turns), sometimes none or an assistant item (a harness's edit), which take the whole conversion."""
    calls = []
    for call in range(draw(st.integers(1, 6))):
        kind = draw(st.sampled_from(["user", "tool", "user+tool", "none", "assistant"]))
        new: list[dict[str, Any]] = []
        if "tool" in kind:
            new.append({"type": "function_call_output", "call_id": f"c{call}", "output": "r"})
        if "user" in kind or call == 0:
            new.append({"role": "user", "content": f"u{call}"})
        if kind == "assistant":
            new.append({"role": "assistant", "content": "edited"})
        calls.append((new, output_items(draw, call)))
    return calls


@given(conversations())
def test_the_kept_chat_messages_are_what_converting_the_whole_history_gives(calls) -> None:
    chain = ResponseChain(max_ids=10_000)
    previous = None
    for number, (new, output) in enumerate(calls):
        raw = {"input": new, "instructions": "sys", **({"previous_response_id": previous} if previous else {})}
        call = chain.expand(raw)
        form = chat_form(call)
        whole = responses_to_chat_request(ResponsesRequest.model_validate(call.body))["messages"]
        assert form.body["messages"] == whole, number
        response = chain.answered(
            {"id": f"resp_{number}", "output": output}, call, kept_chat_messages(call, whole, output)
        )
        previous = response["id"]


def test_a_bad_new_item_is_named_as_the_caller_sent_it() -> None:
    chain = ResponseChain(max_ids=1000)
    kept_turn(chain, {"input": "hi"}, "resp_1", 10)
    for new in ([{"role": "assistant", "content": "edited"}, {"type": "function_call"}], [{"type": "function_call"}]):
        with pytest.raises(ApiError) as refused:
            chat_form(chain.expand({"previous_response_id": "resp_1", "input": new}))
        assert refused.value.status == 400 and refused.value.param == f"input[{len(new) - 1}]"


class ContinueWithoutUserTurn(ResourcesServer):
    """/step lets the model go on once without a user turn (done: false, no user_message); a `ping` tool."""

    steps = 0

    def tools(self) -> dict[str, ToolHandler]:
        return {"ping": self.ping}

    async def ping(self, session_id: str, arguments: dict[str, Any]) -> str:
        return "pong"

    async def step(self, session_id: str, body: dict[str, Any]) -> dict[str, Any]:
        type(self).steps += 1
        return {"done": type(self).steps > 1}

    async def verify(self, session_id: str, body: dict[str, Any]) -> dict[str, Any]:
        return {"reward": 1.0}


def text_then_tool_then_text(messages: list[dict[str, Any]]) -> dict[str, Any]:
    calls_so_far = sum(message["role"] == "assistant" for message in messages)
    if calls_so_far == 1:
        call = {"id": "call_1", "type": "function", "function": {"name": "ping", "arguments": "{}"}}
        return {"role": "assistant", "content": None, "tool_calls": [call]}
    return {"role": "assistant", "content": "one" if calls_so_far == 0 else "three"}


@pytest.mark.parametrize("chain_responses", [False, True], ids=["whole-history", "previous-response-id"])
def test_a_tool_only_call_right_after_a_text_only_call_stays_a_call_of_its_own(chain_responses: bool) -> None:
    """The one history whose calls the adapter cannot tell apart by their items: the earlier call keeps its bundle,
    whether the agent sends it back or the adapter's kept response holds it."""
    ContinueWithoutUserTurn.steps = 0
    received: list[dict[str, Any]] = []
    recorded = Recorded()
    with ExitStack() as stack:
        vllm = stack.enter_context(serve_in_thread(hooked_vllm_stand_in(text_then_tool_then_text, received)))
        adapter = VLLMModel(
            "policy_model", VLLMModelConfig(base_url=vllm, model="m", splice="hook", return_token_id_information=True)
        )
        adapter_url = stack.enter_context(serve_in_thread(adapter.build_app()))
        env = ContinueWithoutUserTurn("env", ResourcesServer.config_class())
        servers = {
            "policy_model": stack.enter_context(serve_in_thread(recording_relay(adapter_url, recorded))),
            "env": stack.enter_context(serve_in_thread(env.build_app())),
        }
        config = SimpleAgentConfig(
            model_server="policy_model", resources_server="env", max_steps=5, chain_responses=chain_responses
        )
        agent = stack.enter_context(serve_in_thread(SimpleAgent("agent", config, ServerClient(servers)).build_app()))
        row = {"responses_create_params": {"input": "go", "tools": [{"type": "function", "name": "ping"}]}}
        answer = httpx.post(f"{agent}/run", json=row, timeout=60)
    assert answer.status_code == 200, answer.text
    assert answer.json()["response"]["model_calls"] == 3
    third = received[2]["messages"]
    assert [(m["role"], m.get("content"), len(m.get("tool_calls") or [])) for m in third] == [
        ("user", "go", 0),
        ("assistant", "one", 0),
        ("assistant", "", 1),
        ("tool", "pong", 0),
    ]
    assert [len(m["prompt_token_ids"]) > 0 for m in third if "prompt_token_ids" in m] == [True, True]
    sent = [json.loads(raw) for raw in recorded.model_requests]
    if chain_responses:  # the agent sent the new items only; the adapter put the two bundles back
        assert [bool(request.get("previous_response_id")) for request in sent] == [False, True, True]
        assert [token_keys(request) for request in sent] == [set(), set(), set()]
    else:
        assert len(bundled_inputs(sent[2])) == 2  # the separator and the latest call's
        assert len(bundled_inputs(sent[1])) == 1
