"""Code the docs mark as runnable examples, run as written against the adapter and the shared hooked vLLM."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from nemo_gym_tok.records.contiguity import BundledTurn, check_contiguous
from nemo_gym_tok.servers.inprocess import serve_in_thread
from nemo_gym_tok.vllm_server import VLLMServer
from responses_api_models.vllm_model.app import VLLMModel, VLLMModelConfig

REPO = Path(__file__).resolve().parents[1]
PLACEHOLDER_URL = "http://127.0.0.1:PORT/v1"


def docs_example(path: Path, name: str) -> str:
    """The ```python block right after `<!-- docs-example: NAME -->` in `path`."""
    text = path.read_text()
    mark = f"<!-- docs-example: {name} -->"
    assert text.count(mark) == 1, f"{path} should mark exactly one block {mark}"
    block = re.match(r"\s*```python\n(.*?)\n```", text.split(mark, 1)[1], re.S)
    assert block is not None, f"no ```python block follows {mark} in {path}"
    return block.group(1)


@pytest.fixture(scope="module")
def adapter_url(vllm_server: VLLMServer) -> Iterator[str]:
    """The adapter as vllm_model_for_training.yaml configures it, in front of the hooked vLLM."""
    config = VLLMModelConfig(
        base_url=f"{vllm_server.base_url}/v1", model=vllm_server.served_model_name, return_token_id_information=True
    )
    with serve_in_thread(VLLMModel("policy_model", config).build_app()) as url:
        yield url


def run_example(code: str, adapter_url: str) -> dict[str, Any]:
    assert PLACEHOLDER_URL in code  # else the example no longer talks to the adapter this test serves
    namespace: dict[str, Any] = {"__name__": "docs_example"}
    exec(
        compile(code.replace(PLACEHOLDER_URL, f"{adapter_url}/v1"), "<docs/token-contract.md example>", "exec"),
        namespace,
    )
    return namespace


def turn(number: int, message: dict[str, Any]) -> BundledTurn:
    return BundledTurn(
        number,
        message["prompt_token_ids"],
        message["generation_token_ids"],
        message["generation_log_probs"],
        message.get("prefix_splice"),
    )


def test_the_token_contract_sdk_example_keeps_tool_fields_and_is_token_contiguous(adapter_url: str) -> None:
    example = run_example(docs_example(REPO / "docs" / "token-contract.md", "token-contract-sdk"), adapter_url)

    first, second, third = example["first"], example["second"], example["third"]
    # The history it sent on the last call still holds the tool call and its result, and no bundle at all.
    sent = example["messages"]
    assert any(m.get("tool_calls") for m in sent if m["role"] == "assistant")
    assert [m["tool_call_id"] for m in sent if m["role"] == "tool"] == [c["id"] for c in first["tool_calls"]]
    # Each later call was spliced onto the one before: its prompt extends every id the episode saw before it.
    assert second["prefix_splice"]["applied"] and third["prefix_splice"]["applied"]
    check_contiguous([turn(n, message) for n, message in enumerate((first, second, third))])
    assert len(third["prompt_token_ids"]) > len(second["prompt_token_ids"]) + len(second["generation_token_ids"])


def test_the_previous_response_example_continues_the_kept_history_exactly(adapter_url: str) -> None:
    example = run_example(
        docs_example(REPO / "docs" / "token-contract.md", "token-contract-previous-response"), adapter_url
    )
    first, second = (example[name].output[-1].model_dump() for name in ("first", "second"))
    assert example["first"].store is True and example["second"].previous_response_id == example["first"].id
    assert second["prefix_splice"]["applied"]
    check_contiguous([turn(0, first), turn(1, second)])
    # The second prompt holds the first call's user turn: the history came from the adapter, not the request.
    assert len(second["prompt_token_ids"]) > len(first["prompt_token_ids"]) + len(first["generation_token_ids"])
