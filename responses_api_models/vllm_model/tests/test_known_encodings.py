"""A generated turn tokenized once its answer is out: the next turn's measurement finds exactly the tokenizer's ids,
and against a real stock vLLM the answers' telemetry is the same with and without it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from nemo_gym_tok.servers.inprocess import serve_in_thread
from nemo_gym_tok.vllm.server import VLLMServer
from responses_api_models.vllm_model.app import VLLMModel
from responses_api_models.vllm_model.config import VLLMModelConfig
from responses_api_models.vllm_model.local_template import KnownEncodings, LocalTemplate
from responses_api_models.vllm_model.tests.test_adapter_splice import SdkConversation, play


def load(tiny_model_dir: Path) -> LocalTemplate:
    return LocalTemplate.load(
        str(tiny_model_dir), chat_template=None, content_format="auto", default_template_kwargs={}
    )


def test_known_encodings_keep_the_ids_bounded_and_hand_out_copies() -> None:
    known = KnownEncodings(max_entries=2)
    for text in ("a", "bb", "ccc"):
        known.learn(text, lambda text: [len(text)] * len(text))
    assert known.get("a") is None  # the oldest went out
    ids = known.get("ccc")
    assert ids == [3, 3, 3]
    ids.append(0)
    assert known.get("ccc") == [3, 3, 3] and known.found == 2


def test_a_learned_turn_is_its_texts_own_tokenization(tiny_model_dir: Path) -> None:
    template = load(tiny_model_dir)
    tokenizer = template.tokenizer
    generated = tokenizer.encode(" Roll left, then 12 steps north: done.", add_special_tokens=False)
    end = template.end_token_ids[0]
    template.learn_turn([*generated, end])
    text = tokenizer.decode(generated, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    renderer = template.renderer(None, {}, None)
    assert renderer.encode(text) == tokenizer.encode(text, add_special_tokens=False)
    assert template.known_encodings.found == 1
    assert renderer.encode(text + " more") == tokenizer.encode(text + " more", add_special_tokens=False)
    assert template.known_encodings.found == 1  # any other text is tokenized as before


def measured(conversations: list[SdkConversation]) -> list[list[tuple[object, ...] | None]]:
    """Each answer's measurement of the turn it added (the proof's age aside, which differs from run to run)."""
    return [
        [
            None if telemetry is None else tuple(telemetry.get(key) for key in MEASURED)
            for telemetry in conversation.telemetry
        ]
        for conversation in conversations
    ]


MEASURED = ("applied", "template_differed", "replaced_tokens", "spliced_by")


@pytest.fixture(scope="module")
def stock_adapter(plain_vllm_server: VLLMServer) -> Iterator[tuple[str, VLLMModel]]:
    config = VLLMModelConfig(
        base_url=plain_vllm_server.base_url,
        model=plain_vllm_server.served_model_name,
        return_token_id_information=True,
        splice="adapter",
    )
    model = VLLMModel("policy_model", config)
    with serve_in_thread(model.build_app()) as url:
        yield url, model


def test_the_measurement_is_the_same_with_the_turns_learned(
    stock_adapter: tuple[str, VLLMModel], monkeypatch: pytest.MonkeyPatch
) -> None:
    url, model = stock_adapter
    with monkeypatch.context() as patched:
        patched.setattr(LocalTemplate, "learn_turn", lambda self, ids: None)
        unlearned = play(url, range(3))
    assert model.splicer.known_turns_found == 0
    learned = play(url, range(3))
    assert model.splicer.known_turns_found >= 3  # the wiring: answers teach, next turns find
    assert measured(learned) == measured(unlearned)
    assert [c.prompts for c in learned] == [c.prompts for c in unlearned]
    assert all(c.contiguous() for c in learned)
