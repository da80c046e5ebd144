"""The hook on vLLM's Harmony render, in-process (no server): vLLM's own `_make_request_with_harmony` on an
OnlineRenderer holding the tiny GPT-OSS tokenizer, wrapped by the hook, fed simulated multi-turn episodes."""

from __future__ import annotations

import random
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from nemo_gym_tok.testing.tiny_model.gpt_oss import END_ID, GENERATION_EOS_IDS, RETURN_ID, VOCAB_SIZE
from nemo_gym_tok.vllm import harmony, hook, internals
from nemo_gym_tok.vllm import telemetry as vllm_telemetry
from tests.gpt_oss.conftest import START_DATE
from tests.gpt_oss.play import continues


@pytest.fixture(scope="module")
def tokenizer(gpt_oss_model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(gpt_oss_model_dir))


@pytest.fixture
def online(tokenizer, monkeypatch: pytest.MonkeyPatch) -> Any:
    """An OnlineRenderer for a gpt_oss model with the hook installed (restored afterwards), date pinned."""
    from vllm.renderers.online_renderer import OnlineRenderer

    monkeypatch.setenv("VLLM_SYSTEM_START_DATE", START_DATE)
    for module_name, class_name, method in hook.PATCHED_METHODS:
        owner = internals.lookup(module_name, class_name)
        monkeypatch.setattr(owner, method, getattr(owner, method))
    hook.install()
    renderer = object.__new__(OnlineRenderer)
    renderer.renderer = SimpleNamespace(get_tokenizer=lambda: tokenizer, tokenizer=tokenizer)
    renderer.model_config = SimpleNamespace(
        get_vocab_size=lambda: VOCAB_SIZE, try_get_generation_config=lambda: {"eos_token_id": GENERATION_EOS_IDS}
    )
    renderer.supports_browsing = renderer.supports_code_interpreter = False
    renderer.use_harmony = True
    return renderer


def _request(messages: list[dict[str, Any]], **fields: Any) -> Any:
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    return ChatCompletionRequest(messages=messages, **fields)


def test_profile_reads_harmony_closers_and_the_return_token(online) -> None:
    profile = harmony.harmony_profile(online)
    assert profile.closers == frozenset({"<|end|>", "<|call|>"})
    assert profile.replaced_end_tokens == frozenset({"<|return|>"})


def test_render_without_generation_prompt_closes_a_final_answer_with_return(online, tokenizer) -> None:
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello", "reasoning_content": "r"}]
    renderer = harmony.HarmonyRenderer(online, _request(messages), False)
    with_prompt = renderer.render(messages, add_generation_prompt=True)
    without = renderer.render(messages, add_generation_prompt=False)
    assert with_prompt.endswith("<|channel|>final<|message|>Hello<|end|><|start|>assistant")
    assert without == with_prompt.removesuffix("<|end|><|start|>assistant") + "<|return|>"
    assert f"Current date: {START_DATE}" in without
    # reasoning_content is read as `reasoning`, as vLLM's request validation renames it; the last final drops it
    thinking = messages[:1] + [{"role": "assistant", "reasoning_content": "r"}]
    analysis = renderer.render(thinking, add_generation_prompt=False)
    assert analysis.endswith("<|channel|>analysis<|message|>r<|end|>")


def test_a_first_turn_prefix_is_checked_not_spliced(online) -> None:
    from vllm.exceptions import VLLMValidationError

    messages = [{"role": "user", "content": "Hi"}]
    _, inputs = online._make_request_with_harmony(_request(messages))
    ids = inputs[0]["prompt_token_ids"]
    request = _request(messages, required_prefix_token_ids=ids[:10])
    _, again = online._make_request_with_harmony(request)
    assert again[0]["prompt_token_ids"] == ids
    assert vllm_telemetry.in_flight[id(request)]["applied"] is False
    with pytest.raises(VLLMValidationError, match="does not\\s+start with it"):
        online._make_request_with_harmony(_request(messages, required_prefix_token_ids=[ids[0] + 1]))


def _episode(online, tokenizer, seed: int, turns: int = 4) -> list[dict[str, Any]]:
    """Random-token turns (ended on <|return|> or cut), each later prompt rendered by the wrapped Harmony path."""
    rng = random.Random(seed)
    messages: list[dict[str, Any]] = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    _, inputs = online._make_request_with_harmony(_request(messages))
    prompt = inputs[0]["prompt_token_ids"]
    telemetry = []
    for turn in range(turns):
        generation = [rng.randrange(199998) for _ in range(rng.randint(2, 9))]
        if turn % 2 == 0:
            generation.append(RETURN_ID)
        text = tokenizer.decode(generation)  # what vLLM's Harmony parser hands back from a headerless turn
        messages.append(
            {
                "role": "assistant",
                "content": text,
                "prompt_token_ids": prompt,
                "generation_token_ids": generation,
                "generation_log_probs": [0.0] * len(generation),
            }
        )
        messages.append({"role": "user", "content": f"turn {turn}: more"})
        request = _request(messages)
        _, inputs = online._make_request_with_harmony(request)
        spliced, splice = inputs[0]["prompt_token_ids"], vllm_telemetry.in_flight[id(request)]
        assert continues(spliced, prompt + generation, splice), (turn, splice)
        assert splice.get("end_token_replaced", False) == (generation[-1] == RETURN_ID)
        if generation[-1] == RETURN_ID:
            assert spliced[len(prompt) + len(generation) - 1] == END_ID
        telemetry.append(splice)
        prompt = spliced
    return telemetry


def test_multi_turn_episodes_stay_contiguous(online, tokenizer) -> None:
    for seed in range(5):
        telemetry = _episode(online, tokenizer, seed)
        assert all(splice["applied"] and splice["template_differed"] for splice in telemetry)


def test_edited_history_is_refused(online, tokenizer) -> None:
    from vllm.exceptions import VLLMValidationError

    messages = [{"role": "user", "content": "Hello"}]
    _, inputs = online._make_request_with_harmony(_request(messages))
    generation = tokenizer.encode("Hi there", add_special_tokens=False) + [RETURN_ID]
    bundle = {
        "prompt_token_ids": inputs[0]["prompt_token_ids"],
        "generation_token_ids": generation,
        "generation_log_probs": [0.0] * len(generation),
    }
    edited = [
        {"role": "user", "content": "Hello, edited"},
        {"role": "assistant", "content": "Hi there", **bundle},
        {"role": "user", "content": "more"},
    ]
    with pytest.raises(VLLMValidationError, match="does not belong to these messages"):
        online._make_request_with_harmony(_request(edited))


def _harmony_ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def test_real_gpt_oss_turn_shapes_stay_contiguous(online, tokenizer) -> None:
    """Turns shaped as a trained GPT-OSS writes them: analysis then final (the analysis of earlier turns is dropped by
    Harmony's history, kept by the splice), and a tool call on the commentary channel ended on <|call|>."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionToolsParam

    tool = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Weather in Rome, then a joke?"}]
    tools = [ChatCompletionToolsParam.model_validate(tool)]
    _, inputs = online._make_request_with_harmony(_request(messages, tools=[tool]), True)
    prompt = inputs[0]["prompt_token_ids"]
    turns = [
        (
            "<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant<|channel|>commentary "
            'to=functions.get_weather <|constrain|>json<|message|>{"city":"Rome"}<|call|>',
            {
                "content": "",
                "reasoning": "Need weather.",
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city":"Rome"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        ),
        (
            "<|channel|>analysis<|message|>Sunny; answer.<|end|><|start|>assistant<|channel|>final<|message|>"
            "It is sunny in Rome.<|return|>",
            {"content": "It is sunny in Rome.", "reasoning": "Sunny; answer."},
            {"role": "user", "content": "And the joke?"},
        ),
        ("<|channel|>final<|message|>Why did the", {"content": "Why did the"}, {"role": "user", "content": "Go on."}),
    ]
    for generated, fields, following in turns:
        generation = _harmony_ids(tokenizer, generated)
        messages.append(
            {
                "role": "assistant",
                **fields,
                "prompt_token_ids": prompt,
                "generation_token_ids": generation,
                "generation_log_probs": [0.0] * len(generation),
            }
        )
        messages.append(following)
        request = _request(messages, tools=[tool])
        assert request.tools == tools
        _, inputs = online._make_request_with_harmony(request, True)
        spliced, splice = inputs[0]["prompt_token_ids"], vllm_telemetry.in_flight[id(request)]
        assert continues(spliced, prompt + generation, splice), splice
        assert splice.get("end_token_replaced", False) == generated.endswith("<|return|>")
        prompt = spliced
    text = tokenizer.decode(prompt)
    # Both analysis messages stay where the model wrote them; stock Harmony history would have dropped them.
    assert text.count("<|channel|>analysis") == 2 and text.endswith("Go on.<|end|><|start|>assistant")


def test_a_new_token_segment_takes_harmony_ids_as_they_are(online, tokenizer) -> None:
    messages = [{"role": "user", "content": "Hello"}]
    _, inputs = online._make_request_with_harmony(_request(messages))
    generation = tokenizer.encode("Hi there", add_special_tokens=False) + [RETURN_ID]
    bundle = {
        "prompt_token_ids": inputs[0]["prompt_token_ids"],
        "generation_token_ids": generation,
        "generation_log_probs": [0.0] * len(generation),
    }
    edited = [
        {"role": "user", "content": "Hello, edited"},
        {"role": "assistant", "content": "Hi there", **bundle},
        {"role": "user", "content": "more"},
    ]
    request = _request(edited, start_token_segment=True)
    _, spliced = online._make_request_with_harmony(request)
    plain = [{key: value for key, value in m.items() if key not in bundle} for m in edited]
    _, stock = online._make_request_with_harmony(_request(plain))
    assert spliced[0]["prompt_token_ids"] == stock[0]["prompt_token_ids"]
    assert vllm_telemetry.in_flight[id(request)] == {
        "applied": False,
        "template_differed": False,
        "replaced_tokens": 0,
        "new_segment": True,
        "new_segment_reason": "asked",
    }
