"""Behind the router `ngt run` starts, an answer is refused while the router lists a worker the config did not
declare (one added through its unauthenticated /add_worker), or when it lists none."""

from __future__ import annotations

import asyncio
import json

import pytest

from nemo_gym_tok.servers.api_errors import ApiError
from responses_api_models.vllm_model.behind_router import DeclaredWorkers

ROUTER = "http://127.0.0.1:9000"


def lister(answer: tuple[int, bytes] | None):  # noqa: ANN201 - the adapter's get_small, answering one thing
    async def get_small(base_url: str, path: str) -> tuple[int, bytes] | None:
        assert (base_url, path) == (ROUTER, "/list_workers")
        return answer

    return get_small


def listing(*urls: str) -> tuple[int, bytes]:
    return 200, json.dumps({"urls": list(urls)}).encode()


def check(declared: DeclaredWorkers, answer: tuple[int, bytes] | None) -> None:
    asyncio.run(declared.check(lister(answer), ROUTER))


def test_the_declared_workers_pass_however_their_urls_are_spelled() -> None:
    declared = DeclaredWorkers({"worker_urls": ["http://a:8000/v1", "http://b:8000/"]})
    check(declared, listing("http://a:8000", "http://b:8000"))
    check(declared, listing("http://b:8000"))  # one taken out (dead, or being resynced): nothing undeclared


@pytest.mark.parametrize(
    ("answer", "message"),
    [
        (listing("http://a:8000", "http://evil:9999"), "lists http://evil:9999, which the config does not declare"),
        ((404, b"not found"), "did not list its workers"),
        (None, "did not list its workers"),
        ((200, b"{not json"), "did not list its workers"),
    ],
)
def test_an_undeclared_or_unlisted_worker_refuses_the_answer(answer: tuple[int, bytes] | None, message: str) -> None:
    declared = DeclaredWorkers({"worker_urls": ["http://a:8000"]})
    with pytest.raises(ApiError, match=message) as refused:
        check(declared, answer)
    assert refused.value.status == 502 and refused.value.error_type == "undeclared_worker"


def test_without_declared_workers_nothing_is_checked() -> None:
    check(DeclaredWorkers(None), listing("http://anything:1"))  # a router started elsewhere: base_url only
