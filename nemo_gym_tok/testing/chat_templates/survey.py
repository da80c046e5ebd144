"""Survey: build every shipped template's family tokenizer, render every probe, print what works (`python -m ...`)."""

from __future__ import annotations

import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from nemo_gym_tok.testing.chat_templates.catalog import TemplateEntry, load_catalog
from nemo_gym_tok.testing.chat_templates.families import Family, family_of
from nemo_gym_tok.testing.chat_templates.probe import PROBES, probe, render_ok
from nemo_gym_tok.testing.chat_templates.tokenizer import family_tokenizer

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

TOP_N = 40


@dataclass
class TemplateResult:
    """One template's outcome: its family, the checks it failed (with the exception text), and behaviours seen."""

    entry: TemplateEntry
    family: Family
    failures: dict[str, str] = field(default_factory=dict)  # check name -> exception text
    notes: list[str] = field(default_factory=list)


@dataclass
class SurveyReport:
    """All per-template results plus the time spent building tokenizers and rendering."""

    results: list[TemplateResult]
    tokenizers_built: int
    build_seconds: float
    render_seconds: float


def _check_name(probe_name: str, generation_prompt: bool) -> str:
    return f"{probe_name}{'+gen' if generation_prompt else ''}"


CHECKS = tuple(_check_name(p.name, gen) for p in PROBES for gen in (False, True))


def _probe_template(tokenizer: PreTrainedTokenizerFast, result: TemplateResult) -> None:
    """Render every probe with and without a generation prompt, and look for behaviours a splice must handle."""
    rendered: dict[str, str] = {}
    for item in PROBES:
        for gen in (False, True):
            out = render_ok(tokenizer, item.conversation(), add_generation_prompt=gen, **item.render_kwargs())
            name = _check_name(item.name, gen)
            if isinstance(out, Exception):
                result.failures[name] = f"{type(out).__name__}: {out}".replace("\n", " ")[:160]
            else:
                rendered[name] = out
    # Tool-call arguments: do string arguments (the OpenAI wire format, untouched) render as well as dicts?
    tool = probe("tool_call")
    as_string = render_ok(tokenizer, tool.conversation(dict_arguments=False), **tool.render_kwargs())
    if "tool_call" in rendered and isinstance(as_string, Exception):
        result.notes.append("needs tool-call arguments as a dict")
    elif "tool_call" not in rendered and isinstance(as_string, str):
        result.notes.append("needs tool-call arguments as a JSON string")
    failed = result.failures
    if "system_user" in failed and "user_only" not in failed:
        result.notes.append("refuses a system message")
    if any("alternate" in failed.get(name, "") for name in ("tool_call", "system_user")):
        result.notes.append("enforces strict user/assistant alternation")
    turns = probe("multi_turn").conversation()
    full = rendered.get("multi_turn")
    if full is None:
        return
    answer = turns[1]["content"]
    # History stability: is the 2-message render a prefix of the 3-message one (last assistant not special-cased)?
    history = render_ok(tokenizer, turns[:2])
    if isinstance(history, str) and not full.startswith(history):
        result.notes.append("renders the last assistant message differently from history")
    # Turn closer: does any stop token follow the answer in history, or only the next turn's opener (if anything)?
    between = full.split(answer, 1)[-1].split(turns[2]["content"], 1)[0]
    if answer in full and not any(stop in between for stop in (result.family.eos, *result.family.end_tokens)):
        result.notes.append("no stop token closes an assistant turn in history")
    # Generation prompt: is render(user, gen prompt) a prefix of the render with the assistant reply in place?
    prompt = render_ok(tokenizer, turns[:1], add_generation_prompt=True)
    if isinstance(prompt, str) and not full.startswith(prompt):
        result.notes.append("generation prompt is not a prefix of the answered turn")
    if rendered.get("multi_turn") == rendered.get("multi_turn+gen"):
        result.notes.append("add_generation_prompt changes nothing")
    ids = tokenizer.encode(full, add_special_tokens=False)
    if tokenizer.decode(ids, skip_special_tokens=False) != full:
        result.notes.append("encode/decode does not round-trip")


def survey(entries: Iterable[TemplateEntry] | None = None, out: Callable[[str], None] = print) -> SurveyReport:
    """Build every catalog entry's (or just `entries`') family tokenizer, render all probes with it, print the
    summary tables and return the raw results. Tokenizers are cheap after the first: they share one parsed BPE.
    """
    start = time.perf_counter()
    results: list[TemplateResult] = []
    build = render = 0.0
    for item in load_catalog() if entries is None else entries:
        t0 = time.perf_counter()
        family = family_of(item)
        tokenizer = family_tokenizer(item.text, family)
        t1 = time.perf_counter()
        build += t1 - t0
        result = TemplateResult(item, family)
        _probe_template(tokenizer, result)
        results.append(result)
        render += time.perf_counter() - t1
    report = SurveyReport(results, len(results), build, render)
    _print(report, out)
    out(f"\ntime: {len(results)} tokenizers built in {build:.1f}s (first includes the one-off BPE conversion), "
        f"rendering {render:.1f}s, total {time.perf_counter() - start:.1f}s")  # fmt: skip
    return report


def _pct(part: float, whole: float) -> str:
    return f"{100 * part / whole:5.1f}%" if whole else "    -"


def _print(report: SurveyReport, out: Callable[[str], None]) -> None:
    results = report.results
    total_n, total_dl = len(results), sum(r.entry.downloads for r in results) or 1
    out(f"{total_n} templates, {sum(r.entry.downloads for r in results):,} downloads\n")
    out(f"{'family':14} {'templates':>9} {'downloads':>9}   all-probes-ok")
    by_family: dict[str, list[TemplateResult]] = defaultdict(list)
    for result in results:
        by_family[result.family.name].append(result)
    ranked = sorted(by_family.items(), key=lambda kv: -sum(r.entry.downloads for r in kv[1]))
    for name, members in ranked:
        dl = sum(r.entry.downloads for r in members)
        ok = sum(1 for r in members if not r.failures)
        out(f"{name:14} {len(members):9} {_pct(dl, total_dl):>9}   {ok}/{len(members)}")
    out(f"\n{'check':20} {'render ok':>9} {'templates':>9} {'downloads':>9}")
    for check in CHECKS:
        good = [r for r in results if check not in r.failures]
        dl = sum(r.entry.downloads for r in good)
        out(f"{check:20} {len(good):9} {_pct(len(good), total_n):>9} {_pct(dl, total_dl):>9}")
    notes = Counter(note for r in results for note in r.notes)
    out("\nbehaviours (templates, download share):")
    for note, count in notes.most_common():
        dl = sum(r.entry.downloads for r in results if note in r.notes)
        out(f"  {note:62} {count:4} {_pct(dl, total_dl)}")
    top = sorted(results, key=lambda r: -r.entry.downloads)[:TOP_N]
    out(f"\ntop-{TOP_N} templates by downloads that fail a check:")
    for result in top:
        if not result.failures:
            continue
        errors = Counter(result.failures.values())
        out(f"  {result.entry.name} [{result.family.name}] fails {sorted(result.failures)}")
        for text, _ in errors.most_common(2):
            out(f"      {text}")


if __name__ == "__main__":
    survey()
