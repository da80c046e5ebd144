"""`ngt inspect --html`: the page, rendered by headless Chromium, shows each rollout and each repaired span."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest

from nemo_gym_tok.cli.main import main
from nemo_gym_tok.records.contiguity import bundled_turns
from nemo_gym_tok.records.inspect_html import REPAIRED, read_records, repaired_spans
from nemo_gym_tok.records.training import rollout_to_training_sequences

FIXTURE = Path(__file__).parent / "fixtures" / "demo_grid_navigation.jsonl"
"""Three rollouts of `ngt demo` (grid_navigation, the tiny model): 4 model calls each, 3 of them repaired."""
ALLOW_NO_CHROMIUM = "NGT_TEST_ALLOW_NO_CHROMIUM"


class _Counter(HTMLParser):
    """Counts elements by class and keeps the attributes of the ones the test reads."""

    def __init__(self) -> None:
        super().__init__()
        self.classes: dict[str, int] = {}
        self.sections: list[dict[str, str | None]] = []
        self.body: dict[str, str | None] = {}
        self.titles: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        attributes = dict(attrs)
        for name in (attributes.get("class") or "").split():
            self.classes[name] = self.classes.get(name, 0) + 1
        if "rollout" in (attributes.get("class") or "").split():
            self.sections.append(attributes)
        if tag == "body":
            self.body = attributes
        if "tok" in (attributes.get("class") or "").split() and attributes.get("title"):
            self.titles.append(attributes["title"] or "")


def _chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found:
        return found
    if os.environ.get(ALLOW_NO_CHROMIUM) == "1":
        pytest.skip(f"chromium not installed and {ALLOW_NO_CHROMIUM}=1")
    pytest.fail(
        "chromium is not installed: `apt-get install -y --no-install-recommends chromium` (.ci/run does), or set "
        f"{ALLOW_NO_CHROMIUM}=1 to run without the rendered-page test on purpose"
    )


def _expected_repairs(record: dict[str, Any]) -> int:
    return sum(turn.repaired for turn in bundled_turns(record))


def test_the_rendered_page_shows_every_rollout_and_repaired_span(tiny_model_dir: Path, tmp_path: Path) -> None:
    chromium = _chromium()
    out = tmp_path / "page.html"
    assert main(["inspect", str(FIXTURE), "--html", str(out), "--tokenizer", str(tiny_model_dir)]) == 0
    page = out.read_text()
    assert "http://" not in page and "https://" not in page  # self-contained: nothing to fetch

    dom = subprocess.run(
        [chromium, "--headless", "--disable-gpu", "--no-sandbox", "--dump-dom", out.as_uri()],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    counter = _Counter()
    counter.feed(dom)
    records = read_records(FIXTURE)
    expected_repairs = [_expected_repairs(record) for record in records]
    assert sum(expected_repairs) > 0  # the fixture must exercise repairs, or the counts prove nothing

    assert counter.body.get("data-rendered") == "1", "the page's script did not run to its end"
    assert counter.classes.get("rollout") == len(records)
    assert counter.classes.get("repaired") == sum(expected_repairs)
    assert counter.classes.get("repair") == sum(expected_repairs)  # one side-by-side view per repaired turn
    assert [int(s["data-repaired"] or -1) for s in counter.sections] == expected_repairs
    assert [int(s["data-turns"] or -1) for s in counter.sections] == [len(bundled_turns(r)) for r in records]
    # Every id of every sequence is a token with its hover text; the strip shows all three kinds.
    total_ids = sum(len(s.token_ids) for r in records for s in rollout_to_training_sequences(r))
    assert len(counter.titles) == total_ids
    assert all(title.startswith("id ") for title in counter.titles)
    for kind in ("tok-template", "tok-model", "tok-repaired"):
        assert counter.classes.get(kind, 0) > 0, kind
    assert f"{len(records)} rollouts, {sum(expected_repairs)} repaired spans" in dom


def test_repaired_spans_lie_in_the_repaired_turns_and_differ_from_the_template(tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    for record in read_records(FIXTURE):
        (sequence,) = rollout_to_training_sequences(record)
        (spans,) = repaired_spans(record, tokenizer)
        turns = bundled_turns(record)
        assert [span.turn for span in spans] == [k - 1 for k in range(1, len(turns)) if turns[k].repaired]
        for span in spans:
            start, end = sequence.turns[span.turn]
            assert start <= span.start < span.end <= end  # inside the model's own ids, never the template's
            assert span.template_ids is not None, "the template's rendering was not rebuilt"
            assert span.template_ids != span.model_ids
            assert span.model_ids[-(span.end - span.start) :] == sequence.token_ids[span.start : span.end]


def test_without_a_tokenizer_a_repaired_turn_is_marked_whole() -> None:
    record = read_records(FIXTURE)[0]
    (spans,) = repaired_spans(record, None)
    (sequence,) = rollout_to_training_sequences(record)
    assert spans and all(span.template_ids is None for span in spans)
    assert [(s.start, s.end) for s in spans] == [sequence.turns[s.turn] for s in spans]


def test_the_page_data_marks_repaired_ids_only_where_the_loss_mask_is_one(tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    from nemo_gym_tok.records.inspect_html import page_data

    records = read_records(FIXTURE)
    data = page_data(records, AutoTokenizer.from_pretrained(str(tiny_model_dir)), "t")
    for record, rollout in zip(records, data["rollouts"]):
        (sequence,) = rollout_to_training_sequences(record)
        (shown,) = rollout["sequences"]
        assert rollout["error"] is None
        assert len(shown["kinds"]) == len(sequence.token_ids)
        assert all(mask == 1 for kind, mask in zip(shown["kinds"], sequence.loss_mask) if kind == REPAIRED)
        assert [kind == "t" for kind in shown["kinds"]] == [mask == 0 for mask in sequence.loss_mask]
    json.dumps(data)  # the page embeds it as JSON
