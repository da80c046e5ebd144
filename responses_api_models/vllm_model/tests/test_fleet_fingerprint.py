"""The adapter's fleet fingerprint (fleet.py): the router's workers are asked before the first answer is accepted, the
fingerprint most serve is the fleet's, a newcomer is asked when the list gains it, and an answer that differs or says
nothing where the fleet says something is refused. The real router's test: tests/test_router_gym.py."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from nemo_gym_tok.servers.api_errors import ApiError
from responses_api_models.vllm_model.fleet import FleetFingerprint, WorkerUnreachable

ROUTER = "http://router:9000/v1"


def fingerprint(template: str = "c", tokenizer: str = "t") -> dict[str, str]:
    return {"sha256": f"{tokenizer}{template}", "tokenizer_sha256": tokenizer, "chat_template_sha256": template}


def answer_from(replica: str, found: dict[str, str] | None) -> dict[str, Any]:
    message: dict[str, Any] = {"replica": replica}
    if found is not None:
        message["model_fingerprint"] = found
    return {"choices": [{"message": message}]}


def asker(served: dict[str, dict[str, str] | None | str]) -> Any:
    """What each worker answers the probe: a fingerprint, None (no hook), or "down"."""
    asked: list[str] = []

    async def ask(url: str) -> dict[str, str] | None:
        asked.append(url)
        found = served[url]
        if found == "down":
            raise WorkerUnreachable(url)
        assert not isinstance(found, str)
        return found

    ask.asked = asked  # type: ignore[attr-defined]
    return ask


def test_alone_the_first_hooked_answer_sets_it_and_later_ones_are_held_to_it() -> None:
    fleet = FleetFingerprint()
    fleet.check({"choices": [{"message": {"content": "a stock server says nothing"}}]})  # nothing known yet
    fleet.check(answer_from("http://a:8000", fingerprint()))
    fleet.check(answer_from("http://a:8000", fingerprint()))
    with pytest.raises(ApiError) as refused:
        fleet.check(answer_from("http://c:8000", fingerprint(template="other")))
    assert refused.value.status == 502 and refused.value.error_type == "replica_mismatch"
    assert "replica http://c:8000 serves the chat template unlike" in refused.value.message
    assert "the first answer, from replica http://a:8000" in refused.value.message
    with pytest.raises(ApiError, match="the tokenizer's files and the chat template"):
        fleet.check(answer_from("http://d:8000", fingerprint(template="y", tokenizer="x")))
    with pytest.raises(ApiError) as silent:  # once hooked, an answer without one is refused, never let through
        fleet.check(answer_from("http://e:8000", None))
    assert silent.value.error_type == "replica_unfingerprinted"


def test_behind_a_router_the_fleets_fingerprint_is_what_most_workers_serve_not_the_first_answer() -> None:
    fleet = FleetFingerprint()
    served = {"http://a:8000": fingerprint(), "http://b:8000": fingerprint(), "http://c:8000": fingerprint("other")}
    ask = asker(served)
    with pytest.raises(ApiError) as refused:  # refused while the odd one is listed, whoever served
        asyncio.run(fleet.check_workers(ROUTER, served, ask))
    assert "replica http://c:8000 serves the chat template" in refused.value.message
    assert "2 of 3 workers serve it" in refused.value.message
    assert sorted(ask.asked) == sorted(served)
    asyncio.run(fleet.check_workers(ROUTER, ["http://a:8000", "http://b:8000"], ask))  # taken out: answers pass
    fleet.check(answer_from("http://a:8000", fingerprint()))
    with pytest.raises(ApiError, match="replica http://c:8000 serves the chat template"):
        fleet.check(answer_from("http://c:8000", fingerprint("other")))  # had it answered first, still refused


def test_a_newcomer_is_asked_once_a_down_worker_again_later_and_none_answering_is_refused() -> None:
    async def scenario() -> None:
        nobody = FleetFingerprint()
        with pytest.raises(ApiError) as unchecked:
            await nobody.check_workers(ROUTER, ["http://a:8000"], asker({"http://a:8000": "down"}))
        assert unchecked.value.error_type == "fleet_unchecked"

        fleet = FleetFingerprint()
        served: dict[str, Any] = {"http://a:8000": fingerprint(), "http://b:8000": "down"}
        ask = asker(served)
        await fleet.check_workers(ROUTER, served, ask)  # b is listed but down: a alone sets it
        await fleet.check_workers(ROUTER, served, ask)
        assert ask.asked.count("http://b:8000") == 1  # not asked again before UNREACHABLE_RETRY_SECONDS
        served["http://n:8000"] = None  # a worker without the hook joins a hooked fleet
        await fleet.check_workers(ROUTER, served, ask)  # asked in the background; this answer is not held up
        await asyncio.sleep(0)
        with pytest.raises(ApiError) as refused:
            await fleet.check_workers(ROUTER, served, ask)
        assert refused.value.error_type == "replica_unfingerprinted" and "http://n:8000" in refused.value.message
        assert ask.asked.count("http://n:8000") == 1

    asyncio.run(scenario())
