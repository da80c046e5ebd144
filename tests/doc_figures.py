"""The figures README.md and docs/*.md quote from commands, checked against what those commands printed.

A figure is marked in the markdown by an invisible key right after it: `717<!-- fig:sweep.exact -->`. Every key is
declared in FIGURES below with where its figure comes from:
- a CI step (`step`): `.ci/run` saves each step's output to .ngt/ci-output/<step>.txt, and `python
  tests/doc_figures.py [DIR]` (.ci/run's last step) compares every figure with what that step printed;
- the repo itself (`compute`): figures of commands CI does not run, or that the default suite can produce cheaply
  (the number of tests `make test` collects, what `ngt vllm-compat` counts, docs/performance.md of `make bench`),
  compared by tests/test_doc_figures.py in the default suite;
- neither (a hand measurement a doc names the command of): every mention of the key must then say the same.
Every mention of a key, whatever its source, must agree with every other. Durations are never marked: they move
from run to run, and the docs phrase them as approximate.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUTPUT_DIR = ROOT / ".ngt" / "ci-output"
# A figure: digits with thousands commas, decimals, a trailing % or an `N/M` pair; the key follows it at once.
MARK = re.compile(r"(?P<figure>\d[\d,]*(?:\.\d+)?(?:e-?\d+)?(?:%|\/\d+)?)<!-- fig:(?P<key>[A-Za-z0-9_.\-]+) -->")
CODE_SPAN = re.compile(r"`[^`]*`")
ANY_MARK = re.compile(r"<!-- fig:(?P<key>[^ ]*) -->")
# pytest's last line: `==== 1305 passed, 3 deselected in 610.2s (0:10:10) ====`, or without the rules under -q.
PYTEST_SUMMARY = re.compile(r"^=*\s*(?P<counts>\d+ [a-z]+(?:, \d+ [a-z]+)*) in [\d.]+s(?: \([\d:]+\))?\s*=*$")
RAN = ("passed", "failed", "skipped", "xfailed", "xpassed", "errors")


@dataclass(frozen=True)
class Mention:
    """One marked figure: where it is and what it says."""

    doc: str
    line: int
    key: str
    figure: str


@dataclass(frozen=True)
class Figure:
    """Where a key's figure comes from: a .ci/run step's output and how to read it, or the repo (see the docstring)."""

    step: str | None = None
    parse: Callable[[str], str] | None = None
    command: str = ""
    compute: str | None = None
    """The name of the function in tests/test_doc_figures.py (REPO_SOURCES) that computes it from the repo."""


def normalize(figure: str) -> str:
    return figure.replace(",", "")


def docs(root: Path = ROOT) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def extract(paths: list[Path], root: Path = ROOT) -> tuple[list[Mention], list[str]]:
    """Every marked figure in `paths` (code spans and fenced blocks aside), and the marks with no figure before them."""
    mentions, problems = [], []
    for path in paths:
        name = str(path.relative_to(root)) if path.is_relative_to(root) else str(path)
        fenced = False
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
            if line.lstrip().startswith("```"):
                fenced = not fenced
            if fenced:
                continue
            text = CODE_SPAN.sub("", line)  # a mark shown in backticks is an example, not a figure
            found = [
                (match.start("key"), Mention(name, number, match["key"], match["figure"]))
                for match in MARK.finditer(text)
            ]
            starts = {start for start, _ in found}
            mentions.extend(mention for _, mention in found)
            for bare in ANY_MARK.finditer(text):
                if bare.start("key") not in starts:
                    problems.append(f"{name}:{number}: fig:{bare['key']} follows no figure (a number right before it)")
    return mentions, problems


# --- reading the commands' output ---------------------------------------------------------------------------------


def pytest_counts(output: str) -> dict[str, int]:
    """The outcome counts of pytest's last summary line: {"passed": 1305, "deselected": 3}."""
    for line in reversed(output.splitlines()):
        match = PYTEST_SUMMARY.match(line.strip())
        if match:
            counts = {}
            for count, word in re.findall(r"(\d+) ([a-z]+)", match["counts"]):
                counts[{"error": "errors", "warning": "warnings"}.get(word, word)] = int(count)
            return counts
    raise ValueError("no pytest summary line (`N passed ... in S s`) in the output")


def pytest_figure(outcome: str) -> Callable[[str], str]:
    """An outcome's count; `ran`: every test that ran to an outcome (what `--collect-only` counts, less deselected)."""

    def parse(output: str) -> str:
        counts = pytest_counts(output)
        return str(sum(counts.get(name, 0) for name in RAN) if outcome == "ran" else counts.get(outcome, 0))

    return parse


SWEEP_ROW = re.compile(
    r"^(?P<outcome>exact|refused|crash|wrong|no chat turns)\s+(?P<n>\d+)\s+(?P<count>[\d.]+%)\s+(?P<downloads>[\d.]+%)$"
)


def sweep_row(outcome: str, column: str) -> Callable[[str], str]:
    """A cell of `ngt template-sweep`'s outcome table (column n, count or downloads)."""

    def parse(output: str) -> str:
        for line in output.splitlines():
            match = SWEEP_ROW.match(line.strip())
            if match and match["outcome"] == outcome:
                return match[column]
        raise ValueError(f"no `{outcome}` row in the sweep's outcome table")

    return parse


def sweep_line(pattern: str, group: str = "value") -> Callable[[str], str]:
    """A figure from the first line of `ngt template-sweep`'s output that matches `pattern`."""

    def parse(output: str) -> str:
        for line in output.splitlines():
            match = re.search(pattern, line)
            if match:
                return match[group]
        raise ValueError(f"no line matching {pattern!r} in the sweep's output")

    return parse


SWEEP = "`ngt template-sweep`"
TRAIN_ASYNC_RUNS = ("s0", "s1", "s2", "s4", "s4-none")
P8_CASES = {
    "ch-sent": ("consistent_hash", True),
    "ch-none": ("consistent_hash", False),
    "sll-none": ("sticky_least_loaded", False),
    "ca-none": ("cache_aware", False),
    "rr-none": ("round_robin", False),
    "p2-none": ("power_of_two", False),
}
"""The cases of bench P8 (bench/p8_headerless.py) docs/scaling.md quotes, by a short name: (policy, header sent)."""
P8_FIGURES = ("hit", "ceiling", "one", "spread")
SOAK_FIGURES = (
    "minutes",
    "written",
    "lost",
    "duplicated",
    "torn",
    "contiguous",
    "new-segments",
    "unasked",
    "kills",
    "replica-kills",
    "redone",
    "redone-transport",
    "redone-502",
    "restart-seconds",
    "routed-after",
    "rejoin-share",
    "rejoin-window",
    "bundles",
    "rss-growth",
)
TRAIN_ASYNC_FIGURES = ("first", "last", "gain", "version-gain", "gap-max-lag", "capped")
TRAIN_DEMO_FIGURES = (
    "first", "last", "gain", "free-mean", "free-max", "worst-step-mean", "clip", "text-moved", "text-gap-mean",
    "text-gap-max", "text-clip", "push-mean", "push-max", "contiguous", "episodes",
)  # fmt: skip


def _pytest(step: str, outcome: str) -> Figure:
    return Figure(step=step, parse=pytest_figure(outcome), command=f"`make {step}`")


def _sweep(parse: Callable[[str], str]) -> Figure:
    return Figure(step="template-sweep", parse=parse, command=SWEEP)


FIGURES: dict[str, Figure] = {
    # make test: every test collected (the default suite counts them; CI also sums the outcomes make test printed).
    "test.collected": Figure(step="test", parse=pytest_figure("ran"), command="`make test`", compute="collected"),
    "gpt-oss.passed": _pytest("test-gpt-oss", "passed"),
    "families.passed": _pytest("test-families", "passed"),
    "families.skipped": _pytest("test-families", "skipped"),
    "vllm-0.30.passed": _pytest("test-vllm-0.30", "passed"),
    "vllm-0.30.deselected": _pytest("test-vllm-0.30", "deselected"),
    "vllm-0.29.passed": _pytest("test-vllm-0.29", "passed"),
    "vllm-0.29.deselected": _pytest("test-vllm-0.29", "deselected"),
    "nemo-gym.passed": _pytest("test-nemo-gym", "passed"),
    "sweep.templates": _sweep(sweep_line(r"^(?P<value>\d+) chat templates;")),
    "sweep.crashes": _sweep(sweep_line(r"^crashes: (?P<value>\d+)")),
    "sweep.chat-turns": _sweep(sweep_line(r"^exact among templates with chat turns: \d+/(?P<value>\d+)")),
    "sweep.chat-turns.exact.downloads": _sweep(
        sweep_line(r"^exact among templates with chat turns: \d+/\d+, (?P<value>[\d.]+%) by downloads")
    ),
    "sweep.no-tool-result": _sweep(
        sweep_line(r"^refused tool-calling episodes not counted .*: (?P<value>\d+) templates")
    ),
    "sweep.tool-refusals-counted": _sweep(sweep_line(r"counting them as refusals, (?P<value>[\d.]+%) exact")),
    **{
        f"sweep.{outcome.replace(' ', '-')}{suffix}": _sweep(sweep_row(outcome, column))
        for outcome in ("exact", "refused", "crash", "wrong", "no chat turns")
        for suffix, column in (("", "n"), (".count", "count"), (".downloads", "downloads"))
    },
    # Not in CI: computed from the repo by the default suite (tests/test_doc_figures.py, REPO_SOURCES).
    # The methods `ngt vllm-compat` expects a release to have: every supported one after the first, and 0.29.
    "compat.methods": Figure(command="`ngt vllm-compat`", compute="compat_methods"),
    "compat.methods.0.29": Figure(command="`ngt vllm-compat 0.29.0`", compute="compat_methods_029"),
    "demo.rollouts": Figure(command="`ngt demo` (its defaults, configs/demo.yaml)", compute="demo_rollouts"),
    "bench.p2.server.16k": Figure(command="docs/performance.md (`make bench`)", compute="bench_server_16k"),
    "bench.p2.slope": Figure(command="docs/performance.md (`make bench`)", compute="bench_slope"),
    "bench.p2.paired.7k": Figure(command="docs/performance.md (`make bench`)", compute="bench_paired_7k"),
    "bench.p2.token-in.min": Figure(command="docs/performance.md (`make bench`)", compute="bench_token_in_min"),
    "bench.p2.token-in.max": Figure(command="docs/performance.md (`make bench`)", compute="bench_token_in_max"),
    "bench.p4.adapter-cpu": Figure(command="docs/performance.md (`make bench`)", compute="bench_adapter_cpu"),
    **{
        f"bench.p7.{column.replace('_', '-')}.{concurrency}": Figure(
            command="docs/performance.md (`make bench`)", compute=f"bench_p7_{column}_{concurrency}"
        )
        for column in ("hit_ch", "hit_rr", "hit_ratio", "rate_ratio")
        for concurrency in ("8", "32")
    },
    # bench P8's committed run (docs/p8-headerless.json, `bench/p8_headerless.py --json`).
    **{
        f"bench.p8.{case}.{name}": Figure(
            command="`bench/p8_headerless.py --json docs/p8-headerless.json`", compute=f"bench_p8_{case}_{name}"
        )
        for case in P8_CASES
        for name in P8_FIGURES
    },
    # The committed 20-minute soak (docs/soak-report.json, `make soak`'s .ngt/soak/soak-report.json).
    **{
        f"soak.{name}": Figure(command="`make soak` (docs/soak-report.json)", compute=f"soak_{name}")
        for name in SOAK_FIGURES
    },
    # The train demo's committed run (docs/train-demo-metrics.jsonl, `make train-demo`'s metrics.jsonl).
    **{
        f"train-demo.{name}": Figure(
            command="`make train-demo` (docs/train-demo-metrics.jsonl)", compute=f"train_demo_{name}"
        )
        for name in TRAIN_DEMO_FIGURES
    },
    # The staleness table's committed run (docs/train-async.json, `make train-async`'s table.json).
    **{
        f"train-async.{run}.{name}": Figure(
            command="`make train-async` (docs/train-async.json)", compute=f"train_async_{run}_{name}"
        )
        for run in TRAIN_ASYNC_RUNS
        for name in TRAIN_ASYNC_FIGURES
    },
    # Measured by hand (`ngt check --logprobs ... --naive` on the demo, docs/training.md): every mention agrees.
    **{
        f"logprobs.{name}": Figure(command="`ngt check --logprobs --naive` (docs/training.md)")
        for name in ("free-mean", "free-max", "constrained-turns", "moved", "generated", "sum-mean", "sum-max")
    },
}


def unknown_keys(mentions: list[Mention]) -> list[str]:
    return [
        f"{m.doc}:{m.line}: fig:{m.key} is not a key tests/doc_figures.py knows"
        for m in mentions
        if m.key not in FIGURES
    ]


def disagreements(mentions: list[Mention]) -> list[str]:
    """Mentions of one key that quote different figures."""
    problems = []
    by_key: dict[str, list[Mention]] = {}
    for mention in mentions:
        by_key.setdefault(mention.key, []).append(mention)
    for key, group in sorted(by_key.items()):
        if len({normalize(m.figure) for m in group}) > 1:
            said = "; ".join(f"{m.doc}:{m.line} says {m.figure}" for m in group)
            problems.append(f"fig:{key} is quoted differently: {said}")
    return problems


def mismatch(mention: Mention, source: str, printed: str) -> str | None:
    if normalize(mention.figure) == normalize(printed):
        return None
    return f"{mention.doc}:{mention.line}: fig:{mention.key} says {mention.figure}, {source} printed {printed}"


def check_outputs(mentions: list[Mention], output_dir: Path) -> list[str]:
    """Every mention whose key a CI step prints, against the output that step saved in `output_dir`."""
    problems = []
    for mention in mentions:
        figure = FIGURES.get(mention.key)
        if figure is None or figure.step is None or figure.parse is None:
            continue
        path = output_dir / f"{figure.step}.txt"
        if not path.exists():
            problems.append(f"{mention.doc}:{mention.line}: fig:{mention.key}: no output of {figure.command} ({path})")
            continue
        try:
            printed = figure.parse(path.read_text(encoding="utf-8", errors="replace"))
        except ValueError as exc:
            problems.append(f"{mention.doc}:{mention.line}: fig:{mention.key}: {figure.command}'s output: {exc}")
            continue
        problem = mismatch(mention, figure.command, printed)
        if problem:
            problems.append(problem)
    return problems


def check(paths: list[Path], output_dir: Path, root: Path = ROOT) -> list[str]:
    mentions, problems = extract(paths, root)
    return problems + unknown_keys(mentions) + disagreements(mentions) + check_outputs(mentions, output_dir)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output_dir", nargs="?", type=Path, default=OUTPUT_DIR, help="where .ci/run saved each step")
    args = parser.parse_args(argv)
    mentions, _ = extract(docs())
    problems = check(docs(), args.output_dir)
    checked = sum(1 for m in mentions if m.key in FIGURES and FIGURES[m.key].step is not None)
    if problems:
        print(f"doc figures: {len(problems)} problem(s):", *problems, sep="\n", file=sys.stderr)
        return 1
    print(f"doc figures: {checked} figures from CI steps match their output ({len(mentions)} marked in all)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
