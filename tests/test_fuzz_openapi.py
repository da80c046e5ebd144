"""Each gym server's OpenAPI document declares its request bodies, and a bounded fuzz over it gets no 5xx."""

from __future__ import annotations

import functools
import json
import os
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, given, settings
from openapi_spec_validator import validate
from schemathesis import GenerationMode

from nemo_gym_tok.config import ServerInstance
from nemo_gym_tok.servers.base import BaseServer
from nemo_gym_tok.servers.client import SESSION_HEADER, ServerClient
from nemo_gym_tok.servers.head import HeadServer, HeadServerConfig
from nemo_gym_tok.servers.inprocess import serve_in_thread
from nemo_gym_tok.servers.registry import validate_instance
from responses_api_agents.simple_agent.app import SimpleAgent, SimpleAgentConfig
from responses_api_models.vllm_model.app import VLLMModel, VLLMModelConfig
from tests.fixtures.fake_vllm import fake_vllm_app

REPO = Path(__file__).resolve().parents[1]
ENVIRONMENTS = ["capital_lookup", "grid_navigation", "number_guess"]
SERVERS = [*ENVIRONMENTS, "policy_model", "agent", "head"]
# Per route: positive examples follow the schema (they reach the handlers' logic), negative ones break it (they
# reach the body checks). CI runs a fixed sequence (derandomized, so a failure reproduces); NGT_FUZZ_EXAMPLES=N runs
# N positive and N/2 negative examples per route on a fresh random seed, for a longer hunt by hand.
HUNT = int(os.environ.get("NGT_FUZZ_EXAMPLES", "0"))
EXAMPLES = {GenerationMode.POSITIVE: HUNT or 60, GenerationMode.NEGATIVE: max(1, HUNT // 2) if HUNT else 30}
SEEDED_SESSION = "fuzz-episode"
"""Positive examples of an environment's episode routes run in this session, seeded with a valid row first."""


@functools.cache
def first_row(environment: str) -> dict[str, Any]:
    lines = (REPO / "resources_servers" / environment / "data" / "example.jsonl").read_text().splitlines()
    return json.loads(next(line for line in lines if line.strip()))


@pytest.fixture(scope="module")
def gym() -> Iterator[dict[str, str]]:
    """Every kind of gym server on real HTTP: the three environments, the adapter in front of a stand-in vLLM, a
    simple agent on number_guess (max 2 model calls) and a head server. Server name -> base URL."""
    with ExitStack() as stack:
        urls: dict[str, str] = {"vllm": stack.enter_context(serve_in_thread(fake_vllm_app()))}

        def serve(server: BaseServer) -> None:
            urls[server.name] = stack.enter_context(serve_in_thread(server.build_app()))

        for environment in ENVIRONMENTS:
            instance = ServerInstance(environment, "resources_servers", environment, {}, {})
            server_class, config = validate_instance(instance)
            serve(server_class(environment, config))
        serve(
            VLLMModel(
                "policy_model",
                VLLMModelConfig(
                    base_url=urls["vllm"],
                    model="fake",
                    splice="hook",
                    return_token_id_information=True,
                    max_attempts=1,
                    retry_backoff_seconds=0.0,
                ),
            )
        )
        serve(
            SimpleAgent(
                "agent",
                SimpleAgentConfig(
                    model_server="policy_model",
                    resources_server="number_guess",
                    max_steps=2,
                ),
                ServerClient(dict(urls)),
            )
        )
        serve(HeadServer("head", HeadServerConfig(servers=dict(urls))))
        yield urls


@pytest.mark.parametrize("server", SERVERS)
def test_every_post_route_declares_its_json_body_and_the_document_is_valid(gym: dict[str, str], server: str) -> None:
    document = httpx.get(f"{gym[server]}/openapi.json").json()
    validate(document)  # OpenAPI 3.1, references resolved
    posts = {path: ops["post"] for path, ops in document["paths"].items() if "post" in ops}
    assert posts or server == "head"
    for path, operation in posts.items():
        body = operation.get("requestBody", {})
        schema = body.get("content", {}).get("application/json", {}).get("schema")
        assert body.get("required") is True and isinstance(schema, dict) and schema, f"{path} declares no JSON body"
        assert "$defs" not in json.dumps(schema), f"{path}: nested models must live under components/schemas"
    components = document.get("components", {}).get("schemas", {})
    for ref in _references(document):
        assert ref.startswith("#/components/schemas/") and ref.rsplit("/", 1)[1] in components, ref


def test_route_schemas_name_what_the_handlers_read(gym: dict[str, str]) -> None:
    adapter = httpx.get(f"{gym['policy_model']}/openapi.json").json()
    chat = adapter["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert "messages" in chat["required"] and "required_prefix_token_ids" in chat["properties"]
    grid = httpx.get(f"{gym['grid_navigation']}/openapi.json").json()
    move = grid["paths"]["/move"]["post"]
    assert move["requestBody"]["content"]["application/json"]["schema"]["properties"]["direction"]["enum"]
    assert move["parameters"][0]["name"] == SESSION_HEADER and move["parameters"][0]["required"] is True
    number = httpx.get(f"{gym['number_guess']}/openapi.json").json()
    seed = number["paths"]["/seed_session"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert seed["properties"]["secret"]["maximum"] == 100
    agent = httpx.get(f"{gym['agent']}/openapi.json").json()
    run = agent["paths"]["/run"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert run["required"] == ["responses_create_params"]
    assert run["properties"]["responses_create_params"]["$ref"] == "#/components/schemas/ResponsesRequest"


@dataclass
class FuzzReport:
    examples: dict[str, int] = field(default_factory=dict)
    """"METHOD /path" -> requests sent."""
    statuses: Counter[int] = field(default_factory=Counter)
    server_errors: list[tuple[str, str]] = field(default_factory=list)
    """(route, mode, status and answer; the body sent)."""


@pytest.mark.parametrize("server", SERVERS)
def test_fuzzing_every_route_gets_no_server_error(gym: dict[str, str], server: str) -> None:
    url = gym[server]
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
    report = FuzzReport()
    started = time.monotonic()
    with requests.Session() as http:
        for result in schema.get_all_operations():
            operation = result.ok()
            route = f"{operation.method.upper()} {operation.path}"
            for mode, examples in EXAMPLES.items():
                if operation.method.upper() in ("GET", "DELETE") and mode is GenerationMode.NEGATIVE:
                    continue  # no body to break; a path's string (DELETE /v1/responses/{id}) cannot be invalid
                _fuzz(operation, mode, examples, server, url, http, report, route)
    elapsed = time.monotonic() - started
    print(
        f"\nfuzz {server}: {sum(report.examples.values())} requests in {elapsed:.1f}s "
        f"({', '.join(f'{route}: {count}' for route, count in report.examples.items())}); "
        f"statuses {dict(sorted(report.statuses.items()))}; {len(report.server_errors)} server errors"
    )
    assert not report.server_errors, _distinct(report.server_errors)


def _fuzz(
    operation: Any,
    mode: GenerationMode,
    examples: int,
    server: str,
    url: str,
    http: requests.Session,
    report: FuzzReport,
    route: str,
) -> None:
    # A valid episode behind the fixed session lets schema-following bodies reach the tools, /step and /verify.
    episode = server in ENVIRONMENTS and mode is GenerationMode.POSITIVE and operation.path != "/seed_session"
    headers = {SESSION_HEADER: SEEDED_SESSION} if episode else None

    @settings(
        max_examples=examples,
        deadline=None,
        derandomize=not HUNT,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(case=operation.as_strategy(generation_mode=mode))
    def send(case: Any) -> None:
        if episode:
            seeded = http.post(f"{url}/seed_session", json=first_row(server), headers=headers, timeout=30)
            assert seeded.status_code == 200, seeded.text
        response = case.call(base_url=url, session=http, headers=headers, timeout=60)
        report.examples[route] = report.examples.get(route, 0) + 1
        report.statuses[response.status_code] += 1
        if response.status_code >= 500:
            sent = case.body if not isinstance(case.body, bytes) else case.body[:200]
            report.server_errors.append(
                (
                    f"{route} ({mode.value}) -> HTTP {response.status_code}: {response.text[:300]}",
                    json.dumps(sent, default=repr)[:400],
                )
            )

    send()


def _distinct(errors: list[tuple[str, str]]) -> str:
    """Each distinct failure once, with how often it came and the first body that caused it."""
    counts = Counter(failure for failure, _ in errors)
    first = {failure: body for failure, body in reversed(errors)}
    return "\n".join(f"{count}x {failure}\n    e.g. body: {first[failure]}" for failure, count in counts.most_common())


def _references(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "$ref" and isinstance(value, str):
                yield value
            else:
                yield from _references(value)
    elif isinstance(node, list):
        for value in node:
            yield from _references(value)
