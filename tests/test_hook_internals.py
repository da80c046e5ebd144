"""The hook's grip on vLLM internals: a vLLM upgrade that moves them fails here, naming what moved."""

from __future__ import annotations

import asyncio
import importlib
import logging

import pytest

from nemo_gym_tok.splice_host import SpliceRequest
from nemo_gym_tok.vllm import hook, internals
from nemo_gym_tok.vllm import telemetry as vllm_telemetry


def test_every_patched_vllm_symbol_is_where_the_hook_expects_it() -> None:
    missing = hook.check_internals()
    assert missing == [], f"vLLM moved what the prefix-splice hook wraps: {missing}"


@pytest.fixture
def unpatched(monkeypatch: pytest.MonkeyPatch) -> None:
    """Let a test install the hook in this process; monkeypatch restores the original methods afterwards."""
    for module_name, class_name, method in hook.PATCHED_METHODS:
        owner = internals.lookup(module_name, class_name)
        monkeypatch.setattr(owner, method, getattr(owner, method))


@pytest.mark.parametrize("module_name, class_name, method", hook.PATCHED_METHODS)
def test_a_moved_method_is_named(unpatched, monkeypatch: pytest.MonkeyPatch, module_name, class_name, method) -> None:
    monkeypatch.delattr(internals.lookup(module_name, class_name), method)
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
        ("0.29.0", True),
        ("0.30.0", True),
        ("0.31.2", True),
        ("0.32.0", True),
        ("0.33.0+cpu", True),
        ("0.33.1rc1", True),
        ("0.28.9", False),
        ("0.34.0", False),
        ("0.34.0.dev12+g0abc", False),
        ("1.0.0", False),
        ("main", False),
    ],
)
def test_supported_range(version: str, supported: bool) -> None:
    assert hook.is_supported_vllm(version) is supported
    assert hook.supported_vllm_text() == "0.29 to 0.33"


@pytest.fixture
def every_route_method(monkeypatch: pytest.MonkeyPatch, every_used_field: None) -> None:
    """On a vLLM that predates a route method (0.29: routes.ROUTE_SINCE), a stand-in for it, so that a test posing as
    a later release finds that release's internals in place (the output fields too: every_used_field)."""
    from nemo_gym_tok.vllm import routes

    async def stand_in(self: object, request: object, *args: object, **kwargs: object) -> None:
        raise AssertionError("the stand-in route method was called")

    for module_name, class_name, method in routes.ROUTE_SINCE:
        owner = internals.lookup(module_name, class_name)
        if not hasattr(owner, method):
            monkeypatch.setattr(owner, method, stand_in, raising=False)


@pytest.fixture
def every_used_field(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a vLLM that predates an output field the answer wrappers read (0.29 to 0.31: internals.FIELD_SINCE), a
    stand-in annotation for it, so that a test posing as 0.32 or later finds that release's internals in place."""
    for module_name, class_name, name in internals.USED_FIELDS:
        module = importlib.import_module(module_name)
        owner = getattr(module, class_name, None)
        if owner is None:
            owner = type(class_name, (), {"__annotations__": {}})
            monkeypatch.setattr(module, class_name, owner, raising=False)
        if not internals.has_field(owner, name):
            monkeypatch.setattr(owner, "__annotations__", {**vars(owner).get("__annotations__", {}), name: object})


@pytest.mark.parametrize("version", ["0.29.0", "0.30.0", "0.31.0", "0.33.0"])
def test_any_release_in_range_installs_when_its_internals_are_in_place(
    unpatched, every_route_method, monkeypatch: pytest.MonkeyPatch, version: str
) -> None:
    import vllm

    monkeypatch.setattr(vllm, "__version__", version)
    monkeypatch.delenv(hook.ALLOW_UNTESTED_ENV, raising=False)
    hook.install()
    assert hook.is_installed()


def test_vllm_outside_the_range_is_refused_unless_allowed(
    unpatched, every_route_method, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import vllm

    monkeypatch.setattr(vllm, "__version__", "0.40.1")
    monkeypatch.delenv(hook.ALLOW_UNTESTED_ENV, raising=False)
    with pytest.raises(hook.VLLMInternalsChanged, match="supports vLLM 0.29 to 0.33, found 0.40.1"):
        hook.install()
    assert not hook.is_installed()
    monkeypatch.setenv(hook.ALLOW_UNTESTED_ENV, "1")
    with caplog.at_level(logging.WARNING, logger="nemo_gym_tok.vllm.hook"):
        hook.install()
    assert hook.is_installed()
    assert "vLLM 0.40.1 is outside the supported range 0.29 to 0.33" in caplog.text


def test_allowed_vllm_outside_the_range_still_needs_its_internals(
    unpatched, every_route_method, monkeypatch: pytest.MonkeyPatch
) -> None:
    import vllm

    module_name, class_name, method = hook.PATCHED_METHODS[1]
    monkeypatch.setattr(vllm, "__version__", "0.40.1")
    monkeypatch.setenv(hook.ALLOW_UNTESTED_ENV, "1")
    monkeypatch.delattr(internals.lookup(module_name, class_name), method)
    with pytest.raises(hook.VLLMInternalsChanged, match=f"missing {module_name}.{class_name}.{method}"):
        hook.install()


@pytest.mark.parametrize(
    "version, expected", [("0.29.0", True), ("0.29.3+cpu", True), ("0.30.0", False), ("0.33.0", False)]
)
def test_a_route_method_is_absent_by_design_only_before_its_first_release(
    unpatched, every_used_field, monkeypatch: pytest.MonkeyPatch, version: str, expected: bool
) -> None:
    """/v1/responses/render came with vLLM 0.30: on 0.29 there is no route to guard and the hook installs without
    it; on 0.30 and later its method missing means vLLM moved it, and the hook refuses, naming it."""
    import vllm

    from nemo_gym_tok.vllm import routes

    for module_name, class_name, method in routes.ROUTE_METHODS:  # let install() wrap them; restored afterwards
        owner = internals.lookup(module_name, class_name)
        if hasattr(owner, method):
            monkeypatch.setattr(owner, method, getattr(owner, method))
    added = (routes.RENDER_MODULE, "ServingRender", "render_responses_request")
    assert routes.ROUTE_SINCE[added] == (0, 30)
    owner = internals.lookup(*added[:2])
    monkeypatch.delattr(owner, added[2], raising=False)  # absent already on vLLM 0.29
    guard_before = owner.render_messages_request
    monkeypatch.setattr(vllm, "__version__", version)
    monkeypatch.delenv(hook.ALLOW_UNTESTED_ENV, raising=False)
    assert routes.absent_by_design(added, version) is expected
    if expected:
        assert hook.check_internals() == []
        hook.install()
        assert hook.is_installed() and not hasattr(owner, added[2])
        # The other guards are in: /v1/messages/render's method was wrapped by this install.
        assert getattr(owner.render_messages_request, "__nemo_gym_tok_original__") is guard_before
    else:
        assert hook.check_internals() == [".".join(added)]
        with pytest.raises(hook.VLLMInternalsChanged, match=f"missing {'.'.join(added)}"):
            hook.install()
        assert not hook.is_installed()


def test_only_a_route_method_with_a_first_release_can_be_absent_by_design() -> None:
    from nemo_gym_tok.vllm import routes

    for route_method in routes.ROUTE_METHODS:
        assert routes.absent_by_design(route_method, "0.29.0") is (route_method in routes.ROUTE_SINCE)
        assert not routes.absent_by_design(route_method, "main")  # no release named: nothing is excused
    assert not routes.absent_by_design(hook.PATCHED_METHODS[0], "0.1.0")


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


TEMPLATE_TEXT = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
TEMPLATE_IDS = [1, 2, 5, 6]
SPLICED_IDS = [1, 2, 3, 6]


class _Renderer:
    """The shape of vLLM's BaseRenderer: render_chat_async renders the template's text, then hands it to
    tokenize_prompts_async, which tokenizes every prompt that does not hold its ids yet."""

    def __init__(self) -> None:
        self.tokenized: list[str] = []

    async def tokenize_prompts_async(self, prompts: list[dict[str, object]], params: object) -> list[dict[str, object]]:
        answers = []
        for prompt in prompts:
            if "prompt_token_ids" not in prompt:
                self.tokenized.append(str(prompt["prompt"]))
                prompt = {**prompt, "prompt_token_ids": list(TEMPLATE_IDS)}
            answers.append(prompt)
        return answers

    async def render_chat_async(self, conversations: object, params: object) -> tuple[list[object], list[object]]:
        await asyncio.sleep(0)  # other requests' preprocessing interleaves here, as in the server
        return [[]], await self.tokenize_prompts_async([{"prompt": TEMPLATE_TEXT}], params)


class _Online:
    def __init__(self) -> None:
        self.renderer = _Renderer()


async def _preprocess_chat_033(
    self: _Online,
    request: object,
    messages: list[object],
    default_template: object,
    default_template_content_format: object,
    default_template_kwargs: object,
    tool_dicts: object = None,
    parser: type[_Parser] | None = None,
    *,
    skip_mm_cache: bool = False,
) -> tuple[list[object], list[dict[str, object]]]:
    """The shape of vLLM 0.33's OnlineRenderer.preprocess_chat: render, then build the parser, hand it the prompt ids
    and let it adjust the request."""
    _, (engine_input,) = await self.renderer.render_chat_async([messages], None)
    if parser is not None and parser.reasoning_parser_cls is not None:
        request_parser = parser(None, None, model_config=None, chat_template_kwargs={})
        request_parser.set_prompt_token_ids(engine_input["prompt_token_ids"])
        request = request_parser.adjust_request(request=request)
    return [], [engine_input]


async def _preprocess_chat_032(
    self: _Online,
    request: object,
    messages: list[object],
    default_template: object,
    default_template_content_format: object,
    default_template_kwargs: object,
    tool_dicts: object = None,
    parser: type[_Parser] | None = None,
    *,
    skip_mm_cache: bool = False,
) -> tuple[list[object], list[dict[str, object]]]:
    """The shape of vLLM 0.30 to 0.32: the parser only adjusts the request."""
    _, engine_inputs = await self.renderer.render_chat_async([messages], None)
    if parser is not None:
        request = parser(None, None, model_config=None, chat_template_kwargs={}).adjust_request(request=request)
    return [], engine_inputs


async def _preprocess_chat_token_reuse(
    self: _Online, request: object, messages: list[object], *args: object, **kwargs: object
) -> tuple[list[object], list[dict[str, object]]]:
    """vLLM's kv_transfer_params token-reuse path: nothing is rendered or tokenized."""
    return [], [{"prompt_token_ids": [7, 8, 9]}]


class _Request:
    """A request object (weak-referenceable, like vLLM's pydantic requests)."""


@pytest.fixture
def stand_in_splice(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[object]]:
    """The hook's prefix reading and splice replaced: requests whose `messages` is ["bundled"] carry a bundle, and
    the splice gives SPLICED_IDS. Returns {"texts": the template texts the splice got, "failure": an exception a test
    puts there for the splice to raise instead, "verified": one entry per verification the splice's prompt got (the
    stand-in defers it, as for a chat completion answered whole), "late_failure": an exception a test puts there for
    that verification to raise}."""
    from nemo_gym_tok.splice import PrefixSource, SplicedPrompt

    seen: dict[str, list[object]] = {"texts": [], "failure": [], "verified": [], "late_failure": []}
    source = PrefixSource(prefix=SPLICED_IDS[:3], message_index=1, explicit=False, prompt_length=2)

    def verify() -> None:
        seen["verified"].append(True)
        if seen["late_failure"]:
            raise seen["late_failure"][0]

    def splice(online: object, request: object, messages: object, arguments: object, source: object, text: str):
        if seen["failure"]:
            raise seen["failure"][0]
        seen["texts"].append(text)
        return SplicedPrompt(list(SPLICED_IDS), 3, False, True, verify=verify, measure_turn=lambda: (True, 1, None))

    monkeypatch.setattr(
        hook,
        "read_request",
        lambda online, request, messages, **_: SpliceRequest(source if messages == ["bundled"] else None, False),
    )
    monkeypatch.setattr(hook, "check_vocabulary", lambda online, source, start=0: None)  # no model config here
    monkeypatch.setattr(hook, "_splice", splice)
    monkeypatch.setattr(hook, "_splice_new_turn", lambda *args: None)  # these requests take the tokenization step
    monkeypatch.setattr(
        _Renderer, "tokenize_prompts_async", hook.tokenize_with_splice(_Renderer.tokenize_prompts_async)
    )
    _Parser.built.clear()
    return seen


def _preprocess(
    original: object, request: object, parser: object, online: _Online | None = None, messages: object = ("bundled",)
) -> list[dict[str, object]]:
    wrapped = hook.preprocess_chat_with_splice(original)
    _, engine_inputs = asyncio.run(
        wrapped(online or _Online(), request, list(messages), None, None, None, None, parser)
    )
    return engine_inputs


def test_spliced_ids_replace_tokenizing_the_template_text(stand_in_splice) -> None:
    online = _Online()
    engine_inputs = _preprocess(_preprocess_chat_032, _Request(), None, online)
    assert engine_inputs[0]["prompt_token_ids"] == SPLICED_IDS
    assert "prompt" not in engine_inputs[0]  # the template's text does not describe the spliced ids
    assert stand_in_splice["texts"] == [TEMPLATE_TEXT]  # the splice read the text vLLM rendered ...
    assert online.renderer.tokenized == []  # ... which was never tokenized


def _chat_request(*, stream: bool) -> object:
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    return ChatCompletionRequest(model="tiny", messages=[{"role": "user", "content": "hi"}], stream=stream)


def test_a_whole_answer_is_verified_while_the_engine_generates(stand_in_splice) -> None:
    """A chat completion answered whole gets its prompt before the splice's verification runs; the response wrapper
    awaits it (and the turn's measurement) before anything goes out."""
    request = _chat_request(stream=False)
    assert _preprocess(_preprocess_chat_032, request, None)[0]["prompt_token_ids"] == SPLICED_IDS
    assert stand_in_splice["verified"] == []
    telemetry = asyncio.run(vllm_telemetry.resolve_telemetry(vllm_telemetry.in_flight.pop(id(request))))
    assert stand_in_splice["verified"] == [True]
    assert telemetry == {"applied": True, "template_differed": True, "replaced_tokens": 1}


@pytest.mark.parametrize(
    ("failure", "message"),
    [
        ("refused", "cannot prove"),  # the splice's own reason
        ("crashed", "could not be verified"),  # an unexpected error: unverified, nothing generated goes out
    ],
)
def test_a_failed_late_verification_is_a_400_not_an_answer(stand_in_splice, failure, message) -> None:
    from vllm.exceptions import VLLMValidationError

    from nemo_gym_tok.splice import UnsupportedTemplateError

    request = _chat_request(stream=False)
    _preprocess(_preprocess_chat_032, request, None)
    error = (
        UnsupportedTemplateError("the splice cannot prove such a prompt exact") if failure == "refused" else KeyError(1)
    )
    stand_in_splice["late_failure"].append(error)
    with pytest.raises(VLLMValidationError, match=message):
        asyncio.run(vllm_telemetry.resolve_telemetry(vllm_telemetry.in_flight.pop(id(request))))


def test_only_a_chat_completion_answered_whole_is_verified_late() -> None:
    """A stream's first byte (or /tokenize's answer) may leave before the response wrapper runs: the splice verifies
    those at once (falling back to the full check), and defers only a chat completion answered whole by
    create_chat_completion. The same request on another route (/v1/chat/completions/render answers its ids without
    that wrapper) verifies at once."""
    from nemo_gym_tok.vllm import routes

    async def create_chat_completion(self, request):
        return hook.answered_whole(request)

    answered = routes._chat_completion_marking_wrapper(create_chat_completion)
    assert asyncio.run(answered(None, _chat_request(stream=False)))
    assert not asyncio.run(answered(None, _chat_request(stream=True)))
    assert not asyncio.run(answered(None, _Request()))
    assert not hook.answered_whole(_chat_request(stream=False))  # outside create_chat_completion: the render route


def test_vllm_033_parser_gets_the_spliced_prompt_ids(stand_in_splice) -> None:
    request = _Request()
    engine_inputs = _preprocess(_preprocess_chat_033, request, _Parser)
    assert engine_inputs[0]["prompt_token_ids"] == SPLICED_IDS
    (parser,) = _Parser.built
    # Prompt first, then the adjustment, as vLLM orders them; only the spliced ids, never the template's.
    assert parser.calls == [("set_prompt_token_ids", SPLICED_IDS), ("adjust_request", request)]


def test_refused_splice_never_reaches_the_parser(stand_in_splice) -> None:
    from vllm.exceptions import VLLMValidationError

    from nemo_gym_tok.splice import SpliceError

    stand_in_splice["failure"].append(SpliceError("the token bundle of messages[1] does not belong to these messages"))
    with pytest.raises(VLLMValidationError, match="does not belong"):
        _preprocess(_preprocess_chat_033, _Request(), _Parser)
    assert _Parser.built == []


def test_request_without_prefix_reaches_vllm_untouched(stand_in_splice) -> None:
    online, request = _Online(), _Request()
    assert (
        _preprocess(_preprocess_chat_033, request, _Parser, online, messages=[])[0]["prompt_token_ids"] == TEMPLATE_IDS
    )
    assert online.renderer.tokenized == [TEMPLATE_TEXT]
    (parser,) = _Parser.built
    assert parser.calls == [("set_prompt_token_ids", TEMPLATE_IDS), ("adjust_request", request)]
    assert stand_in_splice["texts"] == []


def test_concurrent_requests_each_get_their_own_prompt(stand_in_splice) -> None:
    """The pending splice follows its request: a request without a prefix preprocessed at the same time is
    tokenized as vLLM would, and never gets the other request's ids."""
    wrapped = hook.preprocess_chat_with_splice(_preprocess_chat_032)
    online = _Online()

    async def both() -> list[object]:
        return await asyncio.gather(
            wrapped(online, _Request(), ["bundled"], None, None, None, None, None),
            wrapped(online, _Request(), [], None, None, None, None, None),
            wrapped(online, _Request(), ["bundled"], None, None, None, None, None),
        )

    answers = asyncio.run(both())
    assert [engine_inputs[0]["prompt_token_ids"] for _, engine_inputs in answers] == [
        SPLICED_IDS,
        TEMPLATE_IDS,
        SPLICED_IDS,
    ]
    assert online.renderer.tokenized == [TEMPLATE_TEXT]


def test_a_prefix_on_vllms_token_reuse_path_is_refused(stand_in_splice) -> None:
    from vllm.exceptions import VLLMValidationError

    with pytest.raises(VLLMValidationError, match="kv_transfer_params.prompt_token_ids"):
        _preprocess(_preprocess_chat_token_reuse, _Request(), None)


def test_preprocessing_time_is_observed_by_path(stand_in_splice) -> None:
    from prometheus_client import REGISTRY

    def count(path: str) -> float:
        return REGISTRY.get_sample_value("nemo_gym_tok_preprocess_seconds_count", {"path": path}) or 0.0

    before = {path: count(path) for path in ("spliced", "template", "refused")}
    _preprocess(_preprocess_chat_032, _Request(), None)
    _preprocess(_preprocess_chat_032, _Request(), None, messages=[])
    assert count("spliced") == before["spliced"] + 1
    assert count("template") == before["template"] + 1
    assert count("refused") == before["refused"]


def test_vllms_token_reuse_step_is_in_place() -> None:
    """Where the hook hands a next turn's spliced ids to the engine, nothing rendered (internals.TOKEN_REUSE): an
    upgrade that moves it fails here (the hook would still splice, through vLLM's rendering, only slower)."""
    from nemo_gym_tok.vllm.internals import reuses_forwarded_ids

    assert reuses_forwarded_ids()
