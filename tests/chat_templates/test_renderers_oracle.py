"""A second oracle: Prime Intellect's `renderers` (0.1.12, its own venv) bridges turns as the splice does. Wherever it
bridges, its ids equal `splice_prompt`'s or differ by a rule of `classify` (docs/hook.md); anything else fails.

Covers the real templates of `make test-families` that renderers mirrors and one catalog template per other renderer
(`make renderers-oracle` runs every catalog template of those families: about 10 minutes on 2 cores). The figures are
printed in the terminal summary.
"""

from __future__ import annotations

import pytest

from nemo_gym_tok.splice import HFChatRenderer
from nemo_gym_tok.testing.chat_templates import entry, family_of, family_tokenizer
from nemo_gym_tok.testing.chat_templates.renderers_oracle import POLICIES, OracleReport, compare
from nemo_gym_tok.testing.chat_templates.renderers_parity import CANDIDATES, worker_python
from nemo_gym_tok.testing.chat_templates.renderers_rules import classify
from tests.families.conftest import CASES

# Templates of `make test-families` that renderers does not mirror, and what it renders otherwise (its render-parity
# probe must still fail this way: if renderers comes to mirror one, it joins the comparison).
NOT_MIRRORED = {
    # The NousResearch template is Llama 3's plain one; renderers' llama-3 is Meta's 3.2 template (date preamble).
    "NousResearch-Meta-Llama-3.1-8B-Instruct": "Cutting Knowledge Date",
    # V3.1 prefills `</think>` (thinking off); renderers has V3 (bare `<｜Assistant｜>`) and R1 (`<think>\n`).
    "deepseek-ai-DeepSeek-V3.1": "</think>",
}
# One catalog template per renderer that the families above leave out, each with render parity.
CATALOG = (
    "meta-llama-Llama-3.1-8B-Instruct",  # llama-3
    "GLM-4.7-Flash",  # glm-5
    "zai-org-GLM-5.2",  # glm-5.3
    "LukeBailey181Pub-dspv2_guide",  # deepseek-v3 (a revision that opens `<｜tool▁outputs▁begin｜>` per cycle)
    "microsoft-MAI-DS-R1",  # deepseek-r1
    "moonshotai-Kimi-K2-Instruct",  # kimi-k2
    "moonshotai-Kimi-K2.5",  # kimi-k2.5
    "MiniMaxAI-MiniMax-M2.5",  # minimax-m2
    "Qwen-Qwen3.6-35B-A3B",  # qwen3.5
    "Qwen-Qwen3-Coder-30B-A3B-Instruct",  # prime-qwen3
    "Qwen-Qwen3-4B-Instruct-2507",  # qwen3-vl
    "NVIDIA-Nemotron-3-Nano-30B-A3B-BF16",  # nemotron-3
)
FAMILY_TEMPLATES = tuple(
    dict.fromkeys(case.template for case in CASES if family_of(entry(case.template)).name in CANDIDATES)
)


@pytest.fixture(scope="module")
def report(summary_section: dict[str, list[str]]) -> OracleReport:
    worker_python()  # FileNotFoundError naming `make renderers-venv` when the venv is missing: a failure, not a skip
    names = [*FAMILY_TEMPLATES, *(name for name in CATALOG if name not in FAMILY_TEMPLATES)]
    result = compare([entry(name) for name in names], episodes_per_shape=1, seed=19)  # make renderers-oracle: 2
    summary_section["renderers oracle: bridge_to_next_turn vs splice_prompt (make renderers-oracle: whole catalog)"] = (
        result.format(listed=10).splitlines()
    )
    return result


def test_every_family_template_renderers_mirrors_is_compared(report: OracleReport) -> None:
    by_name = {item.name: item for item in report.templates}
    for name in FAMILY_TEMPLATES:
        item = by_name[name]
        if name in NOT_MIRRORED:
            assert not item.renderer and NOT_MIRRORED[name] in item.parity, (name, item.renderer, item.parity)
        else:
            assert item.renderer, f"{name}: no renderer of renderers renders it: {item.parity}"
    for name in CATALOG:
        assert by_name[name].renderer, f"{name}: no render parity: {by_name[name].parity}"


def test_bridged_turns_equal_the_splice_or_differ_by_a_documented_rule(report: OracleReport) -> None:
    assert not report.wrong, report.wrong[:3]
    assert not report.unexplained, "\n".join(d.describe() for d in report.unexplained[:5])
    for item in report.templates:
        if item.renderer:
            assert item.policies["all"].bridged > 0, f"{item.name}: renderers bridged no turn"
    played = sum(t.policies["all"].turns for t in report.templates if t.renderer)
    errors = [t.errors for t in report.templates if t.errors]
    assert sum(map(len, errors)) <= played // 20, errors  # a template's own TypeError on tool arguments (R1)
    for policy, _ in POLICIES:
        totals = report.totals(policy)
        assert totals.equal + sum(totals.classes.values()) == totals.bridged
    assert report.totals("all").equal > report.totals("all").bridged // 2


def test_a_difference_no_rule_names_is_unexplained() -> None:
    item = entry("Qwen-Qwen3-0.6B@a55ee1")
    tokenizer = family_tokenizer(item.text, family_of(item))
    renderer = HFChatRenderer(tokenizer)
    encode = renderer.encode
    previous = encode("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\nhm")
    ours = previous + encode("<|im_end|>\n<|im_start|>user\nMore<|im_end|>\n<|im_start|>assistant\n")
    closed = previous + encode("</think><|im_end|>\n<|im_start|>user\nMore<|im_end|>\n<|im_start|>assistant\n")
    assert classify(renderer, previous, ours, closed, ended=False).startswith("cut by max_tokens")
    assert classify(renderer, previous, ours, closed, ended=True) == ""  # a close after an ended turn: no rule
    other_text = previous + encode("<|im_end|>\n<|im_start|>user\nMore.<|im_end|>\n<|im_start|>assistant\n")
    assert classify(renderer, previous, ours, other_text, ended=False) == ""
    ended = previous + encode("<|endoftext|>")
    swapped = previous + encode("<|endoftext|>\n<|im_start|>user\nMore<|im_end|>\n<|im_start|>assistant\n")
    assert classify(renderer, ended, ours, swapped, ended=True).startswith("ended on '<|endoftext|>'")
    assert classify(renderer, ended, ours, swapped, ended=False) == ""
