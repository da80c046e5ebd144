"""The static vLLM wheel check (`ngt vllm-compat`) on small hand-written sources (no download, no vLLM import); the
stock wheels are checked by tests/vllm_wheels (`make test-vllm-wheels`, in CI)."""

from __future__ import annotations

import textwrap
import zipfile
from collections import defaultdict
from pathlib import Path

import pytest

from nemo_gym_tok.vllm import hook, internals, routes
from nemo_gym_tok.vllm_wheels import compat

RENDERER = "vllm.renderers.online_renderer"
BASE = "vllm.renderers.base"

PREPROCESS_033 = """
    async def preprocess_chat(self, request, messages, default_template, default_template_content_format,
                              default_template_kwargs, tool_dicts=None, parser=None, *, skip_mm_cache=False):
        renderer = self.renderer
        reuse_ids = _reused_prompt_token_ids(request, renderer, messages)
        if reuse_ids:
            conversation, engine_input = [], {"prompt_token_ids": reuse_ids}
        else:
            (conversation,), (engine_input,) = await renderer.render_chat_async([messages], chat_params, tok_params)
        if parser is not None:
            request_parser = parser(self.tokenizer, request.tools)
            request_parser.set_prompt_token_ids(engine_input["prompt_token_ids"])
            request = request_parser.adjust_request(request=request)
        return conversation, [engine_input]
"""
PREPROCESS_032 = """
    async def preprocess_chat(self, request, messages, default_template, default_template_content_format,
                              default_template_kwargs, tool_dicts=None, parser=None, *, skip_mm_cache=False):
        reuse_ids = _reused_prompt_token_ids(request)
        (conversation,), (engine_input,) = await self.renderer.render_chat_async([messages], chat_params, tok_params)
        if parser is not None:
            request = parser(self.tokenizer, request.tools).adjust_request(request=request)
        return conversation, [engine_input]
"""
TOKEN_IN = """
def _reused_prompt_token_ids(request, renderer=None, messages=None):
    kv = getattr(request, "kv_transfer_params", None)
    return kv.pop("prompt_token_ids", None) if isinstance(kv, dict) else None
"""
# vLLM's chat tokenization as of 0.30 to 0.33 (vllm/renderers/base.py), shortened; the @overload stub comes first.
TOKENIZATION = """
    async def render_chat_async(self, conversations, chat_params, tok_params=None, *, prompt_extras=None):
        rendered = [self.render_messages_async(conversation, chat_params) for conversation in conversations]
        dict_prompts = [prompt for _, prompt in await asyncio.gather(*rendered)]
        tok_prompts = await self.tokenize_prompts_async(dict_prompts, tok_params)
        return conversations, tok_prompts

    async def tokenize_prompts_async(self, prompts, params):
        return await asyncio.gather(*(self.tokenize_prompt_async(prompt, params) for prompt in prompts))

    async def tokenize_prompt_async(self, prompt, params):
        if "encoder_prompt" in prompt:
            return await self._tokenize_enc_dec_prompt_async(prompt, params)
        return await self._tokenize_singleton_prompt_async(prompt, params)

    @overload
    async def _tokenize_singleton_prompt_async(self, prompt, params): ...

    async def _tokenize_singleton_prompt_async(self, prompt, params):
        if "prompt_token_ids" not in prompt and "prompt_embeds" not in prompt:
            prompt = params.apply_pre_tokenization(self.tokenizer, prompt)
            prompt = await self._tokenize_prompt_async(prompt, params)
        if params.needs_detokenization and "prompt" not in prompt:
            if "prompt_token_ids" not in prompt:
                raise RuntimeError("Cannot run detokenization on embeddings")
            prompt = await self._detokenize_prompt_async(prompt)
        return params.apply_post_tokenization(self.tokenizer, prompt)
"""
SKIP_TEST = '"prompt_token_ids" not in prompt and "prompt_embeds" not in prompt'
SINGLETON_BODY = """
        if "prompt_token_ids" not in prompt and "prompt_embeds" not in prompt:
            prompt = params.apply_pre_tokenization(self.tokenizer, prompt)
            prompt = await self._tokenize_prompt_async(prompt, params)
"""


def _module_path(module: str) -> str:
    return module.replace(".", "/") + ".py"


def release(
    preprocess: str = PREPROCESS_033,
    token_in: str = TOKEN_IN,
    tokenization: str = TOKENIZATION,
    drop: tuple[str, ...] = (),
) -> dict[str, str]:
    """The files of a made-up vLLM release holding everything the hook wraps and uses (built from the hook's own
    constants, so the fixture follows them), minus the `drop`ped names; the wrapped tokenize_prompts_async comes
    with the rest of vLLM's chat tokenization (`tokenization`)."""
    methods: dict[tuple[str, str], list[str]] = defaultdict(list)
    for module, class_name, method in (*hook.PATCHED_METHODS, *routes.ROUTE_METHODS):
        if method in drop:
            continue
        if method == "preprocess_chat":
            methods[(module, class_name)].append(textwrap.indent(textwrap.dedent(preprocess), "    "))
        elif method == "_make_request_with_harmony":
            methods[(module, class_name)].append(
                "    def _make_request_with_harmony(self, request, should_include_tools=True):\n        return [], []\n"
            )
        elif method == "tokenize_prompts_async":
            methods[(module, class_name)].append(textwrap.indent(textwrap.dedent(tokenization), "    "))
        else:
            methods[(module, class_name)].append(f"    def {method}(self, *args, **kwargs):\n        pass\n")
    files: dict[str, list[str]] = defaultdict(list)
    for (module, class_name), bodies in methods.items():
        files[_module_path(module)].append(f"class {class_name}:\n" + "".join(bodies))
    files[_module_path(RENDERER)].append(textwrap.dedent(token_in))
    for module, symbol in internals.USED_SYMBOLS:
        if symbol not in drop:
            files[_module_path(module)].append(f"class {symbol}:\n    pass\n")
    fields: dict[tuple[str, str], list[str]] = defaultdict(list)
    for module, class_name, name in internals.USED_FIELDS:  # dataclass fields, as vllm/outputs.py declares them
        if name not in drop:
            fields[(module, class_name)].append(f"    {name}: object = None\n")
    for (module, class_name), lines in fields.items():
        files[_module_path(module)].append(f"@dataclass\nclass {class_name}:\n" + "".join(lines))
    return {path: "\n\n".join(parts) for path, parts in files.items()}


def check(files: dict[str, str], version: str = "0.33.0") -> compat.ReleaseReport:
    return compat.check_release(compat.ModuleSources.from_files(files), version=version)


def test_a_release_with_everything_fits() -> None:
    report = check(release())
    assert report.problems == []
    assert report.patched_found == len(hook.PATCHED_METHODS) + len(routes.ROUTE_METHODS) == 14
    assert report.symbols_found == len(internals.USED_SYMBOLS)
    assert report.token_in
    assert report.splice_point == compat.SplicePoint(True, True, True, True, True)
    assert report.splice_point.gaps() == []


def test_the_032_preprocess_chat_fits_too() -> None:
    report = check(release(preprocess=PREPROCESS_032), "0.32.0")
    assert report.ok and report.splice_point is not None and report.splice_point.gaps() == []


def test_a_missing_method_and_symbol_are_named() -> None:
    report = check(release(drop=("warmup", "merge_kwargs")))
    assert f"missing {RENDERER}.OnlineRenderer.warmup" in report.problems
    assert "missing vllm.renderers.params.merge_kwargs" in report.problems
    assert not report.ok


def test_a_missing_route_guard_is_named() -> None:
    """A release that moved a route the guards wrap (here Anthropic's /v1/messages) is incompatible, by name."""
    report = check(release(drop=("create_messages",)))
    assert report.problems == ["missing vllm.entrypoints.anthropic.serving.AnthropicServingMessages.create_messages"]


def test_a_route_method_a_release_predates_is_expected_not_missing() -> None:
    """0.29 has no ServingRender.render_responses_request (/v1/responses/render came with 0.30): nothing to guard
    there, so the release fits with 13 of its 13 methods; the same method missing from 0.30 on is a move."""
    added = (routes.RENDER_MODULE, "ServingRender", "render_responses_request")
    report = check(release(drop=(added[2],)), "0.29.0")
    assert report.problems == []
    assert (report.patched_found, report.patched_expected) == (13, 13)
    assert report.not_in_release == [".".join(added)]
    table = compat.format_reports([report]).splitlines()
    assert table[2].startswith("0.29.0") and "13/13" in table[2] and table[2].split()[-1] == "ok"
    assert table[3] == (
        f"vLLM 0.29.0: no {'.'.join(added)}, expected (added in a later release; its route is not guarded here)"
    )
    for later in ("0.30.0", "0.33.0", ""):
        report = check(release(drop=(added[2],)), later)
        assert report.problems == [f"missing {'.'.join(added)}"] and report.not_in_release == []
        assert (report.patched_found, report.patched_expected) == (13, 14)
    assert check(release(drop=("create_messages",)), "0.29.0").problems == [
        "missing vllm.entrypoints.anthropic.serving.AnthropicServingMessages.create_messages"
    ]


def test_a_missing_parameter_is_named() -> None:
    report = check(release(preprocess=PREPROCESS_033.replace("tool_dicts=None, ", "")))
    assert report.problems == ["preprocess_chat has no parameter tool_dicts="]
    assert not report.signatures_ok
    renamed = TOKENIZATION.replace(
        "def tokenize_prompts_async(self, prompts, params)", "def tokenize_prompts_async(self, prompts, tok_params)"
    )
    report = check(release(tokenization=renamed))
    assert report.problems == ["tokenize_prompts_async has no parameter params="]


def test_methods_are_found_on_base_classes_across_relative_imports() -> None:
    files = release(drop=("warmup",))
    files[_module_path(RENDERER)] = files[_module_path(RENDERER)].replace(
        "class OnlineRenderer:", "from .base import RendererBase\n\n\nclass OnlineRenderer(RendererBase):"
    )
    files["vllm/renderers/base.py"] += "\n\nclass RendererBase:\n    def warmup(self):\n        pass\n"
    assert check(files).problems == []


def test_the_tokenization_chain_is_followed_into_base_classes() -> None:
    """_tokenize_singleton_prompt_async on a base class of BaseRenderer, in another module, counts."""
    own, singleton = TOKENIZATION.split("    @overload\n")
    files = release(tokenization=own)
    files[_module_path(BASE)] = "from vllm.renderers.tokenizing import Tokenizing\n\n\n" + files[
        _module_path(BASE)
    ].replace("class BaseRenderer:", "class BaseRenderer(Tokenizing, Generic[_T]):")
    files["vllm/renderers/tokenizing.py"] = "class Tokenizing:\n" + singleton
    assert check(files).problems == []
    files["vllm/renderers/tokenizing.py"] = "class Tokenizing:\n    pass\n"
    assert check(files).problems == [
        f"{BASE}.BaseRenderer has no def of _tokenize_singleton_prompt_async: the spliced ids would be replaced by "
        "the template's"
    ]


def test_re_exports_count_but_type_checking_imports_do_not() -> None:
    files = release(drop=("VLLMValidationError",))
    files["vllm/exceptions.py"] = "from vllm.errors import VLLMValidationError\n"
    files["vllm/errors.py"] = "class VLLMValidationError(ValueError):\n    pass\n"
    assert check(files).problems == []
    files["vllm/exceptions.py"] = (
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from vllm.errors import VLLMValidationError\n"
    )
    assert check(files).problems == ["missing vllm.exceptions.VLLMValidationError"]


def test_a_lost_token_in_path_is_reported() -> None:
    report = check(release(token_in=TOKEN_IN.replace('"prompt_token_ids"', '"prompt_ids"')))
    assert not report.token_in
    assert "re-check how the hook meets vLLM's token-in path" in report.problems[0]
    no_call = PREPROCESS_033.replace("reuse_ids = _reused_prompt_token_ids(request, renderer, messages)", "")
    assert not check(release(preprocess=no_call)).token_in


def _splice_problems(**changes: str) -> tuple[list[str], list[str]]:
    """The problems of a release changed as given, and the splice point column's labels."""
    report = check(release(**changes))
    assert report.splice_point is not None
    return report.problems, [label for label, _ in report.splice_point.gaps()]


def test_preprocess_chat_must_render_through_render_chat_async() -> None:
    preprocess = PREPROCESS_033.replace("await renderer.render_chat_async(", "await renderer.render_chat(")
    problems, labels = _splice_problems(preprocess=preprocess)
    assert labels == ["no render_chat_async call"]
    assert problems == [
        f"preprocess_chat does not call render_chat_async: the hook's splice at {BASE}.BaseRenderer."
        "tokenize_prompts_async would never see its request"
    ]


def test_render_chat_async_must_call_the_wrapped_tokenize_prompts_async() -> None:
    tokenization = TOKENIZATION.replace(
        "await self.tokenize_prompts_async(dict_prompts, tok_params)",
        "[self.tokenizer.encode(p['prompt']) for p in dict_prompts]",
    )
    problems, labels = _splice_problems(tokenization=tokenization)
    assert labels == ["no tokenize_prompts_async call"]
    assert problems == [
        f"{BASE}.BaseRenderer.render_chat_async does not call self.tokenize_prompts_async: the hook's splice would "
        "never run"
    ]
    # Calling a tokenize_prompts_async on something else (not the renderer the hook wrapped) does not count.
    tokenization = TOKENIZATION.replace("self.tokenize_prompts_async(", "self.other.tokenize_prompts_async(")
    assert _splice_problems(tokenization=tokenization)[1] == ["no tokenize_prompts_async call"]


def test_tokenize_prompts_async_must_lead_to_the_singleton_tokenization() -> None:
    tokenization = TOKENIZATION.replace(
        "return await self._tokenize_singleton_prompt_async(prompt, params)",
        "return await self._tokenize_prompt_async(prompt, params)",
    )
    problems, labels = _splice_problems(tokenization=tokenization)
    assert labels == ["no _tokenize_singleton_prompt_async call"]
    assert problems == [
        f"{BASE}.BaseRenderer.tokenize_prompts_async does not lead to self._tokenize_singleton_prompt_async: re-check "
        "that a prompt holding prompt_token_ids is still not tokenized"
    ]


@pytest.mark.parametrize(
    "body",
    [
        SINGLETON_BODY.replace(SKIP_TEST, '"prompt_embeds" not in prompt'),  # the ids test is gone
        SINGLETON_BODY.replace(SKIP_TEST, '"prompt_token_ids" not in prompt or params.force'),  # `or`: no guard
        SINGLETON_BODY.replace(SKIP_TEST, '"prompt_token_ids" not in params'),  # not the prompt
        SINGLETON_BODY + "        prompt = self._tokenize_prompt(prompt, params)\n",  # tokenized again unguarded
        SINGLETON_BODY.replace("self._tokenize_prompt_async", "self._encode"),  # no tokenize call at all
        '\n        if "prompt_token_ids" in prompt:\n            prompt = dict(prompt)\n'
        "        prompt = await self._tokenize_prompt_async(prompt, params)\n",  # no early return
    ],
    ids=["no ids test", "or", "other name", "unguarded call", "no tokenize call", "in without return"],
)
def test_the_singleton_tokenization_must_skip_a_prompt_with_ids(body: str) -> None:
    problems, labels = _splice_problems(tokenization=TOKENIZATION.replace(SINGLETON_BODY, body))
    assert labels == ["tokenizes prompts with prompt_token_ids"]
    assert problems == [
        f"{BASE}.BaseRenderer._tokenize_singleton_prompt_async does not skip tokenizing a prompt that holds "
        "prompt_token_ids: the spliced ids would be replaced by the template's"
    ]


@pytest.mark.parametrize(
    "body",
    [
        '\n        if "prompt_token_ids" in prompt:\n            return prompt\n'
        "        prompt = await self._tokenize_prompt_async(prompt, params)\n",
        '\n        if "prompt_embeds" in prompt or "prompt_token_ids" in prompt:\n            pass\n        else:\n'
        "            prompt = await self._tokenize_prompt_async(prompt, params)\n",
        '\n        try:\n            if "prompt_token_ids" not in prompt:\n'
        "                prompt = await self._tokenize_prompt_async(prompt, params)\n"
        "        except ValueError:\n            raise\n",
    ],
    ids=["early return", "else branch", "inside try"],
)
def test_other_shapes_of_the_skip_count(body: str) -> None:
    assert _splice_problems(tokenization=TOKENIZATION.replace(SINGLETON_BODY, body)) == ([], [])


def test_moved_tokenization_methods_are_named() -> None:
    moved = TOKENIZATION.replace("def tokenize_prompts_async(", "def tokenize_many_async(")
    problems, labels = _splice_problems(tokenization=moved)
    assert problems == [
        f"missing {BASE}.BaseRenderer.tokenize_prompts_async",
        f"{BASE}.BaseRenderer has no def of tokenize_prompts_async: re-check that a prompt holding prompt_token_ids "
        "is still not tokenized",
    ]
    moved = TOKENIZATION.replace("def render_chat_async(", "def render_chats_async(")
    assert _splice_problems(tokenization=moved)[0] == [
        f"{BASE}.BaseRenderer has no def of render_chat_async: the hook's splice would never run"
    ]


@pytest.mark.parametrize(
    "preprocess",
    [
        # The parser is handed the template's ids before rendering.
        PREPROCESS_033.replace(
            "        renderer = self.renderer\n",
            "        renderer = self.renderer\n        request_parser = parser(self.tokenizer, request.tools)\n"
            "        request_parser.set_prompt_token_ids(self.tokenizer.encode(str(messages)))\n",
        ),
        # The request is adjusted before rendering (the 0.32 shape, moved up).
        PREPROCESS_032.replace(
            "        reuse_ids = _reused_prompt_token_ids(request)\n",
            "        reuse_ids = _reused_prompt_token_ids(request)\n"
            "        request = parser(self.tokenizer, request.tools).adjust_request(request=request)\n",
        ),
    ],
    ids=["set_prompt_token_ids", "adjust_request"],
)
def test_the_parser_must_be_used_after_rendering(preprocess: str) -> None:
    problems, labels = _splice_problems(preprocess=preprocess)
    assert labels == ["parser used before rendering"]
    assert problems == [
        "preprocess_chat uses its request parser before render_chat_async: the parser would not see the spliced "
        "prompt ids"
    ]


def test_a_parser_built_before_rendering_but_used_after_it_fits() -> None:
    build = "request_parser = parser(self.tokenizer, request.tools)\n"
    preprocess = PREPROCESS_033.replace(f"            {build}", "").replace(
        "        renderer = self.renderer\n", f"        renderer = self.renderer\n        {build}"
    )
    assert _splice_problems(preprocess=preprocess) == ([], [])


def test_the_table_names_each_release_and_every_problem() -> None:
    no_skip = TOKENIZATION.replace(SKIP_TEST, '"prompt_embeds" not in prompt')
    reports = [check(release(), "0.33.0"), check(release(drop=("warmup",), tokenization=no_skip), "0.34.0")]
    table = compat.format_reports(reports).splitlines()
    assert table[0].split()[0] == "vLLM" and "splice point" in table[0]
    assert table[2].startswith("0.33.0") and table[2].split()[-2:] == ["ok", "ok"]
    assert table[3].startswith("0.34.0") and "INCOMPATIBLE (outside SUPPORTED_VLLM)" in table[3]
    assert "tokenizes prompts with prompt_token_ids" in table[3]
    assert table[4] == f"vLLM 0.34.0: missing {RENDERER}.OnlineRenderer.warmup"
    assert table[5].startswith(f"vLLM 0.34.0: {BASE}.BaseRenderer._tokenize_singleton_prompt_async does not skip")


def test_supported_releases_follow_the_hook_range() -> None:
    assert compat.supported_releases() == ["0.29.0", "0.30.0", "0.31.0", "0.32.0", "0.33.0"]


def test_sources_are_read_from_the_wheel_zip(tmp_path: Path) -> None:
    wheel = tmp_path / "vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for path, text in release().items():
            archive.writestr(path, text)
        archive.writestr("vllm/renderers/__init__.py", "")
    report = compat.check_wheel(wheel, "0.33.0")
    # The hook's part fits; the weight-update path (tests/test_weight_path_compat.py) is absent from this small wheel.
    assert report.weight_path and report.problems == [f"weight updates: {problem}" for problem in report.weight_path]
    assert report.wheel == wheel.name


def test_a_cached_wheel_is_reused_without_pip(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cached = tmp_path / "vllm-0.31.0-cp38-abi3-manylinux_2_28_x86_64.whl"
    cached.write_bytes(b"")
    (tmp_path / "vllm-0.3.0-py3-none-any.whl").write_bytes(b"")  # another release whose name starts alike

    def no_pip(*args: object, **kwargs: object) -> None:
        raise AssertionError("pip was called for a cached wheel")

    monkeypatch.setattr(compat.subprocess, "run", no_pip)
    assert compat.download_wheel("0.31.0", tmp_path) == cached


# --- weight versions (CompletionOutput.weight_versions, vLLM 0.32 on) ---------------------------------------------


def test_the_wheel_check_reads_which_releases_have_weight_versions() -> None:
    sources = compat.ModuleSources.from_files(release())
    report = compat.check_release(sources, version="0.33.0")
    assert report.ok and report.weight_versions
    without = compat.ModuleSources.from_files(release(drop=("weight_versions",)))
    older = compat.check_release(without, version="0.31.0")
    assert older.ok and not older.weight_versions  # before 0.32: expected
    moved = compat.check_release(compat.ModuleSources.from_files(release(drop=("weight_versions",))), version="0.33.0")
    assert moved.problems == ["missing vllm.outputs.CompletionOutput.weight_versions"]
    table = compat.format_reports([report, older]).splitlines()
    assert "weight versions" in table[0]
    assert table[2].split()[5] == "yes" and table[3].split()[5] == "no"
    assert table[4] == (
        "vLLM 0.31.0: no vllm.outputs.CompletionOutput.weight_versions, expected (added in 0.32): the hook's bundles "
        "carry no weight_version there"
    )


def test_a_missing_stock_wheel_fails_where_the_wheels_are_expected(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """tests/vllm_wheels skips without the wheels, except under NGT_REQUIRE_VLLM_WHEELS=1 (CI), where it fails."""
    from tests.vllm_wheels.test_stock_wheels import REQUIRE_WHEELS_ENV, stock_wheel

    monkeypatch.setenv("NGT_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(REQUIRE_WHEELS_ENV, raising=False)
    with pytest.raises(pytest.skip.Exception, match="no cached vllm 0.33.0 wheel"):
        stock_wheel("0.33.0")
    monkeypatch.setenv(REQUIRE_WHEELS_ENV, "1")
    with pytest.raises(pytest.fail.Exception, match=f"{REQUIRE_WHEELS_ENV}=1 expects it"):
        stock_wheel("0.33.0")
    wheel = tmp_path / "vllm-wheels" / "vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl"
    wheel.parent.mkdir()
    wheel.write_bytes(b"")
    assert stock_wheel("0.33.0") == wheel


def test_the_download_only_run_fetches_and_checks_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`ngt vllm-compat --download-only` (`make vllm-wheels`, in CI's background set-up) fills the cache, no table."""
    from nemo_gym_tok import vllm_wheels
    from nemo_gym_tok.cli import main

    fetched = []

    def download(version: str, directory: Path) -> Path:
        fetched.append(version)
        return directory / f"vllm-{version}-cp38-abi3-manylinux_2_28_x86_64.whl"

    def no_check(*args: object) -> None:
        raise AssertionError("--download-only checked a wheel")

    monkeypatch.setattr(vllm_wheels, "download_wheel", download)
    monkeypatch.setattr(vllm_wheels, "check_wheel", no_check)
    assert main.main(["vllm-compat", "--download-only", "--wheel-dir", str(tmp_path)]) == 0
    assert fetched == compat.supported_releases()
