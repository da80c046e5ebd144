"""bench/report.py: a figure that fails is reported and left out, and the run keeps every other figure."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"
if str(BENCH) not in sys.path:  # bench/ is a folder of scripts, not a package: its scripts import siblings this way
    sys.path.insert(0, str(BENCH))

from benchkit.figures import Figure  # noqa: E402
from report import collect_figures, document  # noqa: E402

FACTS = {"date": "d", "cpu": "c", "memory": "m", "load": "l", "vllm": "v", "python": "p", "placement": "x"}


def figure(key: str) -> Figure:
    made = Figure(key, f"title {key}", f"command {key}")
    made.seconds = 1.0
    return made


def test_a_failing_figure_is_left_out_and_the_others_are_kept() -> None:
    ran: list[str] = []

    def run_one(key: str) -> list[Figure]:
        ran.append(key)
        if key == "P2":
            raise RuntimeError("the server went away")
        return [figure(key)]

    figures, failed = collect_figures(["P1", "P2", "P6"], run_one)
    assert ran == ["P1", "P2", "P6"]  # the figure after the failing one still ran
    assert sorted(figures) == ["P1", "P6"]
    assert failed == {"P2": "RuntimeError: the server went away"}
    text = document(figures, FACTS, 60.0, argparse.Namespace(quick=False), False, failed)
    assert "| failed in this run | P2: RuntimeError: the server went away (its section is left out) |" in text
    assert "## P1: title P1" in text and "## P6: title P6" in text and "## P2:" not in text


def test_a_clean_run_names_no_failure() -> None:
    figures, failed = collect_figures(["P1"], lambda key: [figure(key)])
    assert failed == {}
    assert "failed in this run" not in document(figures, FACTS, 60.0, argparse.Namespace(quick=False), False, failed)
