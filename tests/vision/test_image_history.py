"""Images in the history, on the real vLLM CPU build with the hook: exact in the expanded space, or refused."""

from __future__ import annotations

import copy
import re
from typing import Any

import httpx
import pytest

from nemo_gym_tok.testing.tiny_model.vision import (
    IMAGE_PAD_ID,
    VIDEO_PAD_ID,
    VISION_END_ID,
    VISION_START_ID,
    image_pad_count,
)
from nemo_gym_tok.vllm_server import VLLMServer
from tests.vision.images import image_part, text_part
from tests.vision.server import VLM_NAME

BUNDLE = ("prompt_token_ids", "generation_token_ids", "generation_log_probs")
PLACEHOLDERS = {IMAGE_PAD_ID, VIDEO_PAD_ID, VISION_START_ID, VISION_END_ID}

# One episode: two images in the first turn, one in the second, one in a tool result, then text only.
# Sizes (width, height) and the pads each expands to: image_pad_count.
FIRST = [text_part("Compare these two pictures."), image_part(56, 56, 1), image_part(84, 56, 2)]
SECOND = [text_part("And this one?"), image_part(112, 112, 3)]
TOOL_RESULT = [text_part("The camera shows:"), image_part(56, 84, 4)]
SIZES = [(56, 56), (84, 56), (112, 112), (56, 84)]


def chat(server: VLLMServer, messages: list[dict[str, Any]], **extra: Any) -> httpx.Response:
    body = {
        "model": VLM_NAME,
        "messages": messages,
        "max_tokens": 6,
        "temperature": 1.0,
        "seed": 7,
        "logprobs": True,
        **extra,
    }
    return httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=300)


def answer_of(response: httpx.Response) -> tuple[dict[str, Any], dict[str, Any] | None]:
    assert response.status_code == 200, response.text
    data = response.json()
    return data["choices"][0]["message"], data.get("prefix_splice")


def with_bundle(message: dict[str, Any]) -> dict[str, Any]:
    """The answer as the next call's assistant turn: its bundle and its record of the images (their digests)."""
    kept = {key: message[key] for key in (*BUNDLE, "image_runs") if key in message}
    return {"role": "assistant", "content": message.get("content") or "", **kept}


def image_runs(ids: list[int]) -> list[tuple[int, int]]:
    """(position, length) of every run of image pads between a start and an end marker."""
    runs, position = [], 0
    while position < len(ids):
        if ids[position] == VISION_START_ID:
            end = ids.index(VISION_END_ID, position)
            runs.append((position + 1, end - position - 1))
            position = end
        position += 1
    return runs


def splices(server: VLLMServer) -> float:
    match = re.search(r"^nemo_gym_tok_prefix_splices_total (\S+)$", httpx.get(f"{server.base_url}/metrics").text, re.M)
    return float(match.group(1)) if match else 0.0


def play_episode(server: VLLMServer) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The episode's messages (each assistant turn with its bundle) and each turn's answer message."""
    turns: list[list[dict[str, Any]]] = [
        [{"role": "user", "content": FIRST}],
        [{"role": "user", "content": SECOND}],
        [{"role": "tool", "tool_call_id": "call_0", "content": TOOL_RESULT}],
        [{"role": "user", "content": "Which of them was red?"}],
    ]
    messages: list[dict[str, Any]] = []
    answers = []
    for added in turns:
        messages += added
        message, _ = answer_of(chat(server, messages))
        answers.append(message)
        messages.append(with_bundle(message))
    return messages, answers


@pytest.fixture(scope="module")
def episode(vlm_server: VLLMServer) -> tuple[list[dict[str, Any]], list[dict[str, Any]], float]:
    before = splices(vlm_server)
    messages, answers = play_episode(vlm_server)
    return messages, answers, splices(vlm_server) - before


def test_an_episode_with_images_in_three_turns_is_contiguous_in_the_expanded_space(episode) -> None:
    messages, answers, spliced = episode
    for previous, following in zip(answers, answers[1:]):
        prefix = previous["prompt_token_ids"] + previous["generation_token_ids"]
        assert following["prompt_token_ids"][: len(prefix)] == prefix
    assert spliced == len(answers) - 1  # every turn after the first spliced by the hook
    last = answers[-1]["prompt_token_ids"]
    assert [length for _, length in image_runs(last)] == [image_pad_count(w, h) for w, h in SIZES]
    assert all(not PLACEHOLDERS & set(answer["generation_token_ids"]) for answer in answers)
    # Each bundle says where its prompt's images sit, with a digest of each: the same image keeps its digest.
    for answer in answers:
        runs = answer["image_runs"]
        assert [(run["position"], run["length"]) for run in runs] == image_runs(answer["prompt_token_ids"])
    digests = [run["digest"] for run in answers[-1]["image_runs"]]
    assert len(set(digests)) == len(SIZES) and None not in digests
    assert [run["digest"] for run in answers[0]["image_runs"]] == digests[:2]


def planted(messages: list[dict[str, Any]], change: Any) -> list[dict[str, Any]]:
    """The episode's history up to its second turn's answer, changed by `change`, and a new user turn."""
    history = copy.deepcopy(messages[:4])  # user (2 images), assistant, user (1 image), assistant
    change(history)
    return [*history, {"role": "user", "content": "Go on."}]


def resized_first_image(history: list[dict[str, Any]]) -> None:
    history[0]["content"][1] = image_part(84, 84, 1)  # 9 pads where the model saw 4


def swapped_first_image(history: list[dict[str, Any]]) -> None:
    history[0]["content"][1] = image_part(56, 56, 90)  # the same size, other pixels: the same pads


def dropped_second_image(history: list[dict[str, Any]]) -> None:
    del history[0]["content"][2]


def one_pad_fewer(history: list[dict[str, Any]]) -> None:
    prompt = history[3]["prompt_token_ids"]
    del prompt[image_runs(prompt)[1][0]]  # image 1's run one pad short


def pad_typed_in_text(history: list[dict[str, Any]]) -> None:
    prompt = history[3]["prompt_token_ids"]
    prompt.insert(3, IMAGE_PAD_ID)  # in the first user message's text, before any image


def pad_sampled(history: list[dict[str, Any]]) -> None:
    bundle = history[3]
    bundle["generation_token_ids"] = [IMAGE_PAD_ID, *bundle["generation_token_ids"][1:]]


@pytest.mark.parametrize(
    ("change", "words"),
    [
        (resized_first_image, r"image 0 is 4 pads in the history's ids but the request's image 0 expands to 9"),
        (swapped_first_image, r"image 0 is not the image the model saw"),
        (dropped_second_image, r"hold 3 image\(s\) up to messages\[3\], its messages 2: an image was dropped"),
        (one_pad_fewer, r"image 1 is 5 pads in the history's ids but the request's image 1 expands to 6"),
        (pad_typed_in_text, r"image pad \(151655\) outside an image"),
        (pad_sampled, r"the model sampled a placeholder"),
    ],
)
def test_a_history_whose_images_cannot_be_matched_is_refused_naming_the_image(
    vlm_server: VLLMServer, episode, change: Any, words: str
) -> None:
    messages, _, _ = episode
    before = splices(vlm_server)
    response = chat(vlm_server, planted(messages, change))
    assert response.status_code == 400, response.text[:500]
    error = response.json()["error"]
    assert re.search(words, error["message"]), error["message"]
    assert error.get("param") == "required_prefix_token_ids"
    assert splices(vlm_server) == before  # refused before any splice counted


def test_no_placeholder_is_sampled_over_a_thousand_tokens_even_when_asked_for(vlm_server: VLLMServer) -> None:
    # A random model draws one of 4 ids in 151,936 about 3% of the time over 1,000 tokens; a caller's bias of +100 on
    # them would make nearly every token one: the hook's ban must win over both.
    response = chat(
        vlm_server,
        [{"role": "user", "content": [text_part("Describe it at length."), image_part(56, 56, 9)]}],
        max_tokens=1000,
        ignore_eos=True,
        logit_bias={str(token): 100 for token in PLACEHOLDERS},
    )
    message, _ = answer_of(response)
    generated = message["generation_token_ids"]
    assert len(generated) == 1000
    assert not PLACEHOLDERS & set(generated)


@pytest.fixture(scope="module")
def vision_adapter(vlm_server: VLLMServer) -> Any:
    from nemo_gym_tok.servers.inprocess import serve_in_thread
    from responses_api_models.vllm_model.app import VLLMModel, VLLMModelConfig

    config = VLLMModelConfig(
        base_url=f"{vlm_server.base_url}/v1", model=VLM_NAME, return_token_id_information=True, splice="hook"
    )
    with serve_in_thread(VLLMModel("policy_model", config).build_app()) as url:
        yield url


def test_through_the_adapter_image_turns_are_contiguous_and_a_resized_image_is_refused(vision_adapter: str) -> None:
    # An OpenAI-SDK harness's calls: image parts in user turns, each assistant turn sent back with its bundle.
    messages: list[dict[str, Any]] = [{"role": "user", "content": FIRST}]
    answers = []
    for added in ([{"role": "user", "content": SECOND}], [{"role": "user", "content": "Which was red?"}], []):
        response = httpx.post(
            f"{vision_adapter}/v1/chat/completions",
            json={"model": VLM_NAME, "messages": messages, "max_tokens": 6, "seed": 3},
            timeout=300,
        )
        message, splice = answer_of(response)
        assert answers == [] or splice["applied"] is True
        answers.append(message)
        messages += [with_bundle(message), *added]
    for previous, following in zip(answers, answers[1:]):
        prefix = previous["prompt_token_ids"] + previous["generation_token_ids"]
        assert following["prompt_token_ids"][: len(prefix)] == prefix
    resized = [*copy.deepcopy(messages), {"role": "user", "content": "Go on."}]
    resized[0]["content"][2] = image_part(112, 112, 2)
    refused = httpx.post(
        f"{vision_adapter}/v1/chat/completions", json={"model": VLM_NAME, "messages": resized}, timeout=300
    )
    assert refused.status_code == 400 and "image 1 is 6 pads" in refused.text, refused.text[:500]


def test_ngt_check_reads_the_episode_as_contiguous_with_its_images_in_place(episode, tmp_path) -> None:
    import json

    from nemo_gym_tok.records.contiguity import check_file

    _, answers, _ = episode
    record = {"rollout_id": "vision-0", "response": {"output": [{"type": "message", **a} for a in answers]}}
    path = tmp_path / "rollouts.jsonl"
    path.write_text(json.dumps(record) + "\n")
    report = check_file(path)
    assert report.ok and report.contiguous == 1, report.format()
    assert (report.image_rollouts, report.images) == (1, len(SIZES)), report.format()
    assert "rollouts with images: 1, holding 4 image(s)" in report.format()
    swapped = copy.deepcopy(record)
    swapped["response"]["output"][-1]["image_runs"][0]["digest"] = "another image"
    path.write_text(json.dumps(swapped) + "\n")
    assert check_file(path).contiguous == 0


def test_log_probs_of_a_vision_turn_match_transformers_model(episode, tiny_vlm_dir) -> None:
    # The last call's prompt holds all four images; transformers' own model, given the same expanded ids and the same
    # pictures, must give the ids vLLM sampled the log probs vLLM recorded.
    import torch
    from transformers import AutoProcessor, PaddleOCRVLForConditionalGeneration

    from tests.vision.images import picture

    _, answers, _ = episode
    last = answers[-1]
    prompt, generated = last["prompt_token_ids"], last["generation_token_ids"]
    shades = [1, 2, 3, 4]  # FIRST, SECOND and TOOL_RESULT's images, in order
    pictures = [picture(w, h, shade) for (w, h), shade in zip(SIZES, shades, strict=True)]
    processor = AutoProcessor.from_pretrained(tiny_vlm_dir)
    processed = processor.image_processor(images=pictures, return_tensors="pt")
    ids = prompt + generated
    model = PaddleOCRVLForConditionalGeneration.from_pretrained(tiny_vlm_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(
            input_ids=torch.tensor([ids]),
            mm_token_type_ids=torch.tensor(processor.create_mm_token_type_ids([ids])),
            pixel_values=processed["pixel_values"],
            image_grid_thw=processed["image_grid_thw"],
        ).logits[0]
    steps = torch.log_softmax(logits[len(prompt) - 1 : -1].float(), dim=-1)
    recomputed = steps[torch.arange(len(generated)), torch.tensor(generated)].tolist()
    gaps = [abs(a - b) for a, b in zip(recomputed, last["generation_log_probs"], strict=True)]
    assert max(gaps) < 0.01, gaps


def test_responses_api_input_images_through_the_adapter_are_kept_and_contiguous(vision_adapter: str) -> None:
    from tests.vision.images import data_url

    def user(text: str, *sizes: tuple[int, int]) -> dict[str, Any]:
        images = [{"type": "input_image", "image_url": data_url(w, h, 7)} for w, h in sizes]
        return {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}, *images]}

    items: list[dict[str, Any]] = [user("What is this?", (56, 56))]
    bundles = []
    for following in (user("And this?", (84, 56)), None):
        response = httpx.post(
            f"{vision_adapter}/v1/responses",
            json={"model": VLM_NAME, "input": items, "max_output_tokens": 6},
            timeout=300,
        )
        assert response.status_code == 200, response.text[:500]
        output = response.json()["output"]
        bundles.append(next(item for item in reversed(output) if "prompt_token_ids" in item))
        items += output + ([following] if following else [])
    first, second = bundles
    assert [run["length"] for run in second["image_runs"]] == [image_pad_count(56, 56), image_pad_count(84, 56)]
    prefix = first["prompt_token_ids"] + first["generation_token_ids"]
    assert second["prompt_token_ids"][: len(prefix)] == prefix


def test_ngt_inspect_marks_each_images_ids(episode) -> None:
    from nemo_gym_tok.records.inspect_html import page_data

    _, answers, _ = episode
    record = {"rollout_id": "vision-0", "response": {"output": [{"type": "message", **a} for a in answers]}}
    (rollout,) = page_data([record], None, "t")["rollouts"]
    assert rollout["error"] is None and rollout["images"] == len(SIZES)
    (sequence,) = rollout["sequences"]
    marked = [i for i, kind in enumerate(sequence["kinds"]) if kind == "i"]
    expected = [
        p
        for position, length in image_runs(answers[-1]["prompt_token_ids"])
        for p in range(position, position + length)
    ]
    assert marked == expected
