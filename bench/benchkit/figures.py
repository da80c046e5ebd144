"""A figure's tables, its text and the command that reproduces it, and running one figure's script on its own."""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from targets import TARGETS, Verdict, text, verdicts

from benchkit.server import PYTHON, vllm_server


def fmt(value: Any, digits: int = 1) -> str:
    if isinstance(value, float):
        if value != value:
            return "n/a"
        return f"{value:.{digits}f}"
    return str(value)


@dataclass
class Table:
    title: str
    headers: list[str]
    rows: list[list[str]] = field(default_factory=list)

    def add(self, *cells: Any, digits: int = 1) -> None:
        self.rows.append([fmt(cell, digits) for cell in cells])

    def text(self) -> str:
        widths = [
            max(len(h), *(len(r[i]) for r in self.rows)) if self.rows else len(h) for i, h in enumerate(self.headers)
        ]
        lines = [self.title, "  ".join(h.rjust(w) for h, w in zip(self.headers, widths))]
        lines += ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in self.rows]
        return "\n".join(lines)

    def markdown(self) -> str:
        def escape(cell: str) -> str:
            return cell.replace("|", "\\|")

        lines = [
            f"**{self.title}**",
            "",
            "| " + " | ".join(map(escape, self.headers)) + " |",
            "| " + " | ".join("---" for _ in self.headers) + " |",
        ]
        lines += ["| " + " | ".join(map(escape, row)) + " |" for row in self.rows]
        return "\n".join(lines)


@dataclass
class Figure:
    """One figure's result: its tables, the command that reproduces it, notes, and raw data (for the plot)."""

    key: str
    title: str
    command: str
    tables: list[Table] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    data: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0

    def text(self) -> str:
        parts = [
            f"== {self.key}: {self.title}",
            *(t.text() for t in self.tables),
            *self.notes,
            f"command: {self.command}  ({self.seconds:.0f} s)",
        ]
        return "\n\n".join(parts)


def command(script: str, argv: Sequence[str]) -> str:
    """The shell command that runs `script` (bench/NAME.py) with `argv`."""
    return shlex.join([PYTHON, f"bench/{script}", *argv])


def run_standalone(
    make_parser: Callable[[], argparse.ArgumentParser],
    run: Callable[..., Figure | list[Figure]],
    argv: Sequence[str] | None,
    *,
    with_stock: bool = False,
) -> None:
    """A figure's script run on its own: parse its arguments, start (or reuse) the server, print its tables."""
    argv = standalone_argv(argv)
    args = make_parser().parse_args(argv)
    with vllm_server(args.vllm_url) as url:
        figures = run(url, args, argv, stock_url=args.stock_url) if with_stock else run(url, args, argv)
    figures = figures if isinstance(figures, list) else [figures]
    print("\n\n".join(figure.text() for figure in figures))
    print("\n" + text(judged(figures)))


def judged(figures: Iterable[Figure]) -> list[Verdict]:
    """The targets of the figures that ran, judged on their readings (`data["readings"]`), misses first."""
    figures = list(figures)
    readings = {key: reading for figure in figures for key, reading in figure.data.get("readings", {}).items()}
    ran = {figure.key for figure in figures}
    return verdicts(readings, [target for target in TARGETS if target.figure in ran])


def standalone_argv(argv: Sequence[str] | None) -> list[str]:
    return list(sys.argv[1:] if argv is None else argv)
