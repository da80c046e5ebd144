"""`ngt inspect --html`: one self-contained page showing where each id of a collection's training sequences came from"""

from __future__ import annotations

import difflib
import html
import json
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from nemo_gym_tok.common.exact_json import loads_exact
from nemo_gym_tok.common.jsonl import read_jsonl
from nemo_gym_tok.contract.conversion import responses_to_chat_request
from nemo_gym_tok.records.contiguity import BundledTurn, bundled_turns, segments
from nemo_gym_tok.records.rollout_record import full_output
from nemo_gym_tok.records.training import rollout_to_training_sequences
from nemo_gym_tok.types.responses import ResponseItem, ResponsesRequest

# Token kinds as the page's data and CSS name them (one letter per id keeps the embedded data small).
TEMPLATE, MODEL, REPAIRED, IMAGE = "t", "m", "r", "i"

LEGEND = {
    "tok-template": "template: an id the prompt supplied (system, user and tool turns, the chat template's text); "
    "loss mask 0",
    "tok-model": "model-generated: an id the model sampled, kept as sampled; loss mask 1",
    "tok-repaired": "repaired span: model-sampled ids (loss mask 1) where the chat template, re-rendering the "
    "history, would have written other ids; the prefix splice kept the model's ids (bundle "
    "telemetry prefix_splice.repaired_turns), from the first differing id to the last",
    "tok-image": "an image's placeholder ids (a vision model's `image_runs`: the run vLLM expanded the image to, in "
    "the rollout's last prompt); template ids, loss mask 0",
    "tok-forced": "underlined: forced by a constrained-decoding grammar (generation_forced_mask 1; its log prob is "
    "0.0 of the masked distribution)",
    "wv": "before each turn's generated ids: the vLLM weight version that sampled them (v1 \u2192 v2 where a push "
    "landed during the turn; unknown where the record does not say); a rollout whose ids span several versions is "
    "marked \u201cspans weight versions\u201d",
}


class Tokenizer(Protocol):
    def decode(self, ids: Sequence[int]) -> str: ...

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any: ...


@dataclass(frozen=True)
class RepairedSpan:
    """One repaired turn: where its differing model ids sit in the sequence, and what the template would have had."""

    turn: int
    """Index of the model call whose generation was repaired, among the sequence's turns."""
    start: int
    end: int
    """[start, end) of the model's differing ids in the sequence's token_ids."""
    replaced_tokens: int
    """From the telemetry: template ids from the first difference to the end of the turn."""
    template_ids: list[int] | None
    """The template's ids for the same stretch (with the same leading context as model_ids); None where the
    template's rendering could not be rebuilt: then the whole turn is marked."""
    model_ids: list[int]


def repaired_spans(record: dict[str, Any], tokenizer: Tokenizer | None) -> list[list[RepairedSpan]]:
    """Per training sequence (token segment) of `record`, its repaired turns.

    The telemetry on call k says call k-1's generation was repaired; which ids differ is found by re-rendering call
    k's messages with the chat template and diffing its ids against call k's prompt (the model's ids there).
    """
    output = full_output(record)
    result: list[list[RepairedSpan]] = []
    for segment in segments(bundled_turns(record)):
        spans: list[RepairedSpan] = []
        for k in range(1, len(segment)):
            previous, call = segment[k - 1], segment[k]
            if not call.repaired:
                continue
            start = len(previous.prompt_token_ids)
            end = start + len(previous.generation_token_ids)
            replaced = int((call.prefix_splice or {}).get("replaced_tokens", 0))
            template = _template_ids(record, output, previous, tokenizer) if tokenizer is not None else None
            span = _differing(template, call.prompt_token_ids, start, end) if template is not None else None
            if span is None:  # no rebuilt rendering, or it did not differ inside the turn: mark the whole turn
                spans.append(RepairedSpan(k - 1, start, end, replaced, None, previous.generation_token_ids))
                continue
            (t0, t1), (m0, m1), context = span
            spans.append(
                RepairedSpan(
                    k - 1,
                    m0,
                    m1,
                    replaced,
                    template[t0 - context : t1],
                    call.prompt_token_ids[m0 - context : m1],
                )
            )
        result.append(spans)
    return result


def _template_ids(
    record: dict[str, Any], output: list[dict[str, Any]], previous: BundledTurn, tokenizer: Tokenizer
) -> list[int] | None:
    """The chat template's ids for the prompt of the call after `previous` (as vLLM renders it), or None."""
    try:
        items = [ResponseItem.model_validate(item) for item in output]
        # The next call's messages: everything up to its own first model-output item.
        stop = next((i for i in range(previous.item_index + 1, len(items)) if items[i].is_model_output), len(items))
        params = dict(record.get("responses_create_params") or {})
        request = ResponsesRequest.model_validate(params)
        params["input"] = [i.model_dump(exclude_none=True) for i in request.input_items()] + output[:stop]
        chat = responses_to_chat_request(ResponsesRequest.model_validate(params))
        for message in chat["messages"]:
            for call in message.get("tool_calls") or []:
                # vLLM parses arguments before rendering, so templates re-serialize them (the usual repair).
                try:
                    call["function"]["arguments"] = loads_exact(call["function"]["arguments"])
                except (TypeError, ValueError):
                    pass
        text = tokenizer.apply_chat_template(
            chat["messages"],
            tools=chat.get("tools"),
            add_generation_prompt=True,
            tokenize=False,
            **(chat.get("chat_template_kwargs") or {}),
        )
        return list(tokenizer.encode(text, add_special_tokens=False))
    except Exception:  # noqa: BLE001 - any failure to rebuild only loses the side-by-side view, not the page
        return None


def _differing(
    template: list[int], model: list[int], start: int, end: int
) -> tuple[tuple[int, int], tuple[int, int], int] | None:
    """The template's and the model's [from, to) over the differences inside model[start:end], and how many equal
    ids before them to show as context; None where none falls inside."""
    matcher = difflib.SequenceMatcher(None, template, model, autojunk=False)
    ops = [op for op in matcher.get_opcodes() if op[0] != "equal" and op[3] < end and max(op[4], op[3] + 1) > start]
    if not ops:
        return None
    t0, m0 = ops[0][1], max(ops[0][3], start)
    t1, m1 = ops[-1][2], min(max(ops[-1][4], ops[-1][3] + 1), end)
    context = min(4, m0 - start, t0)
    return (t0, t1), (m0, m1), context


def page_data(records: Iterable[dict[str, Any]], tokenizer: Tokenizer | None, title: str) -> dict[str, Any]:
    """What the page's script renders: rollouts, their sequences' ids and kinds, repaired spans, decoded pieces."""
    pieces: dict[int, str] = {}

    def piece(token_id: int) -> str:
        if token_id not in pieces:
            pieces[token_id] = tokenizer.decode([token_id]) if tokenizer is not None else ""
        return pieces[token_id]

    def text(ids: Sequence[int] | None) -> str | None:
        return None if ids is None or tokenizer is None else tokenizer.decode(ids)

    rollouts: list[dict[str, Any]] = []
    for number, record in enumerate(records):
        entry: dict[str, Any] = {
            "label": _label(number, record),
            "reward": record.get("reward"),
            "sequences": [],
            "error": None,
            "spans_weight_versions": False,
        }
        try:
            turns = bundled_turns(record)
            entry["turns"] = len(turns)
            sequences = rollout_to_training_sequences(record)
            repairs = repaired_spans(record, tokenizer)
        except Exception as exc:  # noqa: BLE001 - one unreadable record must not hide the others
            entry.setdefault("turns", 0)
            entry["error"] = f"{type(exc).__name__}: {exc}"
            rollouts.append(entry)
            continue
        entry["spans_weight_versions"] = any(sequence.spans_weight_versions for sequence in sequences) or (
            len({v for sequence in sequences for v in sequence.weight_versions if v is not None}) > 1
        )
        images = turns[-1].image_runs if turns and len(sequences) == 1 else None
        entry["images"] = len(images or [])
        for sequence, spans in zip(sequences, repairs):
            kinds = [MODEL if flag else TEMPLATE for flag in sequence.loss_mask]
            for span in spans:
                kinds[span.start : span.end] = [REPAIRED] * (span.end - span.start)
            for run in images or []:  # positions in the last prompt: the one sequence's own
                kinds[run["position"] : run["position"] + run["length"]] = [IMAGE] * run["length"]
            for token_id in sequence.token_ids:
                piece(token_id)
            entry["sequences"].append(
                {
                    "ids": sequence.token_ids,
                    "kinds": "".join(kinds),
                    "forced": "".join(map(str, sequence.forced_mask)) if sequence.forced_mask is not None else None,
                    "turns": [list(turn) for turn in sequence.turns],
                    "constrained_by": sequence.constrained_by,
                    "weight_versions": [
                        " \u2192 ".join(part["version"] for part in parts) if parts else version
                        for version, parts in zip(sequence.weight_versions, sequence.weight_version_spans)
                    ],
                    "repaired": [
                        {
                            "turn": span.turn,
                            "start": span.start,
                            "end": span.end,
                            "replaced_tokens": span.replaced_tokens,
                            "template_ids": span.template_ids,
                            "model_ids": span.model_ids,
                            "template_text": text(span.template_ids),
                            "model_text": text(span.model_ids),
                        }
                        for span in spans
                    ],
                }
            )
        rollouts.append(entry)
    return {"title": title, "legend": LEGEND, "rollouts": rollouts, "pieces": {str(k): v for k, v in pieces.items()}}


def _label(number: int, record: dict[str, Any]) -> str:
    rollout_id = record.get("rollout_id")
    if isinstance(rollout_id, dict) and "row" in rollout_id:
        return f"rollout {number} (row {rollout_id.get('row')}, repeat {rollout_id.get('repeat')})"
    return f"rollout {number}"


def render_page(data: dict[str, Any]) -> str:
    """The HTML page: styles, script and data inline, nothing fetched."""
    # The data sits in a <script> element: escape what could close it or open a comment there.
    payload = (
        json.dumps(data, ensure_ascii=False).replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
    )
    return _PAGE.replace("__TITLE__", html.escape(data["title"])).replace("__DATA__", payload)


def write_page(
    path: str | Path,
    out: str | Path,
    tokenizer: Tokenizer | None,
    read: Callable[[str | Path], list[dict[str, Any]]] | None = None,
) -> dict[str, Any]:
    """Render the rollouts JSONL at `path` to `out`; returns the page's data (counts for the caller)."""
    records = (read or read_records)(path)
    data = page_data(records, tokenizer, f"ngt inspect: {Path(path).name}")
    Path(out).write_text(render_page(data), encoding="utf-8")
    return data


def read_records(path: str | Path) -> list[dict[str, Any]]:
    """The JSON objects of a JSONL file by the gym's one policy (nemo_gym_tok.common.jsonl): blank lines skipped, a
    torn last line skipped with a warning, any other bad line a JsonlError naming it."""
    return read_jsonl(path)


_PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>__TITLE__</title>
<style>
body { font: 14px/1.45 system-ui, sans-serif; margin: 1.5em; color: #222; }
h1 { font-size: 1.3em; } h2 { font-size: 1.1em; margin: 0 0 .3em; }
#summary { margin: .5em 0 1em; }
#legend { border: 1px solid #ccc; padding: .5em .8em; margin-bottom: 1em; max-width: 70em; }
#legend div { margin: .2em 0; }
table.rollouts { border-collapse: collapse; margin-bottom: 1.5em; }
table.rollouts td, table.rollouts th { border: 1px solid #ccc; padding: .2em .6em; text-align: left; }
.rollout { border-top: 2px solid #888; padding-top: .6em; margin-top: 1.2em; }
.strip { font: 12px/1.9 ui-monospace, monospace; white-space: pre-wrap; word-break: break-all; }
.tok { padding: 1px 0; border-radius: 2px; }
.tok-template { background: #e4e4e4; color: #555; }
.tok-model { background: #bfe8c4; }
.tok-repaired { background: #ffb870; }
.tok-image { background: #c9d7ff; }
.tok-forced { text-decoration: underline dotted #1f4fbf 2px; }
.swatch { display: inline-block; width: 2.2em; margin-right: .5em; text-align: center; }
.repaired { outline: 2px solid #d55e00; }
.repair { display: grid; grid-template-columns: 1fr 1fr; gap: .8em; margin: .5em 0; max-width: 90em; }
.repair pre { background: #f6f6f6; padding: .4em; white-space: pre-wrap; word-break: break-all; margin: 0; }
.ids { font: 11px ui-monospace, monospace; color: #666; word-break: break-all; }
.error { color: #b00; }
.wv { font: 11px system-ui, sans-serif; background: #dde6f7; color: #1f3f7f; border-radius: 3px; padding: 0 .3em;
      margin: 0 .2em; }
.wv-unknown { background: #eee; color: #777; }
.spans-versions { color: #9a4d00; font-weight: bold; }
details.first-prompt summary { font: 13px system-ui, sans-serif; color: #555; cursor: pointer; }
</style></head>
<body>
<h1>__TITLE__</h1>
<noscript>This page draws its rollouts with JavaScript; enable it to see them.</noscript>
<div id="summary"></div>
<div id="legend"></div>
<table class="rollouts"><thead><tr><th>rollout</th><th>reward</th><th>turns (model calls)</th>
<th>repaired turns</th><th>ids</th><th>weight versions</th></tr></thead><tbody id="index"></tbody></table>
<div id="rollouts"></div>
<script type="application/json" id="ngt-data">__DATA__</script>
<script>
"use strict";
const data = JSON.parse(document.getElementById("ngt-data").textContent);
const kindClass = {t: "tok-template", m: "tok-model", r: "tok-repaired", i: "tok-image"};
function el(tag, attrs, text) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
  if (text !== undefined) node.textContent = text;
  return node;
}
function shown(piece) { return piece.replace(/\\n/g, "\\u21b5\\n"); }
function tokenSpan(id, kind, forced) {
  const piece = data.pieces[String(id)] ?? "";
  const cls = "tok " + kindClass[kind] + (forced ? " tok-forced" : "");
  return el("span", {class: cls, title: "id " + id + ": " + JSON.stringify(piece)}, shown(piece));
}
const legend = document.getElementById("legend");
for (const [cls, what] of Object.entries(data.legend)) {
  const row = el("div");
  row.append(el("span", {class: "tok swatch " + cls}, "id"), document.createTextNode(what));
  legend.append(row);
}
let repairedCount = 0;
const index = document.getElementById("index"), container = document.getElementById("rollouts");
data.rollouts.forEach((rollout, n) => {
  const spans = rollout.sequences.reduce((sum, s) => sum + s.repaired.length, 0);
  repairedCount += spans;
  const ids = rollout.sequences.reduce((sum, s) => sum + s.ids.length, 0);
  const row = el("tr");
  const link = el("a", {href: "#rollout-" + n}, rollout.label);
  const first = el("td"); first.append(link);
  const versions = [...new Set(rollout.sequences.flatMap(s => s.weight_versions.map(v => v ?? "unknown")))];
  const versionCell = el("td", {}, versions.join(", "));
  if (rollout.spans_weight_versions) {
    versionCell.append(" ", el("span", {class: "spans-versions"}, "spans weight versions"));
  }
  row.append(first, el("td", {}, String(rollout.reward)), el("td", {}, String(rollout.turns)),
             el("td", {}, String(spans)), el("td", {}, String(ids)), versionCell);
  index.append(row);
  const section = el("section", {class: "rollout", id: "rollout-" + n, "data-turns": rollout.turns,
                                 "data-repaired": spans,
                                 "data-spans-versions": rollout.spans_weight_versions ? "1" : "0"});
  section.append(el("h2", {}, rollout.label + " \\u2014 reward " + rollout.reward + ", " + rollout.turns +
                    " turns, " + spans + " repaired" + (rollout.images ? ", " + rollout.images + " image(s)" : "")));
  if (rollout.spans_weight_versions) {
    section.append(el("p", {class: "spans-versions"}, "spans weight versions: its turns were sampled by " +
                      "different weights (" + versions.join(", ") + ")"));
  }
  if (rollout.error) section.append(el("p", {class: "error"}, rollout.error));
  rollout.sequences.forEach((seq, s) => {
    if (rollout.sequences.length > 1) section.append(el("h3", {}, "token segment " + s));
    const strip = el("div", {class: "strip"});
    const starts = new Map(seq.repaired.map(r => [r.start, r]));
    const turnAt = new Map(seq.turns.map((turn, k) => [turn[0], k]));
    function versionBadge(k) {
      const version = seq.weight_versions[k];
      return el("span", {class: "wv" + (version == null ? " wv-unknown" : ""), "data-turn": k},
                "turn " + k + ": " + (version ?? "weight version unknown"));
    }
    // The first prompt (system prompt, tool list) is long and all template: folded so the turns show first.
    const firstPrompt = seq.turns.length ? seq.turns[0][0] : seq.ids.length;
    const folded = el("details", {class: "first-prompt"});
    folded.append(el("summary", {}, "first prompt: " + firstPrompt + " template ids"));
    let i = 0;
    for (; i < firstPrompt; i++) folded.append(tokenSpan(seq.ids[i], seq.kinds[i], false));
    strip.append(folded);
    while (i < seq.ids.length) {
      if (turnAt.has(i)) strip.append(versionBadge(turnAt.get(i)));
      const repair = starts.get(i);
      if (repair) {  // one .repaired wrapper per repaired span, holding its ids
        const wrap = el("span", {class: "repaired", "data-turn": repair.turn,
                                 title: "turn " + repair.turn + " repaired: " + repair.replaced_tokens +
                                        " template ids replaced by the model's"});
        for (; i < repair.end; i++) {
          wrap.append(tokenSpan(seq.ids[i], seq.kinds[i], seq.forced && seq.forced[i] === "1"));
        }
        strip.append(wrap);
        continue;
      }
      strip.append(tokenSpan(seq.ids[i], seq.kinds[i], seq.forced && seq.forced[i] === "1"));
      i++;
    }
    section.append(strip);
    seq.repaired.forEach(repair => {
      section.append(el("h3", {}, "turn " + repair.turn + ": the template's ids against the model's (telemetry: " +
                        repair.replaced_tokens + " template ids replaced)"));
      const grid = el("div", {class: "repair", "data-turn": repair.turn});
      const sides = [["template", repair.template_text, repair.template_ids],
                     ["model (kept)", repair.model_text, repair.model_ids]];
      for (const [who, text, ids] of sides) {
        const col = el("div");
        col.append(el("strong", {}, who));
        if (ids === null) {
          col.append(el("p", {},
                        "the template's rendering could not be rebuilt from the record; the whole turn is marked"));
        } else {
          col.append(el("pre", {}, text ?? ""), el("div", {class: "ids"}, ids.join(" ")));
        }
        grid.append(col);
      }
      section.append(grid);
    });
  });
  container.append(section);
});
document.getElementById("summary").textContent =
  data.rollouts.length + " rollouts, " + repairedCount + " repaired spans";
document.body.setAttribute("data-rendered", "1");
</script>
</body></html>
"""
