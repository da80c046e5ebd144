"""The hook against stock vLLM wheels: reads each release's source from its wheel with `ast` (no install, no import).

`ngt vllm-compat` (`make vllm-compat`) downloads the `vllm` wheel of every supported release once (`pip download
--no-deps`, cached), and checks, from the source in the zip, what `nemo_gym_tok.vllm.hook` needs: every wrapped
method (PATCHED_METHODS, inherited ones too, and the route guards' ROUTE_METHODS, less those a release predates:
routes.ROUTE_SINCE), the parameters the splice reads
(PREPROCESS_CHAT_PARAMETERS, HARMONY_PARAMETERS, TOKENIZE_PROMPTS_PARAMETERS), every USED_SYMBOLS name, vLLM's token-in
path (`_reused_prompt_token_ids` reading `kv_transfer_params['prompt_token_ids']` in preprocess_chat), and the splice
point: the hook hands vLLM's tokenization step (`BaseRenderer.tokenize_prompts_async`) a prompt that already holds
the spliced `prompt_token_ids`, so it needs preprocess_chat to render through `render_chat_async`, that to tokenize
through `self.tokenize_prompts_async`, that to reach `_tokenize_singleton_prompt_async`, which must tokenize only a
prompt without `prompt_token_ids`, and preprocess_chat to use its request parser only after rendering (the parser
then reads the spliced ids, `set_prompt_token_ids` since 0.33). It also reads which releases have the output fields
the answer wrappers read (USED_FIELDS: `CompletionOutput.weight_versions`, the weight versions a bundle carries):
from FIELD_SINCE on a missing one is a problem, before it the bundles say weight_version None there.
It is the static twin of `internals.check_internals()`, which checks the vLLM that is installed. The source reading is
nemo_gym_tok.vllm_wheels.wheel_source, the splice point's analysis nemo_gym_tok.vllm_wheels.splice_point.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

from nemo_gym_tok.common.cache_dir import cache_root
from nemo_gym_tok.vllm.internals import (
    FIELD_SINCE,
    HARMONY_PARAMETERS,
    PATCHED_METHODS,
    PREPROCESS_CHAT_PARAMETERS,
    SUPPORTED_VLLM,
    TOKENIZE_PROMPTS_PARAMETERS,
    USED_FIELDS,
    USED_SYMBOLS,
    WEIGHT_VERSIONS_FIELD,
    field_expected,
    is_supported_vllm,
)
from nemo_gym_tok.vllm.routes import ROUTE_METHODS, absent_by_design
from nemo_gym_tok.vllm_wheels.splice_point import TOKENIZE_METHOD, SplicePoint, splice_point
from nemo_gym_tok.vllm_wheels.weight_path_compat import weight_path_problems
from nemo_gym_tok.vllm_wheels.wheel_source import (
    MAX_HOPS,
    FunctionNode,
    ModuleSources,
    SourceReader,
    calls,
    mentions,
    parameter_names,
)

# vLLM's token-in path: the function preprocess_chat calls to take forwarded prompt ids instead of rendering.
TOKEN_IN_FUNCTION = "_reused_prompt_token_ids"
TOKEN_IN_FIELDS = ("kv_transfer_params", "prompt_token_ids")


def supported_releases() -> list[str]:
    """The first release of every minor version in SUPPORTED_VLLM: 0.29.0, 0.30.0, ..., 0.33.0."""
    (low_major, low_minor), (high_major, high_minor) = SUPPORTED_VLLM
    if low_major != high_major:
        raise ValueError(f"SUPPORTED_VLLM spans major versions ({SUPPORTED_VLLM}); name the releases to check")
    return [f"{low_major}.{minor}.0" for minor in range(low_minor, high_minor)]


def wheel_cache_dir() -> Path:
    """Where downloaded wheels are kept: `vllm-wheels` in the nemo_gym_tok cache ($NGT_CACHE_DIR or ~/.cache/...)."""
    return cache_root() / "vllm-wheels"


def cached_wheel(version: str, directory: Path | None = None) -> Path | None:
    """The stock `vllm` wheel of `version` already in `directory` (default: wheel_cache_dir()), None if absent."""
    cached = sorted((directory or wheel_cache_dir()).glob(f"vllm-{version}-*.whl"))
    return cached[0] if cached else None


@dataclass
class ReleaseReport:
    """What one vLLM release's source offers the hook; `problems` is empty when the hook fits it."""

    version: str
    wheel: str = ""
    patched_found: int = 0
    patched_expected: int = 0
    """The methods this release should have: all of them, less route methods it predates (routes.ROUTE_SINCE)."""
    not_in_release: list[str] = field(default_factory=list)
    """Route methods absent because the release predates them: no route there to guard (not a problem)."""
    symbols_found: int = 0
    signatures_ok: bool = True
    token_in: bool = False
    fields_absent: list[str] = field(default_factory=list)
    """USED_FIELDS this release does not have (expected before FIELD_SINCE, a problem from it on)."""
    weight_path: list[str] | None = None
    """What the release lacks of the weight-update path (weight_path_compat in this package); None: not checked."""
    splice_point: SplicePoint | None = None
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def weight_versions(self) -> bool:
        """The release reports each generated id's weight version (CompletionOutput.weight_versions)."""
        return ".".join(WEIGHT_VERSIONS_FIELD) not in self.fields_absent

    @property
    def in_supported_range(self) -> bool:
        return is_supported_vllm(self.version)


def check_release(sources: ModuleSources, version: str = "", wheel: str = "") -> ReleaseReport:
    """Check one release's source against what the hook wraps and uses (the same names `check_internals()` uses)."""
    reader = SourceReader(sources)
    report = ReleaseReport(version=version, wheel=wheel)
    methods: dict[str, ast.stmt | None] = {}
    for module_name, class_name, method in (*PATCHED_METHODS, *ROUTE_METHODS):
        found = methods[method] = reader.method(module_name, class_name, method)
        if found is None and absent_by_design((module_name, class_name, method), version):
            report.not_in_release.append(f"{module_name}.{class_name}.{method}")
            continue
        report.patched_expected += 1
        if found is None:
            report.problems.append(f"missing {module_name}.{class_name}.{method}")
        else:
            report.patched_found += 1
    for method, expected in (
        ("preprocess_chat", PREPROCESS_CHAT_PARAMETERS),
        ("_make_request_with_harmony", HARMONY_PARAMETERS),
        (TOKENIZE_METHOD, TOKENIZE_PROMPTS_PARAMETERS),
    ):
        found = methods.get(method)
        if isinstance(found, (ast.FunctionDef, ast.AsyncFunctionDef)):
            present = parameter_names(found)
            for name in expected:
                if name not in present:
                    report.signatures_ok = False
                    report.problems.append(f"{method} has no parameter {name}=")
        elif found is not None:
            report.signatures_ok = False
            report.problems.append(f"{method} is not a def here; its parameters cannot be read")
    for module_name, symbol in USED_SYMBOLS:
        if reader.top_level(module_name, symbol) is None:
            report.problems.append(f"missing {module_name}.{symbol}")
        else:
            report.symbols_found += 1
    for used in USED_FIELDS:
        if not class_has_field(reader, *used):
            report.fields_absent.append(".".join(used))
            if field_expected(used, version):
                report.problems.append(f"missing {'.'.join(used)}")
    preprocess = methods.get("preprocess_chat")
    if isinstance(preprocess, (ast.FunctionDef, ast.AsyncFunctionDef)):
        renderer_module = next(module for module, _, method in PATCHED_METHODS if method == "preprocess_chat")
        report.token_in = _token_in_path(reader, renderer_module, preprocess)
        if not report.token_in:
            report.problems.append(
                f"preprocess_chat no longer takes kv_transfer_params['prompt_token_ids'] through {TOKEN_IN_FUNCTION}: "
                "re-check how the hook meets vLLM's token-in path"
            )
    report.splice_point = splice_point(
        reader, preprocess if isinstance(preprocess, (ast.FunctionDef, ast.AsyncFunctionDef)) else None
    )
    report.problems.extend(problem for _, problem in report.splice_point.gaps())
    return report


def class_has_field(reader: SourceReader, module: str, class_name: str, name: str, hops: int = 0) -> bool:
    """Whether the class (or a base class) declares `name` with an annotation in its body, as a dataclass field is."""
    located = reader.class_def(module, class_name, hops)
    if located is None or hops > MAX_HOPS:
        return False
    owner_module, node = located
    for statement in node.body:
        if isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name):
            if statement.target.id == name:
                return True
    for base in node.bases:
        if isinstance(base, ast.Subscript):
            base = base.value
        if isinstance(base, ast.Name) and class_has_field(reader, owner_module, base.id, name, hops + 1):
            return True
    return False


def _token_in_path(reader: SourceReader, module: str, preprocess: FunctionNode) -> bool:
    """preprocess_chat calls TOKEN_IN_FUNCTION, and that function reads kv_transfer_params['prompt_token_ids']."""
    if not calls(preprocess, TOKEN_IN_FUNCTION):
        return False
    found = reader.top_level(module, TOKEN_IN_FUNCTION)
    return found is not None and all(mentions(found.node, text) for text in TOKEN_IN_FIELDS)


def download_wheel(version: str, directory: Path) -> Path:
    """The stock `vllm` wheel of `version` in `directory`, downloaded by pip (no dependencies) unless already there."""
    cached = cached_wheel(version, directory)
    if cached is not None:
        return cached
    directory.mkdir(parents=True, exist_ok=True)
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--quiet",
        "--no-deps",
        "--only-binary=:all:",
        # The wheel is kept in `directory`; a second copy in pip's own cache would only double 1.6 GB of disk.
        "--no-cache-dir",
        f"vllm=={version}",
        "--dest",
        str(directory),
    ]
    completed = subprocess.run(command, capture_output=True, text=True)
    cached = cached_wheel(version, directory)
    if completed.returncode != 0 or cached is None:
        # pip's warnings about this machine's index configuration would bury the reason.
        reason = "\n".join(line for line in completed.stderr.splitlines() if not line.startswith("WARNING:"))
        raise RuntimeError(f"pip could not download vllm=={version}: {reason.strip()[-2000:]}")
    return cached


def check_wheel(wheel: Path, version: str) -> ReleaseReport:
    """The hook's check and the weight-update path's, on one release's wheel."""
    with zipfile.ZipFile(wheel) as archive:
        sources = ModuleSources.from_zip(archive)
        report = check_release(sources, version=version, wheel=wheel.name)
        report.weight_path = weight_path_problems(sources)
    report.problems.extend(f"weight updates: {problem}" for problem in report.weight_path)
    return report


def format_reports(reports: list[ReleaseReport]) -> str:
    """The per-release table, then every problem found, release by release."""
    total_symbols = len(USED_SYMBOLS)
    header = (
        "vLLM",
        "patched methods",
        "signatures",
        "used symbols",
        "token-in path",
        "weight versions",
        "weight updates",
        "splice point",
        "result",
    )
    rows = [header]
    for report in reports:
        gaps = report.splice_point.gaps() if report.splice_point is not None else [("not checked", "")]
        splice = "; ".join(label for label, _ in gaps) or "ok"
        result = "ok" if report.ok else "INCOMPATIBLE"
        if not report.in_supported_range:
            result += " (outside SUPPORTED_VLLM)"
        rows.append(
            (
                report.version,
                f"{report.patched_found}/{report.patched_expected}",
                "ok" if report.signatures_ok else "changed",
                f"{report.symbols_found}/{total_symbols}",
                "yes" if report.token_in else "no",
                "yes" if report.weight_versions else "no",
                "not checked" if report.weight_path is None else "ok" if not report.weight_path else "missing",
                splice,
                result,
            )
        )
    widths = [max(len(row[column]) for row in rows) for column in range(len(header))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * width for width in widths))
    for report in reports:
        for method in report.not_in_release:
            lines.append(
                f"vLLM {report.version}: no {method}, expected (added in a later release; its route is not "
                "guarded here)"
            )
        if not report.weight_versions and not any(WEIGHT_VERSIONS_FIELD[2] in p for p in report.problems):
            since = ".".join(map(str, FIELD_SINCE[WEIGHT_VERSIONS_FIELD]))
            lines.append(
                f"vLLM {report.version}: no {'.'.join(WEIGHT_VERSIONS_FIELD)}, expected (added in {since}): the "
                "hook's bundles carry no weight_version there"
            )
        for problem in report.problems:
            lines.append(f"vLLM {report.version}: {problem}")
    return "\n".join(lines)
