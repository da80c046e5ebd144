"""P5: request bytes per model call at turns 1, 10 and 20 of one episode: agent -> adapter, and adapter -> vLLM.

    .venv/bin/python bench/p5_request_bytes.py                 # starts the hooked bench vLLM
    .venv/bin/python bench/p5_request_bytes.py --vllm-url URL

One number_guess episode of at least 20 model calls (max_rounds raised to --turns, max_output_tokens 64, a random
model that rarely guesses right: an episode that ends early is replaced by the next row's) played by the simple
agent through the vllm_model adapter (token information on, splice: hook), all in this process, with a recording
proxy between agent and adapter and another between adapter and vLLM. Reported per turn: the bytes of the request
body the agent sent the model server (/v1/responses), how many token bundles it carried and their bytes, the bytes
the adapter sent vLLM, and the prompt's ids (vLLM's usage.prompt_tokens).
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from collections.abc import Sequence
from contextlib import ExitStack
from typing import Any

import httpx
import orjson
from benchkit.figures import Figure, Table, command, run_standalone
from benchkit.hops import Exchange, adapter_stack, serve_app
from benchkit.server import MODEL, REPO, BenchError, note
from benchkit.timing import ratio

from nemo_gym_tok.common.exact_json import loads_exact
from nemo_gym_tok.common.jsonl import read_jsonl
from nemo_gym_tok.types.tokens import BUNDLE_FIELDS

GAME = REPO / "resources_servers" / "number_guess" / "data" / "example.jsonl"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vllm-url", help=f"a hooked vLLM serving the bench model as {MODEL!r} (else one is started)")
    p.add_argument("--turns", type=int, default=20, help="model calls the episode must reach (default 20)")
    p.add_argument("--report", type=int, nargs="+", default=[1, 10, 20], help="turns in the table (default 1 10 20)")
    p.add_argument("--max-tokens", type=int, default=64)
    return p


def bundle_bytes(body: dict[str, Any], key: str) -> tuple[int, int]:
    """(items carrying a token bundle, bytes of their bundle fields as JSON) in the request's `key` list."""
    carrying, size = 0, 0
    for item in body.get(key) or []:
        if isinstance(item, dict) and any(f in item for f in BUNDLE_FIELDS):
            carrying += 1
            size += sum(len(orjson.dumps(item[f])) for f in BUNDLE_FIELDS if f in item)
    return carrying, size


def play(url: str, args: argparse.Namespace, *, chain_responses: bool = True) -> tuple[list[Exchange], list[Exchange]]:
    """One episode reaching args.turns model calls: (agent -> adapter posts, adapter -> vLLM chat posts), played by
    the simple agent with its `chain_responses` as given (its default, true, unless a caller says otherwise)."""
    from nemo_gym_tok.config import ServerInstance
    from nemo_gym_tok.servers.client import ServerClient
    from nemo_gym_tok.servers.registry import validate_instance
    from responses_api_agents.simple_agent.app import SimpleAgent, SimpleAgentConfig

    examples = read_jsonl(GAME)
    with ExitStack() as stack:
        to_adapter, to_vllm, adapter_proxy = stack.enter_context(adapter_stack(url))
        env_class, env_config = validate_instance(
            ServerInstance("number_guess", "resources_servers", "number_guess", {"max_rounds": args.turns}, {})
        )
        env = stack.enter_context(serve_app(env_class("number_guess", env_config).build_app()))
        agent_config = SimpleAgentConfig(
            model_server="policy_model",
            resources_server="number_guess",
            max_steps=args.turns,
            chain_responses=chain_responses,
        )
        agent = stack.enter_context(
            serve_app(
                SimpleAgent(
                    "number_guess_agent",
                    agent_config,
                    ServerClient({"policy_model": adapter_proxy, "number_guess": env}),
                ).build_app()
            )
        )
        for attempt, example in enumerate(examples):
            row = copy.deepcopy(example)
            row["responses_create_params"]["max_output_tokens"] = args.max_tokens
            row["responses_create_params"]["seed"] = attempt
            to_adapter.exchanges.clear()
            to_vllm.exchanges.clear()
            answer = httpx.post(f"{agent}/run", json=row, timeout=1200)
            if answer.status_code != 200:
                raise BenchError(f"the agent answered HTTP {answer.status_code}: {answer.text[:500]}")
            calls = to_adapter.posts("/v1/responses")
            if len(calls) >= args.turns:
                return calls, to_vllm.posts("/v1/chat/completions")
            note(f"P5: episode {attempt} ended after {len(calls)} calls (a right guess); next row")
    raise BenchError(f"no example row gave an episode of {args.turns} model calls")


def run(url: str, args: argparse.Namespace, argv: Sequence[str]) -> Figure:
    started = time.monotonic()
    figure = Figure("P5", "Request bytes per model call as one episode grows", command("p5_request_bytes.py", argv))
    note(f"P5: playing a {args.turns}-call number_guess episode ...")
    to_adapter, to_vllm = play(url, args)
    table = Table(
        "Bytes of each model call's request body",
        [
            "turn",
            "prompt ids",
            "agent -> adapter",
            "bundles in it",
            "bundle bytes",
            "bytes / prompt id",
            "vs turn 1",
            "adapter -> vLLM",
            "bytes / prompt id",
        ],
    )
    first = len(to_adapter[0].body)
    rows = []
    for turn in range(1, len(to_adapter) + 1):
        sent = to_adapter[turn - 1]
        forwarded = to_vllm[turn - 1]
        prompt_ids = loads_exact(forwarded.answer).get("usage", {}).get("prompt_tokens", 0)
        bundles, size = bundle_bytes(loads_exact(sent.body), "input")
        rows.append(
            {
                "turn": turn,
                "prompt_ids": prompt_ids,
                "agent_bytes": len(sent.body),
                "bundles": bundles,
                "bundle_bytes": size,
                "vllm_bytes": len(forwarded.body),
            }
        )
        if turn in args.report:
            table.add(
                turn,
                prompt_ids,
                len(sent.body),
                bundles,
                size,
                ratio(len(sent.body), prompt_ids),
                ratio(len(sent.body), first),
                len(forwarded.body),
                ratio(len(forwarded.body), prompt_ids),
                digits=2,
            )
    figure.tables.append(table)
    figure.notes.append(
        f"One episode of {len(to_adapter)} model calls (max_output_tokens {args.max_tokens}); bytes are the raw "
        "request bodies as sent (JSON). Bundle bytes: the prompt_token_ids, generation_token_ids and "
        "generation_log_probs fields of the input items that carry them."
    )
    figure.data = {"turns": rows}
    figure.seconds = time.monotonic() - started
    return figure


def main(argv: Sequence[str] | None = None) -> None:
    run_standalone(parser, run, argv)


if __name__ == "__main__":
    sys.exit(main())
