"""Facts stated in code and in prose agree: the supported vLLM range, and the real-server tests each old vLLM runs."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from nemo_gym_tok.vllm.internals import SUPPORTED_VLLM, supported_vllm_text
from nemo_gym_tok.vllm_wheels import supported_releases

ROOT = Path(__file__).resolve().parent.parent
VERSIONS_DOC = ROOT / "docs" / "vllm-versions.md"
# A range of vLLM releases in prose: `0.29 to 0.33`, `0.29.0 to 0.33.0`.
RANGE = re.compile(r"\b0\.\d+(?:\.0)? to 0\.\d+(?:\.0)?\b")
# Ranges that are someone else's: TRL's own supported vLLM range (docs/clients.md).
NOT_OURS = ("TRL 1.16 warns that it supports vLLM 0.22 to 0.31",)
NUMBER_WORDS = {"one": 1, "two": 2, "three": 3, "four": 4, "five": 5}


def _texts() -> dict[str, str]:
    paths = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "pyproject.toml", ROOT / "Makefile"]
    return {str(path.relative_to(ROOT)): path.read_text(encoding="utf-8") for path in paths}


def test_every_stated_vllm_range_is_supported_vllm() -> None:
    releases = supported_releases()
    allowed = {supported_vllm_text(), f"{releases[0]} to {releases[-1]}"}
    wrong = []
    for name, text in _texts().items():
        for number, line in enumerate(text.splitlines(), start=1):
            if any(phrase in line for phrase in NOT_OURS):
                continue
            wrong += [f"{name}:{number}: {found}" for found in RANGE.findall(line) if found not in allowed]
    assert not wrong, f"SUPPORTED_VLLM is {SUPPORTED_VLLM} ({sorted(allowed)}); these say otherwise: {wrong}"


def test_the_gpu_extra_and_the_versions_page_state_supported_vllm() -> None:
    (low_major, low_minor), (high_major, high_minor) = SUPPORTED_VLLM
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["optional-dependencies"]
    assert extras["gpu"] == [f"vllm>={low_major}.{low_minor},<{high_major}.{high_minor}"]
    page = VERSIONS_DOC.read_text(encoding="utf-8")
    assert f"`SUPPORTED_VLLM = {SUPPORTED_VLLM!r}`" in page
    assert f"up to, but not\nincluding, {high_major}.{high_minor}." in page
    assert f"## Supported range: vLLM {supported_vllm_text()}\n" in page


def makefile_variables() -> dict[str, list[str]]:
    """The Makefile's `NAME := words` assignments, continuation lines joined and `$(NAME)` references expanded."""
    text = (ROOT / "Makefile").read_text(encoding="utf-8").replace("\\\n", " ")
    variables: dict[str, list[str]] = {}
    for name, value in re.findall(r"^([A-Z0-9_]+) :?= (.*)$", text, re.M):
        words: list[str] = []
        for word in value.split():
            reference = re.fullmatch(r"\$\(([A-Z0-9_]+)\)", word)
            words += variables[reference[1]] if reference and reference[1] in variables else [word]
        variables[name] = words
    return variables


def _section(heading: str) -> str:
    page = VERSIONS_DOC.read_text(encoding="utf-8")
    assert f"\n## {heading}\n" in page, f"docs/vllm-versions.md has no section `## {heading}`"
    return page.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]


def _deselected(variable: str) -> set[str]:
    words = makefile_variables()[variable]
    return {word.split("::")[1] for word in words if "::" in word}


def _stated_count(section: str) -> int:
    match = re.search(r"\b(\w+) tests are deselected", section, re.I)
    assert match, "the section should say how many tests are deselected"
    return NUMBER_WORDS[match[1].lower()]


def test_the_versions_page_names_the_makefiles_real_server_tests() -> None:
    section = _section("CI on vLLM 0.30: `make test-vllm-0.30`")
    listed = section.split("It then runs the hook's real-server tests on it", 1)[1].split("\n\n", 1)[0]
    named = set(re.findall(r"`([\w/]+\.py)`", listed))
    assert named == set(makefile_variables()["HOOK_SERVER_TESTS"]), "docs/vllm-versions.md vs HOOK_SERVER_TESTS"


def test_the_versions_page_names_the_makefiles_deselections() -> None:
    for heading, variable in (
        ("CI on vLLM 0.30: `make test-vllm-0.30`", "DESELECT_030"),
        ("CI on vLLM 0.29: `make test-vllm-0.29`", "DESELECT_029"),
    ):
        section = _section(heading)
        deselected = _deselected(variable)
        assert deselected and _stated_count(section) == len(deselected), f"{heading}: the count vs {variable}"
        bullets = "\n".join(line for line in section.splitlines() if line.startswith(("- ", "  ")))
        named = set(re.findall(r"`(test_\w+)`", bullets))
        # A bullet may name a test that still runs to say what covers the case: every deselected one is named, and
        # every test a bullet opens with is deselected.
        leading = set(re.findall(r"^- `(test_\w+)`", bullets, re.M))
        assert deselected <= named, f"{heading}: {variable} deselects {deselected - named}, not named on the page"
        assert leading <= deselected, f"{heading}: the page lists {leading - deselected}, which {variable} runs"
