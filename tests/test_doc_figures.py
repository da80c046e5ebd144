"""The marked figures of README.md and docs/*.md: extraction, keys, the checker's report, and the repo-sourced ones."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from nemo_gym_tok.cli.main import build_parser
from nemo_gym_tok.vllm.internals import PATCHED_METHODS, USED_SYMBOLS
from nemo_gym_tok.vllm.routes import ROUTE_METHODS, absent_by_design
from nemo_gym_tok.vllm_wheels import supported_releases
from tests.doc_figures import (
    FIGURES,
    P8_CASES,
    P8_FIGURES,
    ROOT,
    SOAK_FIGURES,
    TRAIN_ASYNC_FIGURES,
    TRAIN_DEMO_FIGURES,
    Mention,
    check,
    docs,
    extract,
    pytest_counts,
    sweep_row,
)

PERFORMANCE = ROOT / "docs" / "performance.md"


def md_tables(text: str) -> list[list[dict[str, str]]]:
    """Every markdown table of `text` as rows keyed by the header's cells."""
    tables, lines = [], text.splitlines()
    for index, line in enumerate(lines[:-1]):
        if line.startswith("|") and re.match(r"^\|( *-+ *\|)+$", lines[index + 1]):
            header = [cell.strip() for cell in line.strip("|").split("|")]
            rows = []
            for body in lines[index + 2 :]:
                if not body.startswith("|"):
                    break
                rows.append(dict(zip(header, (cell.strip() for cell in body.strip("|").split("|")))))
            tables.append(rows)
    return tables


def _table(*columns: str) -> list[dict[str, str]]:
    for rows in md_tables(PERFORMANCE.read_text(encoding="utf-8")):
        if rows and all(column in rows[0] for column in columns):
            return rows
    raise AssertionError(f"docs/performance.md has no table with the columns {columns}")


def _paired_chat_rows() -> list[dict[str, str]]:
    return [
        row
        for row in _table("size", "hook/token-in paired")
        if row["request"] == "chat, 1 token" and row["measure"] == "e2e median"
    ]


def _methods_due(version: str) -> int:
    return sum(1 for method in (*PATCHED_METHODS, *ROUTE_METHODS) if not absent_by_design(method, version))


def compat_methods() -> str:
    counts = {_methods_due(version) for version in supported_releases()[1:]}
    assert len(counts) == 1, f"the releases after the first differ in the methods they should have: {counts}"
    return str(counts.pop())


def demo_rollouts() -> str:
    args = build_parser().parse_args(["demo"])
    config = yaml.safe_load((ROOT / "configs" / "demo.yaml").read_text(encoding="utf-8"))
    agents = [name for name, server in config.items() if isinstance(server, dict) and "responses_api_agents" in server]
    return str(len(agents) * args.limit * args.repeats)


def collected() -> str:
    """How many tests `make test`'s pytest collects (its testpaths and options, no deselection)."""
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    match = re.search(r"^(\d+) tests? collected in ", result.stdout, re.M)
    assert result.returncode == 0 and match, f"pytest --collect-only failed:\n{result.stdout[-3000:]}{result.stderr}"
    return match[1]


TRAIN_ASYNC_TABLE = ROOT / "docs" / "train-async.json"
TRAIN_ASYNC_NAMES = {
    "s0": "staleness-0-tis",
    "s1": "staleness-1-tis",
    "s2": "staleness-2-tis",
    "s4": "staleness-4-tis",
    "s4-none": "staleness-4-none",
}


def train_async_figures(run: str) -> dict[str, str]:
    """One row of the committed staleness table, as docs/training.md quotes it."""
    row = next(
        row
        for row in json.loads(TRAIN_ASYNC_TABLE.read_text(encoding="utf-8"))
        if row["name"] == TRAIN_ASYNC_NAMES[run]
    )
    last_lag = max(row["gap_by_lag"], key=int)
    return {
        "first": f"{row['reward_first']:.3f}",
        "last": f"{row['reward_last']:.3f}",
        "gain": f"{row['reward_gain']:.3f}",
        "version-gain": f"{row['version_reward_gain']:.3f}",
        "gap-max-lag": f"{row['gap_by_lag'][last_lag]:.3f}",
        "capped": f"{100 * row['capped_share']:.1f}%",
    }


TRAIN_DEMO_METRICS = ROOT / "docs" / "train-demo-metrics.jsonl"


def train_demo_figures() -> dict[str, str]:
    """The committed `make train-demo` run, recomputed by the code that printed its summary."""
    from nemo_gym_tok.train.step_metrics import read_metrics
    from nemo_gym_tok.train.train_demo import DemoResult

    result = DemoResult(read_metrics(TRAIN_DEMO_METRICS), seconds=math.nan, setup_seconds=math.nan)
    exact, text = result.exact_total(), result.text_total()
    assert text is not None, "the committed train-demo run has no text-pipeline figures"
    pushes = [m.push_seconds for m in result.metrics]

    def exponent(value: float) -> str:
        return f"{value:.1e}".replace("e-0", "e-")

    return {
        "first": f"{result.window(False):.3f}",
        "last": f"{result.window(True):.3f}",
        "gain": f"{result.reward_gain:.3f}",
        "free-mean": exponent(exact.mean),
        "free-max": exponent(exact.max),
        "worst-step-mean": exponent(result.worst_exact_gap),
        "clip": f"{100 * exact.clip_share:.1f}%",
        "text-moved": f"{100 * text.differing_share:.1f}%",
        "text-gap-mean": f"{text.gap.mean:.3f}",
        "text-gap-max": f"{text.gap.max:.2f}",
        "text-clip": f"{100 * text.gap.clip_share:.1f}%",
        "push-mean": f"{sum(pushes) / len(pushes):.2f}",
        "push-max": f"{max(pushes):.2f}",
        "contiguous": f"{sum(m.contiguous for m in result.metrics)}",
        "episodes": f"{sum(m.episodes for m in result.metrics)}",
    }


P8_RUN = ROOT / "docs" / "p8-headerless.json"


def p8_figures(case: str) -> dict[str, str]:
    """One case of bench P8's committed run, as docs/scaling.md quotes it."""
    policy, header = P8_CASES[case]
    run = json.loads(P8_RUN.read_text(encoding="utf-8"))
    found = next(c for c in run["cases"] if c["policy"] == policy and c["header"] == header)
    return {
        "hit": f"{100 * found['cache_hit']:.1f}%",
        "ceiling": f"{100 * found['ceiling_rate']:.1f}%",
        "one": f"{100 * found['one_replica'] / found['conversations']:.0f}%",
        "spread": "/".join(str(found["sessions"].get(url, 0)) for url in run["workers"]),
    }


SOAK_REPORT = ROOT / "docs" / "soak-report.json"


def soak_figures() -> dict[str, str]:
    """The committed 20-minute `make soak` report (its soak-report.json), as docs/scaling.md quotes it."""
    report = json.loads(SOAK_REPORT.read_text(encoding="utf-8"))
    output, kills, first = report["output"], report["kills"], report["replicas"][0]
    growth = max(100 * (end - start) / start for start, end in report["rss_kib"].values())
    restarts = [kill for kill in kills if kill["kind"] == "replica"]
    return {
        "minutes": f"{report['seconds'] / 60:.1f}",
        "written": f"{output['written']}",
        "lost": f"{report['expected'] - output['distinct']}",
        "duplicated": f"{output['written'] - output['distinct']}",
        "torn": f"{output['torn_lines']}",
        "contiguous": f"{output['contiguous']}",
        "new-segments": f"{output['new_segments']}",
        "unasked": f"{output['unasked_segments']}",
        "kills": f"{len(kills)}",
        "replica-kills": f"{len(restarts)}",
        "redone": f"{sum(report['redone'].values())}",
        "redone-transport": f"{report['redone'].get('transport', 0)}",
        "redone-502": f"{report['redone'].get('http_status (HTTP 502)', 0)}",
        "restart-seconds": f"{restarts[0]['ready_at'] - restarts[0]['at']:.0f}",
        "routed-after": f"{first['ready_to_routed_seconds']:.1f}",
        "rejoin-share": f"{100 * first['share_after_readmission']:.0f}%",
        "rejoin-window": f"{first['collecting_after_readmission']:.0f}",
        "bundles": f"{report['versions'].get(report['pushed_version'], 0)}",
        "rss-growth": f"{growth:.1f}%",
    }


P7_COLUMNS = {
    "hit_ch": "hit rate CH",
    "hit_rr": "hit rate RR",
    "hit_ratio": "hit rate CH/RR",
    "rate_ratio": "rollouts/s CH/RR",
}
"""The columns of P7's comparison table in docs/performance.md that docs/scaling.md quotes."""

REPO_SOURCES = {
    **{f"soak_{name}": (lambda name=name: soak_figures()[name]) for name in SOAK_FIGURES},
    **{
        f"bench_p8_{case}_{name}": (lambda case=case, name=name: p8_figures(case)[name])
        for case in P8_CASES
        for name in P8_FIGURES
    },
    **{f"train_demo_{name}": (lambda name=name: train_demo_figures()[name]) for name in TRAIN_DEMO_FIGURES},
    **{
        f"train_async_{run}_{name}": (lambda run=run, name=name: train_async_figures(run)[name])
        for run in TRAIN_ASYNC_NAMES
        for name in TRAIN_ASYNC_FIGURES
    },
    "collected": collected,
    "compat_methods": compat_methods,
    "compat_methods_029": lambda: str(_methods_due("0.29.0")),
    "demo_rollouts": demo_rollouts,
    "bench_server_16k": lambda: next(
        row["hook/stock"]
        for row in _table("size", "hook/stock")
        if row["size"] == "16k" and row["request"] == "chat, 1 token" and row["measure"] == "server-side median"
    ),
    "bench_slope": lambda: re.search(
        r"slope hook / stock: server-side ([\d.]+)", PERFORMANCE.read_text(encoding="utf-8")
    )[1],
    "bench_paired_7k": lambda: next(row["hook/stock paired"] for row in _paired_chat_rows() if row["size"] == "7k"),
    "bench_token_in_min": lambda: min((row["hook/token-in paired"] for row in _paired_chat_rows()), key=float),
    "bench_token_in_max": lambda: max((row["hook/token-in paired"] for row in _paired_chat_rows()), key=float),
    **{
        f"bench_p7_{column}_{concurrency}": (
            lambda column=column, concurrency=concurrency: next(
                row[P7_COLUMNS[column]]
                for row in _table("concurrency", "hit rate CH/RR")
                if row["concurrency"] == concurrency
            )
        )
        for column in P7_COLUMNS
        for concurrency in ("8", "32")
    },
    "bench_adapter_cpu": lambda: next(
        row["CPU ms / call"] for row in _table("process", "CPU ms / call") if row["process"] == "policy_model"
    ),
}


@pytest.fixture(scope="module")
def mentions() -> list[Mention]:
    found, problems = extract(docs())
    assert not problems, "\n".join(problems)
    return found


def test_the_docs_mark_their_figures(mentions: list[Mention]) -> None:
    assert len(mentions) >= 50, f"only {len(mentions)} marked figures found: {mentions}"
    keys = {mention.key for mention in mentions}
    for expected in ("test.collected", "sweep.exact", "vllm-0.29.passed", "nemo-gym.passed", "compat.methods"):
        assert expected in keys, f"no doc marks fig:{expected}"


def test_every_key_is_known_and_quoted_alike(mentions: list[Mention]) -> None:
    # check() with an empty output dir leaves only the problems of the docs themselves, plus one "no output" per
    # figure a CI step prints, which only .ci/run can check.
    problems = [p for p in check(docs(), Path("/nonexistent")) if ": no output of " not in p]
    assert not problems, "\n".join(problems)


def test_every_source_is_declared() -> None:
    ci_run = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    saved = set(re.findall(r"^\s*step (\S+) ", ci_run, re.M))
    for key, figure in FIGURES.items():
        assert figure.step is None or figure.step in saved, (
            f"fig:{key} reads the output of `{figure.step}`, not a .ci/run step"
        )
        assert figure.compute is None or figure.compute in REPO_SOURCES, f"fig:{key}: no function {figure.compute}"
    assert "tests/doc_figures.py" in ci_run.splitlines()[-1], ".ci/run should check the figures as its last step"


def test_repo_sourced_figures_match(mentions: list[Mention]) -> None:
    values = {name: compute() for name, compute in REPO_SOURCES.items() if name != "collected"}
    wrong = []
    for m in mentions:
        figure = FIGURES.get(m.key)
        if figure is not None and figure.compute in values and m.figure.replace(",", "") != values[figure.compute]:
            wrong.append(
                f"{m.doc}:{m.line}: fig:{m.key} says {m.figure}, {figure.command} gives {values[figure.compute]}"
            )
    assert not wrong, "\n".join(wrong)


def test_the_number_of_tests_is_the_one_collected(mentions: list[Mention]) -> None:
    count = collected()
    quoted = [m for m in mentions if m.key == "test.collected"]
    assert quoted, "no doc quotes fig:test.collected"
    wrong = [f"{m.doc}:{m.line} says {m.figure}" for m in quoted if m.figure.replace(",", "") != count]
    assert not wrong, f"pytest collects {count} tests (update the figure with the tests you add): {wrong}"


def test_the_compat_table_lists_every_supported_release() -> None:
    text = (ROOT / "docs" / "vllm-versions.md").read_text(encoding="utf-8")
    block = re.search(r"<!-- fig-block:vllm-compat -->\n```\n(.*?)\n```", text, re.S)
    assert block, (
        "docs/vllm-versions.md should mark the `ngt vllm-compat` output block with <!-- fig-block:vllm-compat -->"
    )
    rows = [line.split() for line in block[1].splitlines() if re.match(r"^\d+\.\d+\.\d+ ", line)]
    assert [row[0] for row in rows] == supported_releases()
    for version, methods, _, symbols, *_ in rows:
        due = _methods_due(version)
        assert methods == f"{due}/{due}", f"{version}: the table says {methods}, the hook wraps {due} there"
        assert symbols == f"{len(USED_SYMBOLS)}/{len(USED_SYMBOLS)}", f"{version}: the table says {symbols} symbols"


# --- the checker on real output shapes -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sweep_output() -> str:
    """`ngt template-sweep` on the two most downloaded templates: the real output's shape, in seconds."""
    result = subprocess.run(
        [sys.executable, "-m", "nemo_gym_tok", "template-sweep", "--limit", "2", "--listed", "1"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def test_the_sweep_parsers_read_its_output(sweep_output: str) -> None:
    figures = {key: figure.parse(sweep_output) for key, figure in FIGURES.items() if figure.step == "template-sweep"}
    assert figures["sweep.templates"] == "2"
    outcomes = ("exact", "refused", "crash", "wrong", "no-chat-turns")
    assert sum(int(figures[f"sweep.{outcome}"]) for outcome in outcomes) == 2
    assert int(figures["sweep.chat-turns"]) == 2 - int(figures["sweep.no-chat-turns"])
    assert figures["sweep.crashes"] == "0"
    assert all(figures[f"sweep.{outcome}.downloads"].endswith("%") for outcome in outcomes)


def test_a_planted_mismatch_is_reported(tmp_path: Path, sweep_output: str) -> None:
    exact = sweep_row("exact", "n")(sweep_output)
    outputs = tmp_path / "ci-output"
    outputs.mkdir()
    (outputs / "template-sweep.txt").write_text(sweep_output)
    doc = tmp_path / "docs" / "hook.md"
    doc.parent.mkdir()
    original = (ROOT / "docs" / "hook.md").read_text(encoding="utf-8")
    assert "<!-- fig:sweep.exact -->" in original
    planted = re.sub(r"\d[\d,]*<!-- fig:sweep\.exact -->", f"{exact}<!-- fig:sweep.exact -->", original)
    doc.write_text(planted)
    sweep_keys = [p for p in check([doc], outputs, tmp_path) if "fig:sweep.exact " in p]
    assert not sweep_keys, sweep_keys
    wrong = int(exact) + 1
    doc.write_text(planted.replace(f"{exact}<!-- fig:sweep.exact -->", f"{wrong}<!-- fig:sweep.exact -->", 1))
    problems = check([doc], outputs, tmp_path)
    assert any(f"fig:sweep.exact says {wrong}, `ngt template-sweep` printed {exact}" in p for p in problems), problems
    (outputs / "template-sweep.txt").unlink()
    assert any("fig:sweep.exact: no output of `ngt template-sweep`" in p for p in check([doc], outputs, tmp_path))


def test_a_planted_test_count_is_reported(tmp_path: Path, mentions: list[Mention]) -> None:
    quoted = next(m for m in mentions if m.key == "vllm-0.29.passed")
    passed, deselected = int(quoted.figure), next(m.figure for m in mentions if m.key == "vllm-0.29.deselected")
    outputs = tmp_path / "ci-output"
    outputs.mkdir()
    summary = f"==== {passed + 1} passed, {deselected} deselected in 156.10s (0:02:36) ====\n"
    (outputs / "test-vllm-0.29.txt").write_text(".venv-vllm-0.29/bin/python -m pytest ...\n" + summary)
    doc = tmp_path / quoted.doc
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text((ROOT / quoted.doc).read_text(encoding="utf-8"))
    problems = [p for p in check([doc], outputs, tmp_path) if "fig:vllm-0.29." in p]
    expected = (
        f"{quoted.doc}:{quoted.line}: fig:vllm-0.29.passed says {passed}, `make test-vllm-0.29` printed {passed + 1}"
    )
    assert problems == [expected], problems


def test_a_mark_without_a_figure_and_an_unknown_key_are_reported(tmp_path: Path) -> None:
    doc = tmp_path / "x.md"
    doc.write_text("about ten<!-- fig:sweep.exact --> and 12<!-- fig:no.such.key --> and 7<!-- fig:sweep.wrong -->\n")
    problems = check([doc], tmp_path, tmp_path)
    assert any("x.md:1: fig:sweep.exact follows no figure" in p for p in problems), problems
    assert any("fig:no.such.key is not a key" in p for p in problems), problems


def test_pytest_summary_parser_reads_real_summaries(tmp_path: Path) -> None:
    (tmp_path / "test_sample.py").write_text(
        "import pytest\n\ndef test_a():\n    pass\n\ndef test_b():\n    pass\n\n"
        "def test_c():\n    pytest.skip('sample')\n\ndef test_d():\n    pass\n"
    )
    for quiet in ([], ["-q"]):
        result = subprocess.run(
            [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *quiet, "--deselect", "test_sample.py::test_d"],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert pytest_counts(result.stdout) == {"passed": 2, "skipped": 1, "deselected": 1}, result.stdout
    assert pytest_counts("==== 1305 passed, 3 deselected in 610.2s (0:10:10) ====\n") == {
        "passed": 1305,
        "deselected": 3,
    }
    assert FIGURES["test.collected"].parse("= 30 passed, 2 skipped, 1 failed, 4 deselected in 5.0s =") == "33"
    with pytest.raises(ValueError, match="no pytest summary"):
        pytest_counts("All checks passed!\n12 files already formatted\n")


def test_the_checker_runs_as_a_command(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "tests/doc_figures.py", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 1 and "no output of `make test`" in result.stderr, result.stderr
