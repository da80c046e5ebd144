"""What a soak counted, read from its output after the run: rollouts lost, doubled, torn, redone and why, contiguity and
new token segments, and the restarted replica's share of the calls after its readmission. Each count can fail the
run: `tests/test_soak_report.py` plants a lost rollout, a torn line mid-file and a segment nobody asked for."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nemo_gym_tok.common.jsonl import JsonlLine, scan_jsonl
from nemo_gym_tok.records.contiguity import check_file
from nemo_gym_tok.types.tokens import REPLICA_KEY

MAX_RSS_GROWTH = 0.10


@dataclass
class OutputCounts:
    """The soak's output file, read whole."""

    written: int = 0
    distinct: int = 0
    torn_lines: int = 0
    """Lines that are not a whole record, anywhere in the file (the collector leaves none: it truncates a torn last
    line when it resumes, so one here is a fault)."""
    contiguous: int = 0
    new_segments: int = 0
    """Segments the caller asked for (start_token_segment)."""
    unasked_segments: int = 0
    """Segments nobody asked for: each fails its rollout's contiguity."""
    calls_per_replica: dict[str, int] = field(default_factory=dict)

    @classmethod
    def read(cls, path: Path) -> OutputCounts:
        counts, keys = cls(), []
        for line in scan_jsonl(path):
            rollout = line.value.get("rollout_id") if line.value is not None else None
            try:
                keys.append((rollout["row_hash"], rollout["occurrence"], rollout["repeat"], rollout["agent"]))
            except (KeyError, TypeError):  # no object (torn, anywhere in the file), or not a whole record
                counts.torn_lines += 1
        counts.written, counts.distinct = len(keys), len(set(keys))
        report = check_file(path)
        counts.contiguous, counts.new_segments = report.contiguous, report.new_segments
        counts.unasked_segments = report.unasked_segments
        counts.calls_per_replica = dict(calls_per_replica(scan_jsonl(path)))
        return counts


def bundled_items(lines: Iterable[JsonlLine]) -> Iterator[dict[str, Any]]:
    """The output items that carry a bundle, over the whole records among `lines` (scan_jsonl's or scan_lines'; torn
    lines skipped)."""
    for line in lines:
        response = line.value.get("response") if line.value is not None else None
        output = response.get("output") if isinstance(response, dict) else None
        if isinstance(output, list):
            yield from (
                item for item in output if isinstance(item, dict) and item.get("generation_token_ids") is not None
            )


def calls_per_replica(lines: Iterable[JsonlLine]) -> Counter[str]:
    """Model calls per replica over the whole records among `lines` (the replica each bundle names)."""
    return Counter(str(item.get(REPLICA_KEY) or "unnamed") for item in bundled_items(lines))


def redo_reason(entry: dict[str, Any]) -> str:
    """What a failures-file entry failed of, in a few words: its kind and the status it got."""
    status = entry.get("http_status")
    return f"{entry.get('kind', 'unknown')} (HTTP {status})" if status else str(entry.get("kind", "unknown"))


@dataclass
class SoakReport:
    """What the soak counted; `ok` when nothing was lost, doubled or torn, every rollout is contiguous with no segment
    nobody asked for, no gym process grew past MAX_RSS_GROWTH, the weights were kept, and a killed replica came back
    and took calls before the collection ended."""

    expected: int
    output: OutputCounts
    collect_runs: int
    seconds: float
    redone: dict[str, int] = field(default_factory=dict)
    """Rollouts a collector run failed and a later one ran again, by reason (redo_reason)."""
    redone_examples: dict[str, str] = field(default_factory=dict)
    kills: list[dict[str, Any]] = field(default_factory=list)
    rss_kib: dict[str, tuple[int, int]] = field(default_factory=dict)
    """Per gym process (by server name): RSS after warm-up and at the end."""
    pushed_version: str | None = None
    """The version pushed before the collection and kept by a FleetKeeper (None: no push, no keeper)."""
    versions: dict[str, int] = field(default_factory=dict)
    """Model calls per weight version, over every bundle written."""
    replicas: list[dict[str, Any]] = field(default_factory=list)
    """Per replica kill, with a keeper: seconds to its drop, to its readmission, its resync, and the share of the calls
    written after its readmission that it served (soak_weights.py)."""
    routed_at_end: list[str] = field(default_factory=list)

    @property
    def lost(self) -> int:
        return self.expected - self.output.distinct

    @property
    def duplicated(self) -> int:
        return self.output.written - self.output.distinct

    @property
    def weights_kept(self) -> bool:
        """No keeper, or every bundle on the pushed version and every killed replica readmitted."""
        if self.pushed_version is None:
            return True
        readmitted = all(figure["readmitted"] for figure in self.replicas)
        return set(self.versions) == {self.pushed_version} and readmitted

    @property
    def rejoined(self) -> bool:
        """No replica killed (or no keeper), or one readmitted while the collection ran and serving calls after it.
        A replica readmitted only after the end is reported, not failed: a random kill may come late."""
        if not self.replicas:
            return True
        return any((figure.get("share_after_readmission") or 0) > 0 for figure in self.replicas)

    @property
    def worst_rss_growth(self) -> float:
        return max(((end - start) / start for start, end in self.rss_kib.values() if start), default=0.0)

    @property
    def ok(self) -> bool:
        return (
            self.lost == 0
            and self.duplicated == 0
            and self.output.torn_lines == 0
            and self.output.unasked_segments == 0
            and self.output.contiguous == self.expected
            and self.worst_rss_growth < MAX_RSS_GROWTH
            and self.weights_kept
            and self.rejoined
        )

    def format(self) -> str:
        kinds = Counter(kill["kind"] for kill in self.kills)
        out = self.output
        lines = [
            f"soak: {self.seconds:.0f} s, {len(self.kills)} kills ({', '.join(f'{k} {n}' for k, n in kinds.items())}), "
            f"{self.collect_runs} collector runs",
            f"rollouts: expected {self.expected}, written {out.written}, lost {self.lost}, duplicated "
            f"{self.duplicated}, torn lines {out.torn_lines}, contiguous {out.contiguous}/{self.expected} "
            f"({out.contiguous / max(self.expected, 1):.0%})",
            f"new token segments: asked for {out.new_segments}, nobody asked for {out.unasked_segments}",
            f"redone rollouts: {sum(self.redone.values())}"
            + "".join(f"; {reason} {count}" for reason, count in sorted(self.redone.items())),
        ]
        lines += [f"  {reason}, e.g.: {example}" for reason, example in sorted(self.redone_examples.items())]
        lines.append(f"model calls per replica: {dict(sorted(out.calls_per_replica.items()))}")
        for name, (start, end) in sorted(self.rss_kib.items()):
            growth = (end - start) / start if start else 0.0
            lines.append(f"  RSS {name}: {start / 1024:.1f} MiB -> {end / 1024:.1f} MiB ({growth:+.1%})")
        for kill in self.kills:
            lines.append(f"  kill at {kill['at']:.0f} s: {kill['kind']} {kill['target']} ({kill['note']})")
        if self.pushed_version is not None:
            lines.append(
                f"weights: pushed {self.pushed_version!r}, kept by a FleetKeeper; bundles per version {self.versions}; "
                f"routed at the end {self.routed_at_end}"
            )
        for figure in self.replicas:
            lines.append(
                f"  replica {figure['url']}: dropped {_seconds(figure['drop_seconds'])} after its kill "
                f"({figure['dropped_because']}); routed again {_seconds(figure['ready_to_routed_seconds'])} after it "
                f"was up, its resync {_seconds(figure['resync_seconds'])}, {_relative(figure)}; "
                f"{_share(figure)} of the calls written after it: {figure['readmitted']}"
            )
        lines.append("soak: OK" if self.ok else "soak: FAILED")
        return "\n".join(lines)


def _seconds(value: float | None) -> str:
    return "never" if value is None else f"{value:.2f} s"


def _share(figure: dict[str, Any]) -> str:
    share = figure.get("share_after_readmission")
    return "none" if share is None else f"{share:.0%}"


def _relative(figure: dict[str, Any]) -> str:
    """When the replica was readmitted against the collection's end."""
    left = figure["collecting_after_readmission"]
    if left is None:
        return "never readmitted"
    return f"{left:.0f} s before the collection ended" if left >= 0 else f"{-left:.0f} s after the collection ended"
