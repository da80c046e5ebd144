"""TemplateProofs: a proof holds per server and scope until its connection epoch moves or it grows too old."""

from __future__ import annotations

import pytest

from responses_api_models.vllm_model.template_proofs import TemplateProofs


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_proof_holds_for_its_server_scope_and_epoch_only() -> None:
    clock = Clock()
    proofs = TemplateProofs(60.0, clock=clock)
    assert proofs.current("a", "s", 0) is None
    proofs.record("a", "s", 3, [1, 2])
    assert proofs.current("a", "s", 3) is not None
    assert proofs.current("b", "s", 3) is None  # another server
    assert proofs.current("a", "t", 3) is None  # another scope
    assert proofs.current("a", "s", 4) is None  # a new connection since: not current, but renewable by its probe
    lapsed = proofs.renewable("a", "s")
    assert lapsed is not None and lapsed.probe_ids == (1, 2)
    renewed = proofs.renew("a", "s", lapsed, 4)
    assert proofs.current("a", "s", 4) == renewed and renewed.proven_at == lapsed.proven_at
    assert proofs.current("a", "s", 3) is None
    assert (proofs.proven, proofs.renewed) == (1, 1)


def test_a_proof_lapses_with_age_and_reports_it() -> None:
    clock = Clock()
    proofs = TemplateProofs(60.0, clock=clock)
    proofs.record("a", "s", 0, None)
    clock.now += 59.5
    proof = proofs.current("a", "s", 0)
    assert proof is not None
    assert proofs.telemetry(proof) == {
        "by": "server_tokenize",
        "this_request": False,
        "age_seconds": 59.5,
        "renewed": False,
    }
    assert proofs.telemetry(None)["this_request"] is True
    clock.now += 1.0
    assert proofs.current("a", "s", 0) is None
    assert proofs.renewable("a", "s") is None  # too old to renew: the next request proves anew


def test_proofs_are_bounded_least_recently_used_first() -> None:
    proofs = TemplateProofs(60.0, max_entries=2, clock=Clock())
    proofs.record("a", "1", 0, None)
    proofs.record("a", "2", 0, None)
    assert proofs.current("a", "1", 0) is not None  # now the most recent
    proofs.record("a", "3", 0, None)
    assert proofs.current("a", "2", 0) is None
    assert proofs.current("a", "1", 0) is not None and proofs.current("a", "3", 0) is not None


def test_the_upstream_epoch_moves_with_new_connections_only() -> None:
    """A real server over loopback: kept-alive calls stay in one epoch; a restart in place (a new connection) and a
    failed call each start a new one."""
    import asyncio

    from fastapi import FastAPI

    from nemo_gym_tok.common.net import free_port
    from nemo_gym_tok.servers.inprocess import serve_in_thread
    from responses_api_models.vllm_model.upstream import UpstreamUnavailable, VLLMUpstream

    app = FastAPI()

    @app.post("/tokenize")
    async def tokenize() -> dict[str, list[int]]:
        return {"tokens": [1]}

    port = free_port()
    base = f"http://127.0.0.1:{port}/v1"

    async def calls(upstream: VLLMUpstream, n: int) -> list[int]:
        epochs = []
        for _ in range(n):
            await upstream.post(base, "/tokenize", {})
            epochs.append(upstream.epoch(base))
        return epochs

    async def scenario() -> tuple[list[int], list[int], int]:
        upstream = VLLMUpstream(api_key="k", timeout=5.0, max_attempts=2, backoff_seconds=0.01)
        try:
            with serve_in_thread(app, port=port):
                first = await calls(upstream, 3)
            with serve_in_thread(app, port=port):
                second = await calls(upstream, 3)
            with pytest.raises(UpstreamUnavailable):  # nothing listens now; the failure itself moves the epoch
                await upstream.post(base, "/tokenize", {})
            return first, second, upstream.epoch(base)
        finally:
            await upstream.aclose()

    first, second, after_failure = asyncio.run(scenario())
    assert first == [first[0]] * 3 and first[0] >= 1
    assert second == [second[0]] * 3 and second[0] > first[0]
    assert after_failure > second[0]
