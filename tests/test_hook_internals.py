"""The hook's grip on vLLM internals: a vLLM upgrade that moves them fails here, naming what moved."""

from __future__ import annotations

import asyncio
import logging

import pytest

from nemo_gym_tok.vllm import hook


def test_every_patched_vllm_symbol_is_where_the_hook_expects_it() -> None:
    missing = hook.check_internals()
    assert missing == [], f"vLLM moved what the prefix-splice hook wraps: {missing}"


@pytest.fixture
def unpatched(monkeypatch: pytest.MonkeyPatch) -> None:
    """Let a test install the hook in this process; monkeypatch restores the original methods afterwards."""
    for module_name, class_name, method in hook.PATCHED_METHODS:
        owner = hook._lookup(module_name, class_name)
        monkeypatch.setattr(owner, method, getattr(owner, method))


@pytest.mark.parametrize("module_name, class_name, method", hook.PATCHED_METHODS)
def test_a_moved_method_is_named(unpatched, monkeypatch: pytest.MonkeyPatch, module_name, class_name, method) -> None:
    monkeypatch.delattr(hook._lookup(module_name, class_name), method)
    assert hook.check_internals() == [f"{module_name}.{class_name}.{method}"]
    with pytest.raises(hook.VLLMInternalsChanged, match=f"missing {module_name}.{class_name}.{method}"):
        hook.install()


def test_a_moved_symbol_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    import vllm.exceptions

    monkeypatch.delattr(vllm.exceptions, "VLLMValidationError")
    assert hook.check_internals() == ["vllm.exceptions.VLLMValidationError"]


@pytest.mark.parametrize(
    "version, supported",
    [
        ("0.30.0", True), ("0.31.2", True), ("0.32.0", True), ("0.33.0+cpu", True), ("0.33.1rc1", True),
        ("0.29.9", False), ("0.34.0", False), ("0.34.0.dev12+g0abc", False), ("1.0.0", False), ("main", False),
    ],
)
def test_supported_range(version: str, supported: bool) -> None:
    assert hook.is_supported_vllm(version) is supported
    assert hook.supported_vllm_text() == "0.30 to 0.33"


@pytest.mark.parametrize("version", ["0.30.0", "0.31.0", "0.33.0"])
def test_any_release_in_range_installs_when_its_internals_are_in_place(
    unpatched, monkeypatch: pytest.MonkeyPatch, version: str
) -> None:
    import vllm

    monkeypatch.setattr(vllm, "__version__", version)
    monkeypatch.delenv(hook.ALLOW_UNTESTED_ENV, raising=False)
    hook.install()
    assert hook.is_installed()


def test_vllm_outside_the_range_is_refused_unless_allowed(
    unpatched, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import vllm

    monkeypatch.setattr(vllm, "__version__", "0.40.1")
    monkeypatch.delenv(hook.ALLOW_UNTESTED_ENV, raising=False)
    with pytest.raises(hook.VLLMInternalsChanged, match="supports vLLM 0.30 to 0.33, found 0.40.1"):
        hook.install()
    assert not hook.is_installed()
    monkeypatch.setenv(hook.ALLOW_UNTESTED_ENV, "1")
    with caplog.at_level(logging.WARNING, logger="nemo_gym_tok.vllm.hook"):
        hook.install()
    assert hook.is_installed()
    assert "vLLM 0.40.1 is outside the supported range 0.30 to 0.33" in caplog.text


def test_allowed_vllm_outside_the_range_still_needs_its_internals(unpatched, monkeypatch: pytest.MonkeyPatch) -> None:
    import vllm

    module_name, class_name, method = hook.PATCHED_METHODS[1]
    monkeypatch.setattr(vllm, "__version__", "0.40.1")
    monkeypatch.setenv(hook.ALLOW_UNTESTED_ENV, "1")
    monkeypatch.delattr(hook._lookup(module_name, class_name), method)
    with pytest.raises(hook.VLLMInternalsChanged, match=f"missing {module_name}.{class_name}.{method}"):
        hook.install()


def test_install_is_idempotent(unpatched) -> None:
    from vllm.renderers.online_renderer import OnlineRenderer

    original = OnlineRenderer.preprocess_chat
    hook.install()
    first = OnlineRenderer.preprocess_chat
    hook.install()
    assert OnlineRenderer.preprocess_chat is first
    assert getattr(first, "__nemo_gym_tok_original__") is original


def test_plugin_is_inert_unless_enabled(unpatched, monkeypatch: pytest.MonkeyPatch) -> None:
    from nemo_gym_tok.vllm.plugin import register

    monkeypatch.delenv(hook.ENABLE_ENV, raising=False)
    register()
    assert not hook.is_installed()
    monkeypatch.setenv(hook.ENABLE_ENV, "1")
    register()
    assert hook.is_installed()


class _Parser:
    """Stand-in for vLLM's request-parser class: records, in order, what preprocess_chat asks of each instance."""

    tool_parser_cls = None
    reasoning_parser_cls = object  # a reasoning parser is set: vLLM adjusts the request whatever the tool choice
    built: list[_Parser] = []

    def __init__(self, tokenizer: object, tools: object, **kwargs: object) -> None:
        self.calls: list[tuple[str, object]] = []
        _Parser.built.append(self)

    def set_prompt_token_ids(self, prompt_token_ids: list[int]) -> None:
        self.calls.append(("set_prompt_token_ids", list(prompt_token_ids)))

    def adjust_request(self, request: object) -> object:
        self.calls.append(("adjust_request", request))
        return request


TEMPLATE_IDS = [1, 2, 5, 6]
SPLICED_IDS = [1, 2, 3, 6]


async def _preprocess_chat_033(
    self: object, request: object, messages: list[object], default_template: object,
    default_template_content_format: object, default_template_kwargs: object, tool_dicts: object = None,
    parser: type[_Parser] | None = None, *, skip_mm_cache: bool = False,
) -> tuple[list[object], list[dict[str, object]]]:
    """The shape of vLLM 0.33's OnlineRenderer.preprocess_chat: render, then build the parser, hand it the prompt ids
    and let it adjust the request."""
    engine_input: dict[str, object] = {"prompt_token_ids": list(TEMPLATE_IDS)}
    if parser is not None and parser.reasoning_parser_cls is not None:
        request_parser = parser(None, None, model_config=None, chat_template_kwargs={})
        request_parser.set_prompt_token_ids(engine_input["prompt_token_ids"])
        request = request_parser.adjust_request(request=request)
    return [], [engine_input]


async def _preprocess_chat_032(
    self: object, request: object, messages: list[object], default_template: object,
    default_template_content_format: object, default_template_kwargs: object, tool_dicts: object = None,
    parser: type[_Parser] | None = None, *, skip_mm_cache: bool = False,
) -> tuple[list[object], list[dict[str, object]]]:
    """The shape of vLLM 0.30 to 0.32: the parser only adjusts the request."""
    if parser is not None:
        request = parser(None, None, model_config=None, chat_template_kwargs={}).adjust_request(request=request)
    return [], [{"prompt_token_ids": list(TEMPLATE_IDS)}]


class _Request:
    """A request object (weak-referenceable, like vLLM's pydantic requests)."""


@pytest.fixture
def stand_in_splice(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """The hook's prefix reading and splice replaced: every request carries a bundle, the splice gives SPLICED_IDS.
    Returns the list a test fills with an exception for the splice to raise instead."""
    from nemo_gym_tok.splice import PrefixSource, SpliceResult

    failure: list[object] = []
    source = PrefixSource(prefix=SPLICED_IDS[:3], message_index=1, explicit=False, prompt_length=2)
    result = SpliceResult(
        prompt_token_ids=list(SPLICED_IDS), kept_prefix_length=3, template_differed=True, replaced_tokens=1,
        end_token_replaced=False, repaired_turns=None,
    )

    def splice(*args: object) -> SpliceResult:
        if failure:
            raise failure[0]
        return result

    monkeypatch.setattr(hook, "_read_prefix", lambda online, request, messages: (source, False))
    monkeypatch.setattr(hook, "_splice", splice)
    _Parser.built.clear()
    return failure


def _preprocess(original: object, request: object, parser: object) -> list[dict[str, object]]:
    wrapped = hook._preprocess_chat_with_splice(original)
    _, engine_inputs = asyncio.run(wrapped(object(), request, [], None, None, None, None, parser))
    return engine_inputs


def test_vllm_033_parser_gets_the_spliced_prompt_ids(stand_in_splice) -> None:
    request = _Request()
    engine_inputs = _preprocess(_preprocess_chat_033, request, _Parser)
    assert engine_inputs[0]["prompt_token_ids"] == SPLICED_IDS
    (parser,) = _Parser.built
    # Prompt first, then the adjustment, as vLLM orders them; only the spliced ids, never the template's.
    assert parser.calls == [("set_prompt_token_ids", SPLICED_IDS), ("adjust_request", request)]


def test_parser_without_a_prompt_call_is_adjusted_once(stand_in_splice) -> None:
    request = _Request()
    _preprocess(_preprocess_chat_032, request, _Parser)
    (parser,) = _Parser.built
    assert parser.calls == [("adjust_request", request)]


def test_no_parser_no_stand_in(stand_in_splice) -> None:
    assert _preprocess(_preprocess_chat_033, _Request(), None)[0]["prompt_token_ids"] == SPLICED_IDS
    assert _Parser.built == []


def test_refused_splice_leaves_the_parser_untouched(stand_in_splice) -> None:
    from vllm.exceptions import VLLMValidationError

    from nemo_gym_tok.splice import SpliceError

    stand_in_splice.append(SpliceError("the token bundle of messages[1] does not belong to these messages"))
    with pytest.raises(VLLMValidationError, match="does not belong"):
        _preprocess(_preprocess_chat_033, _Request(), _Parser)
    (parser,) = _Parser.built
    assert parser.calls == []


def test_request_without_prefix_reaches_vllm_untouched(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hook, "_read_prefix", lambda online, request, messages: (None, False))
    _Parser.built.clear()
    request = _Request()
    assert _preprocess(_preprocess_chat_033, request, _Parser)[0]["prompt_token_ids"] == TEMPLATE_IDS
    (parser,) = _Parser.built
    assert parser.calls == [("set_prompt_token_ids", TEMPLATE_IDS), ("adjust_request", request)]
