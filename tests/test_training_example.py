"""docs/training.md's batching example, run as written on demo rollouts: shapes, and padding masked everywhere."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import torch

from nemo_gym_tok.contract.constrained import CONSTRAINED_BY_KEY, FORCED_MASK_KEY
from nemo_gym_tok.records.contiguity import bundled_turns
from nemo_gym_tok.records.training import rollout_to_training_sequences

REPO = Path(__file__).resolve().parents[1]
FIXTURE = REPO / "tests" / "fixtures" / "demo_grid_navigation.jsonl"
"""Three `ngt demo` rollouts (690, 640 and 618 ids), written before bundles carried a forced mask."""
MARK = "<!-- docs-example: training-batch -->"


def example_code() -> str:
    text = (REPO / "docs" / "training.md").read_text()
    assert text.count(MARK) == 1, f"docs/training.md should mark exactly one block {MARK}"
    block = re.match(r"\s*```python\n(.*?)\n```", text.split(MARK, 1)[1], re.S)
    assert block is not None, f"no ```python block follows {MARK}"
    return block.group(1)


def run_example(rollouts: Path) -> dict[str, Any]:
    code = example_code()
    assert '"rollouts.jsonl"' in code  # else the example no longer reads the file this test hands it
    namespace: dict[str, Any] = {"__name__": "docs_example"}
    exec(
        compile(code.replace('"rollouts.jsonl"', repr(str(rollouts))), "<docs/training.md example>", "exec"), namespace
    )
    return namespace


def records() -> list[dict[str, Any]]:
    return [json.loads(line) for line in FIXTURE.read_text().splitlines() if line.strip()]


def with_forced_masks(record: dict[str, Any]) -> dict[str, Any]:
    """The record as a current collector writes it: each bundle says it was constrained and which ids were forced."""
    record = copy.deepcopy(record)
    output = record["response"]["output"]
    for turn in bundled_turns(record):
        item = output[turn.item_index]
        item[CONSTRAINED_BY_KEY] = ["tool_choice:required"]
        item[FORCED_MASK_KEY] = [int(log_prob == 0.0) for log_prob in turn.generation_log_probs]
    return record


def check_batch(batch: dict[str, Any], source: list[dict[str, Any]]) -> None:
    sequences = [s for record in source for s in rollout_to_training_sequences(record)]
    lengths = [len(s) for s in sequences]
    assert len(set(lengths)) > 1  # the padding is exercised
    shape = (len(sequences), max(lengths))
    for name in ("input_ids", "attention_mask", "loss_mask", "old_log_probs", "ratio_mask"):
        assert tuple(batch[name].shape) == shape, name
    assert batch["input_ids"].dtype == torch.long
    assert batch["attention_mask"].sum(dim=1).tolist() == lengths
    padding = batch["attention_mask"] == 0
    assert padding.any()
    # Nothing of the padding reaches the loss or the ratio, and no log prob sits there.
    assert not batch["loss_mask"][padding].any()
    assert not batch["ratio_mask"][padding].any()
    assert not batch["old_log_probs"][padding].any()
    for row, sequence in enumerate(sequences):
        n = len(sequence)
        assert batch["input_ids"][row, :n].tolist() == sequence.token_ids
        assert batch["loss_mask"][row, :n].tolist() == sequence.loss_mask
        assert torch.allclose(batch["old_log_probs"][row, :n], torch.tensor(sequence.log_probs))
    assert batch["rewards"].tolist() == [s.reward for s in sequences]


def test_the_batching_example_pads_the_demo_rollouts(tmp_path: Path) -> None:
    source = records()
    rollouts = tmp_path / "rollouts.jsonl"
    rollouts.write_text("".join(json.dumps(r) + "\n" for r in source))
    batch = run_example(rollouts)
    check_batch(batch, source)
    # Records without the field: unknown, so no forced mask and the ratio mask is the loss mask.
    assert batch["forced_mask"] is None
    assert torch.equal(batch["ratio_mask"], batch["loss_mask"])


def test_the_batching_example_keeps_forced_ids_out_of_the_ratio(tmp_path: Path) -> None:
    source = [with_forced_masks(r) for r in records()]
    rollouts = tmp_path / "rollouts.jsonl"
    rollouts.write_text("".join(json.dumps(r) + "\n" for r in source))
    batch = run_example(rollouts)
    check_batch(batch, source)
    forced = batch["forced_mask"]
    assert forced is not None and forced.shape == batch["loss_mask"].shape
    assert forced.sum() > 0  # the demo's tool-call turns have ids their log prob says were certain
    assert not batch["ratio_mask"][forced == 1].any()
    assert torch.equal(batch["ratio_mask"], batch["loss_mask"] * (1 - forced))
    assert not forced[batch["attention_mask"] == 0].any()
