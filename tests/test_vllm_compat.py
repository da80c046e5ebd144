"""The static vLLM wheel check (`ngt vllm-compat`) on small hand-written sources: no download, no vLLM import."""

from __future__ import annotations

import textwrap
import zipfile
from collections import defaultdict
from pathlib import Path

import pytest

from nemo_gym_tok.vllm import compat, hook

RENDERER = "vllm.renderers.online_renderer"

PREPROCESS_033 = """
    async def preprocess_chat(self, request, messages, default_template, default_template_content_format,
                              default_template_kwargs, tool_dicts=None, parser=None, *, skip_mm_cache=False):
        reuse_ids = _reused_prompt_token_ids(request, self.renderer, messages)
        engine_input = await self.render(messages)
        if parser is not None:
            request_parser = parser(self.tokenizer, request.tools)
            request_parser.set_prompt_token_ids(engine_input["prompt_token_ids"])
            request = request_parser.adjust_request(request=request)
        return [], [engine_input]
"""
PREPROCESS_032 = """
    async def preprocess_chat(self, request, messages, default_template, default_template_content_format,
                              default_template_kwargs, tool_dicts=None, parser=None, *, skip_mm_cache=False):
        reuse_ids = _reused_prompt_token_ids(request)
        engine_input = await self.render(messages)
        if parser is not None:
            request = parser(self.tokenizer, request.tools).adjust_request(request=request)
        return [], [engine_input]
"""
TOKEN_IN = '''
def _reused_prompt_token_ids(request, renderer=None, messages=None):
    kv = getattr(request, "kv_transfer_params", None)
    return kv.pop("prompt_token_ids", None) if isinstance(kv, dict) else None
'''


def _module_path(module: str) -> str:
    return module.replace(".", "/") + ".py"


def release(preprocess: str = PREPROCESS_033, token_in: str = TOKEN_IN, drop: tuple[str, ...] = ()) -> dict[str, str]:
    """The files of a made-up vLLM release holding everything the hook wraps and uses (built from the hook's own
    constants, so the fixture follows them), minus the `drop`ped names."""
    methods: dict[tuple[str, str], list[str]] = defaultdict(list)
    for module, class_name, method in hook.PATCHED_METHODS:
        if method in drop:
            continue
        if method == "preprocess_chat":
            methods[(module, class_name)].append(textwrap.indent(textwrap.dedent(preprocess), "    "))
        elif method == "_make_request_with_harmony":
            methods[(module, class_name)].append(
                "    def _make_request_with_harmony(self, request, should_include_tools=True):\n        return [], []\n"
            )
        else:
            methods[(module, class_name)].append(f"    def {method}(self, *args, **kwargs):\n        pass\n")
    files: dict[str, list[str]] = defaultdict(list)
    for (module, class_name), bodies in methods.items():
        files[_module_path(module)].append(f"class {class_name}:\n" + "".join(bodies))
    files[_module_path(RENDERER)].append(textwrap.dedent(token_in))
    for module, symbol in hook.USED_SYMBOLS:
        if symbol not in drop:
            files[_module_path(module)].append(f"class {symbol}:\n    pass\n")
    return {path: "\n\n".join(parts) for path, parts in files.items()}


def check(files: dict[str, str], version: str = "0.33.0") -> compat.ReleaseReport:
    return compat.check_release(compat.ModuleSources.from_files(files), version=version)


def test_a_release_with_everything_fits() -> None:
    report = check(release())
    assert report.problems == []
    assert report.patched_found == len(hook.PATCHED_METHODS)
    assert report.symbols_found == len(hook.USED_SYMBOLS)
    assert report.token_in
    assert report.parser == compat.ParserUse(True, True, ("adjust_request", "set_prompt_token_ids"), False)


def test_the_032_parser_use_sets_no_prompt_ids() -> None:
    report = check(release(preprocess=PREPROCESS_032), "0.32.0")
    assert report.ok
    assert report.parser == compat.ParserUse(True, False, ("adjust_request",), False)


def test_a_missing_method_and_symbol_are_named() -> None:
    report = check(release(drop=("warmup", "merge_kwargs")))
    assert f"missing {RENDERER}.OnlineRenderer.warmup" in report.problems
    assert "missing vllm.renderers.params.merge_kwargs" in report.problems
    assert not report.ok


def test_a_missing_parameter_is_named() -> None:
    report = check(release(preprocess=PREPROCESS_033.replace("tool_dicts=None, ", "")))
    assert report.problems == ["preprocess_chat has no parameter tool_dicts="]
    assert not report.signatures_ok


def test_methods_are_found_on_base_classes_across_relative_imports() -> None:
    files = release(drop=("warmup",))
    files[_module_path(RENDERER)] = files[_module_path(RENDERER)].replace(
        "class OnlineRenderer:", "from .base import RendererBase\n\n\nclass OnlineRenderer(RendererBase):"
    )
    files["vllm/renderers/base.py"] = "class RendererBase:\n    def warmup(self):\n        pass\n"
    assert check(files).problems == []


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
    no_call = PREPROCESS_033.replace("reuse_ids = _reused_prompt_token_ids(request, self.renderer, messages)", "")
    assert not check(release(preprocess=no_call)).token_in


@pytest.mark.parametrize(
    "line, problem",
    [
        ("request_parser.extract_reasoning(engine_input)", "calls extract_reasoning() on its request parser"),
        ("self.last_parser = request_parser", "uses its request parser otherwise"),
        ("self.register(parser(self.tokenizer, None))", "uses its request parser otherwise"),
        ("assert issubclass(parser, object)", "uses its request parser otherwise"),
    ],
)
def test_parser_uses_the_hook_cannot_hold_back_are_incompatible(line: str, problem: str) -> None:
    preprocess = PREPROCESS_033.replace(
        "            request = request_parser.adjust_request(request=request)",
        f"            request = request_parser.adjust_request(request=request)\n            {line}",
    )
    report = check(release(preprocess=preprocess))
    assert len(report.problems) == 1 and problem in report.problems[0]


def test_no_parser_parameter_is_not_a_problem() -> None:
    preprocess = PREPROCESS_032.replace("parser=None, ", "").replace(
        "        if parser is not None:\n"
        "            request = parser(self.tokenizer, request.tools).adjust_request(request=request)\n",
        "",
    )
    report = check(release(preprocess=preprocess))
    assert report.ok and report.parser == compat.ParserUse(False, False, (), False)


def test_the_table_names_each_release_and_every_problem() -> None:
    reports = [check(release(), "0.33.0"), check(release(drop=("warmup",)), "0.34.0")]
    table = compat.format_reports(reports).splitlines()
    assert table[0].split()[0] == "vLLM"
    assert table[2].startswith("0.33.0") and table[2].endswith("ok")
    assert table[3].startswith("0.34.0") and "INCOMPATIBLE (outside SUPPORTED_VLLM)" in table[3]
    assert table[4] == f"vLLM 0.34.0: missing {RENDERER}.OnlineRenderer.warmup"


def test_supported_releases_follow_the_hook_range() -> None:
    assert compat.supported_releases() == ["0.30.0", "0.31.0", "0.32.0", "0.33.0"]


def test_sources_are_read_from_the_wheel_zip(tmp_path: Path) -> None:
    wheel = tmp_path / "vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for path, text in release().items():
            archive.writestr(path, text)
        archive.writestr("vllm/renderers/__init__.py", "")
    report = compat.check_wheel(wheel, "0.33.0")
    assert report.ok and report.wheel == wheel.name


def test_a_cached_wheel_is_reused_without_pip(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cached = tmp_path / "vllm-0.31.0-cp38-abi3-manylinux_2_28_x86_64.whl"
    cached.write_bytes(b"")
    (tmp_path / "vllm-0.3.0-py3-none-any.whl").write_bytes(b"")  # another release whose name starts alike

    def no_pip(*args: object, **kwargs: object) -> None:
        raise AssertionError("pip was called for a cached wheel")

    monkeypatch.setattr(compat.subprocess, "run", no_pip)
    assert compat.download_wheel("0.31.0", tmp_path) == cached
