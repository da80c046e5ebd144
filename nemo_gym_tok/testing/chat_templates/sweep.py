"""The pure-level sweep: every shipped chat template, drift-prone episodes through the splice, judged by the oracle.

Per template: build its family tokenizer, detect the template's turn structure, play a few episodes (plain, with
tools, with reasoning, without a system prompt; turns ended on an end token and cut), then edit earlier messages and
check the splice refuses every edit the template renders. A template is `exact` when every splice passed the oracle
and every visible edit was refused, `refused` when the splice refused something with a 400 (never wrong), and `wrong`
when the oracle caught a wrong splice or an edit passed the structural check. Templates that render no assistant turn
at all (rerankers, embedders, speech and translation templates that print one fixed prompt) are `no chat turns`:
there is nothing to splice, and the hook answers them with a 400 that says so. A template that renders no tool
result cannot render a tool-calling episode: its tool episodes are still played (a wrong splice there counts), but
a refusal in them is listed apart from the template's outcome, as shapes the template cannot render are.

A shape the template cannot render is told from a crash by where the exception was raised. The sweep renders through
`SweepRenderer`, which marks an exception that leaves the template's own rendering (its `render` call) from code outside
this package (Jinja's compiled template, transformers' `raise_exception`): that episode is set apart as unrenderable.
Any other exception that is neither a refusal (SpliceError) nor the oracle's WrongSplice was raised by our code (the
splice, the structural check, the oracle) and is a crash: the template's outcome is `crash` (worse than `refused`,
short of `wrong`, which a later episode may still find; a crash ends only its episode, so every crash is counted), each
crash is listed with its template and exception, the report prints how many there were, and the run fails as it does
on a wrong splice.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import multiprocessing
import random
import traceback
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nemo_gym_tok.splice import (
    HFChatRenderer,
    NoAssistantTurnsError,
    RenderMemo,
    SpliceError,
    TemplateProfile,
    detect_profile,
    find_prefix_source,
    in_this_package,
    neutralize,
    raised_in_this_package,
    splice_prompt,
)
from nemo_gym_tok.testing.chat_templates.catalog import TemplateEntry, load_catalog
from nemo_gym_tok.testing.chat_templates.families import family_of
from nemo_gym_tok.testing.chat_templates.oracle_episodes import (
    TOOL,
    Episode,
    EpisodeSettings,
    WrongSplice,
    play_episode,
)
from nemo_gym_tok.testing.chat_templates.tokenizer import end_token_ids, family_tokenizer

OUTCOMES = ("exact", "refused", "crash", "wrong", "no chat turns")
NO_TOOL_RESULTS = "the template renders no tool result (no tool support), so a tool-calling episode cannot be rendered"

SHAPES = (
    EpisodeSettings(turns=4),
    EpisodeSettings(turns=4, system=False),
    EpisodeSettings(turns=4, tools=True),
    EpisodeSettings(turns=4, reasoning=True),
)


_RAISED_BY_TEMPLATE = "ngt_raised_by_template"


class SweepRenderer(HFChatRenderer):
    """An HFChatRenderer that marks the exceptions its template raises, so that a shape the template cannot render is
    told from a crash in the splice or the oracle (`failure_kind`)."""

    def render(self, messages: Any, *, add_generation_prompt: bool, continue_final_message: bool = False) -> str:
        try:
            return super().render(
                messages, add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message
            )
        except Exception as exc:
            # Raised inside the render call, but by our own code (preparing the messages), it is still a crash.
            if not raised_in_this_package(exc):
                try:
                    setattr(exc, _RAISED_BY_TEMPLATE, True)
                except AttributeError:  # an exception type without a __dict__: left a crash, never hidden
                    pass
            raise

    def render_with_tools(self, messages: Any, tools: list[dict[str, Any]], *, add_generation_prompt: bool) -> str:
        return SweepRenderer(self.tokenizer, tools, self.template_kwargs, self.chat_template).render(
            messages, add_generation_prompt=add_generation_prompt
        )


def raised_by_template(exc: BaseException) -> bool:
    """Whether `exc` left a SweepRenderer's rendering, raised by the template (not by this package's code)."""
    return bool(getattr(exc, _RAISED_BY_TEMPLATE, False))


def failure_kind(exc: BaseException) -> str:
    """How an exception out of an episode (or a splice) is filed: "wrong" (the oracle's WrongSplice), "refused" (a
    SpliceError: the hook's 400), "unrenderable" (the template's own rendering raised: a shape it cannot render) or
    "crash" (anything else: a bug in the splice or the oracle)."""
    if isinstance(exc, WrongSplice):
        return "wrong"
    if isinstance(exc, SpliceError):
        return "refused"
    return "unrenderable" if raised_by_template(exc) else "crash"


def describe_crash(exc: BaseException) -> str:
    """The exception and the last frame of our code it went through (where a crash is to be looked for)."""
    frames = [frame for frame in traceback.extract_tb(exc.__traceback__) if in_this_package(frame.filename)]
    where = f" at {Path(frames[-1].filename).name}:{frames[-1].lineno} ({frames[-1].name})" if frames else ""
    return f"{type(exc).__name__}: {exc}{where}"


@dataclass
class TemplateResult:
    name: str
    family: str
    downloads: int
    outcome: str
    reason: str = ""
    splices: int = 0
    splices_checked_by_text: int = 0
    """Splices whose structural check the text walk proved (the rest needed the exact walk, which tokenizes)."""
    splices_new_turn: int = 0
    """Splices that rendered only the new messages (episodes played as a server plays them, with a render memo)."""
    edits_refused: int = 0
    unrenderable: list[str] = field(default_factory=list)
    """Episode shapes the template itself cannot render (no tool support, strict alternation): not splice outcomes."""
    crashes: list[str] = field(default_factory=list)
    """Exceptions our code raised (the splice, the structural check, the oracle), with where: see `failure_kind`."""


@dataclass
class SweepReport:
    results: list[TemplateResult] = field(default_factory=list)

    @property
    def crashes(self) -> int:
        return sum(len(r.crashes) for r in self.results)

    @property
    def failed(self) -> bool:
        """A wrong splice or a crash anywhere: the run fails (exit status 1)."""
        return self.crashes > 0 or any(r.outcome in ("wrong", "crash") for r in self.results)

    def share(self, outcome: str, *, weighted: bool) -> float:
        total = sum(r.downloads if weighted else 1 for r in self.results)
        part = sum(r.downloads if weighted else 1 for r in self.results if r.outcome == outcome)
        return part / total if total else 0.0

    def format(self, *, listed: int = 40) -> str:
        splices = sum(r.splices for r in self.results)
        by_text = sum(r.splices_checked_by_text for r in self.results)
        lines = [
            f"{len(self.results)} chat templates; splices judged: {splices}, "
            f"edits refused: {sum(r.edits_refused for r in self.results)}",
            f"splices whose structural check the text walk proved (no tokenization of the history): {by_text} "
            f"({by_text / (splices or 1):.1%}); the rest needed the exact id walk",
            f"splices that rendered only the new messages (every other episode plays with a server's render memo): "
            f"{sum(r.splices_new_turn for r in self.results)}",
            f"crashes: {self.crashes} (exceptions raised by the splice or the oracle, not by a template; "
            f"in {sum(bool(r.crashes) for r in self.results)} templates)",
        ]
        lines.append(f"{'outcome':<16}{'templates':>10}{'by count':>10}{'by downloads':>14}")
        counts = Counter(r.outcome for r in self.results)
        for outcome in OUTCOMES:
            lines.append(
                f"{outcome:<16}{counts[outcome]:>10}{self.share(outcome, weighted=False):>10.1%}"
                f"{self.share(outcome, weighted=True):>14.2%}"
            )
        by_family: dict[str, Counter[str]] = defaultdict(Counter)
        for result in self.results:
            by_family[result.family][result.outcome] += 1
        chat = [r for r in self.results if r.outcome != "no chat turns"]
        chat_downloads = sum(r.downloads for r in chat) or 1
        lines.append(
            f"exact among templates with chat turns: {sum(r.outcome == 'exact' for r in chat)}/{len(chat)}, "
            f"{sum(r.downloads for r in chat if r.outcome == 'exact') / chat_downloads:.2%} by downloads"
        )
        toolless = [r for r in chat if any(NO_TOOL_RESULTS in reason for reason in r.unrenderable)]
        strict = sum(r.downloads for r in chat if r.outcome == "exact" and r not in toolless) / chat_downloads
        lines.append(
            f"refused tool-calling episodes not counted (the template renders no tool result): "
            f"{len(toolless)} templates, {sum(r.downloads for r in toolless) / chat_downloads:.2%} of those "
            f"downloads; counting them as refusals, {strict:.2%} exact"
        )
        lines.append("per family (exact/refused/crash/wrong/no chat turns):")
        for name in sorted(by_family):
            c = by_family[name]
            lines.append(f"  {name:<14} " + " ".join(f"{c[outcome]:>4}" for outcome in OUTCOMES))
        crashed = sorted((r for r in self.results if r.crashes), key=lambda r: -r.downloads)
        if crashed:
            lines.append(f"crashes (by downloads, first {min(listed, len(crashed))} of {len(crashed)} templates):")
            lines += [
                f"  {r.downloads:>10}  {r.name} [{r.family}] ({len(r.crashes)}): {crash[:200]}"
                for r in crashed[:listed]
                for crash in r.crashes[:3]
            ]
        for outcome in ("wrong", "refused", "no chat turns"):  # crashes: listed above, up to 3 a template
            rows = sorted((r for r in self.results if r.outcome == outcome), key=lambda r: -r.downloads)
            if rows:
                lines.append(f"{outcome} (by downloads, first {min(listed, len(rows))} of {len(rows)}):")
                lines += [f"  {r.downloads:>10}  {r.name} [{r.family}]: {r.reason[:160]}" for r in rows[:listed]]
        return "\n".join(lines)


def sweep_template(entry: TemplateEntry, *, episodes_per_shape: int = 2, seed: int = 0) -> TemplateResult:
    """Judge one template (see the module docstring)."""
    family = family_of(entry)
    result = TemplateResult(entry.name, family.name, entry.downloads, "exact")
    tokenizer = family_tokenizer(entry.text, family)
    ends = end_token_ids(tokenizer, family)
    plain = SweepRenderer(tokenizer, extra_end_token_ids=ends)
    with_tools = SweepRenderer(tokenizer, tools=[TOOL], extra_end_token_ids=ends)
    try:
        profile = detect_profile(plain)
    except NoAssistantTurnsError as exc:
        return _outcome(result, "no chat turns", str(exc))
    except SpliceError as exc:
        return _outcome(result, "refused", f"profile: {exc}")
    except Exception as exc:  # noqa: BLE001 - detection probes its template itself: anything escaping it is ours
        return _crash(result, "profile", exc)
    played = 0
    system_ok = renders(plain, [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}])
    tool_results_ok = _renders_tool_results(with_tools)
    for shape_number, shape in enumerate(SHAPES):
        if not system_ok:  # templates without a system role (Gemma 2) play every shape without one
            shape = dataclasses.replace(shape, system=False)
        for number in range(episodes_per_shape):
            # Every other episode as a server plays it: with a render memo, its later turns render the new messages
            # only (splice._new_turn); the others take the full check on every turn.
            renderer = _with_memo if number % 2 == 0 else _as_is
            renderer = renderer(with_tools if shape.tools else plain)
            rng = random.Random(f"{seed}-{entry.name}-{shape_number}-{number}")
            try:
                episode = play_episode(renderer, profile, rng, shape)
            except Exception as exc:  # noqa: BLE001 - filed by failure_kind: wrong, refused, unrenderable or a crash
                kind = failure_kind(exc)
                if kind == "wrong":
                    return _outcome(result, "wrong", f"{_shape(shape)}: {exc}")
                if kind == "crash":
                    _crash(result, _shape(shape), exc)
                elif kind == "unrenderable":  # the template cannot render this shape (no tools, say)
                    result.unrenderable.append(f"{_shape(shape)}: {type(exc).__name__}: {exc}")
                elif shape.tools and not tool_results_ok:  # refused, still played: a wrong splice would count
                    result.unrenderable.append(f"{_shape(shape)}: {NO_TOOL_RESULTS}; refused: {exc}")
                else:
                    _outcome(result, "refused", f"{_shape(shape)}: {exc}")
                continue
            played += 1
            result.splices += len(episode.telemetry)
            result.splices_checked_by_text += sum(episode.checked_by_text)
            result.splices_new_turn += sum(episode.new_turn)
            wrong = _edits_are_refused(renderer, profile, episode, result)
            if wrong:
                return _outcome(result, "wrong", wrong)
    if played == 0 and result.outcome == "exact":
        return _outcome(result, "refused", result.reason or "no episode could be rendered")
    return result


def sweep(
    entries: Iterable[TemplateEntry],
    *,
    progress: Callable[[TemplateResult], None] | None = None,
    jobs: int = 1,
    **options: Any,
) -> SweepReport:
    """Every template of `entries` judged, in their order; over `jobs` processes when more than 1 (each template is
    judged alone, so the report is the same)."""
    report = SweepReport()
    with contextlib.ExitStack() as stack:
        if jobs > 1:
            pool = stack.enter_context(ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")))
            results: Iterable[TemplateResult] = pool.map(functools.partial(sweep_template, **options), entries)
        else:
            results = (sweep_template(entry, **options) for entry in entries)
        for result in results:
            report.results.append(result)
            if progress:
                progress(result)
    return report


def sweep_catalog(**options: Any) -> SweepReport:
    return sweep(load_catalog(), **options)


def _edits_are_refused(
    renderer: HFChatRenderer, profile: TemplateProfile, episode: Episode, result: TemplateResult
) -> str | None:
    """Edit the messages before the last bundled turn; every edit the template renders must be refused."""
    messages = episode.messages
    a = max(i for i, m in enumerate(messages) if m.get("prompt_token_ids") is not None)
    edits: list[tuple[str, Callable[[list[dict[str, Any]]], None], HFChatRenderer]] = []
    for index, message in enumerate(messages[:a]):
        if message["role"] in ("system", "user", "tool") and isinstance(message.get("content"), str):
            edits.append((f"edited messages[{index}]", _appender(index), renderer))
    if not renderer.tools:
        edits.append(
            (
                "tools added",
                lambda m: None,
                SweepRenderer(renderer.tokenizer, tools=[TOOL], extra_end_token_ids=tuple(renderer.end_token_ids)),
            )
        )
    for label, edit, edited_renderer in edits:
        edited = copy.deepcopy(messages)
        edit(edited)
        try:
            before = renderer.render(neutralize(messages, a)[:a], add_generation_prompt=True)
            after = edited_renderer.render(neutralize(edited, a)[:a], add_generation_prompt=True)
        except Exception:  # noqa: BLE001 - an edit the template cannot render is nothing to refuse
            continue
        if before == after:
            continue  # the template does not render what was edited: the prompt is still exactly the template's
        try:
            splice_prompt(edited_renderer, profile, edited, find_prefix_source(edited)).result()
        except Exception as exc:  # noqa: BLE001 - filed by failure_kind: only a refusal refuses the edit
            kind = failure_kind(exc)
            if kind == "refused":
                result.edits_refused += 1
            elif kind == "crash":
                _crash(result, label, exc)
            continue  # unrenderable: the splice rendered a shape the template cannot (no edit passed)
        return f"{label} passed the structural check"
    return None


def _with_memo(renderer: SweepRenderer) -> SweepRenderer:
    """A copy of `renderer` that keeps a render memo, as a server's splice host does."""
    remembering = copy.copy(renderer)
    remembering.render_memo, remembering.render_scope = RenderMemo(), "sweep"  # type: ignore[attr-defined]
    return remembering


def _as_is(renderer: SweepRenderer) -> SweepRenderer:
    return renderer


def _renders_tool_results(renderer: HFChatRenderer) -> bool:
    """Whether a tool result's text appears in the template's rendering: a template that drops tool results (a
    speech or translation template with no tool support) cannot render a tool-calling episode at all."""
    call = {"id": "call_0", "type": "function", "function": {"name": "lookup", "arguments": '{"word": "x"}'}}
    messages = [
        {"role": "user", "content": "Hello there."},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_0", "content": "ngtresult7q"},
    ]
    try:
        return "ngtresult7q" in renderer.render(messages, add_generation_prompt=True)
    except Exception:  # noqa: BLE001 - the template refuses this shape: its tool episodes fail to render too
        return True


def renders(renderer: HFChatRenderer, messages: list[dict[str, Any]]) -> bool:
    """Whether the template renders `messages` (with a generation prompt) without raising."""
    try:
        renderer.render(messages, add_generation_prompt=True)
    except Exception:  # noqa: BLE001 - the template refuses this shape
        return False
    return True


def _appender(index: int) -> Callable[[list[dict[str, Any]]], None]:
    def edit(messages: list[dict[str, Any]]) -> None:
        messages[index]["content"] += " (edited)"

    return edit


def _crash(result: TemplateResult, where: str, exc: BaseException) -> TemplateResult:
    result.crashes.append(f"{where}: {describe_crash(exc)}")
    return _outcome(result, "crash", result.crashes[-1])


def _outcome(result: TemplateResult, outcome: str, reason: str) -> TemplateResult:
    rank = {"exact": 0, "no chat turns": 1, "refused": 2, "crash": 3, "wrong": 4}
    if rank[outcome] >= rank[result.outcome]:
        if outcome != result.outcome or not result.reason or outcome == "refused" and result.outcome == "exact":
            result.reason = reason
        result.outcome = outcome
    return result


def _shape(shape: EpisodeSettings) -> str:
    parts = [
        "tools" if shape.tools else "",
        "reasoning" if shape.reasoning else "",
        "" if shape.system else "no system",
    ]
    return "episode(" + ", ".join(p for p in parts if p) + ")"
