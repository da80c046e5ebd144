"""Read exported rollout rows with NeMo Gym's own code; runs in .venv-nemo-gym, reads JSON on stdin, prints a report.

Input: `{"rows": [...], "failure_rows": [...]}`. Each row is validated as the `/run` result NeMo Gym's agents return
and its rollout collection writes (`BaseVerifyResponse`: the row's `responses_create_params`, `response` as a
`NeMoGymResponse`, whose bundled items validate as its training items, and `reward`), and must carry the integer
`_ng_task_index` / `_ng_rollout_index` and an `agent_ref` with a name, which its collection keys rows and resumes by.
Then NeMo Gym's `/aggregate_metrics` core (`compute_aggregate_metrics`) scores all rows. Each failures-sidecar row
needs the indices and a `_ng_failure_class`, and `is_terminal_failure` says whether NeMo Gym would retry it.
Prints JSON: `validated`, `total`, `failures` (index, NeMo Gym's error), `aggregate` (its agent metrics),
`sidecar_valid`, `sidecar_total`, `sidecar_terminal`.
"""

import json
import sys

from nemo_gym.base_resources_server import BaseVerifyResponse
from nemo_gym.global_config import AGENT_REF_KEY_NAME, ROLLOUT_INDEX_KEY_NAME, TASK_INDEX_KEY_NAME
from nemo_gym.reward_profile import compute_aggregate_metrics
from nemo_gym.rollout_collection import NG_FAILURE_CLASS_KEY, is_terminal_failure
from pydantic import ValidationError


def _keys_problem(row: dict) -> str | None:
    for key in (TASK_INDEX_KEY_NAME, ROLLOUT_INDEX_KEY_NAME):
        if type(row.get(key)) is not int:
            return f"{key} is {row.get(key)!r}, not an integer"
    ref = row.get(AGENT_REF_KEY_NAME)
    if not isinstance(ref, dict) or not isinstance(ref.get("name"), str):
        return f"{AGENT_REF_KEY_NAME} is {ref!r}, not an object with a name"
    return None


def main() -> None:
    data = json.load(sys.stdin)
    rows, failure_rows = data["rows"], data.get("failure_rows", [])
    failures = []
    for index, row in enumerate(rows):
        try:
            BaseVerifyResponse.model_validate(row)
        except ValidationError as exc:
            failures.append({"index": index, "error": str(exc)[:2000]})
            continue
        problem = _keys_problem(row)
        if problem:
            failures.append({"index": index, "error": problem})
    keys = {(r.get(TASK_INDEX_KEY_NAME), r.get(ROLLOUT_INDEX_KEY_NAME)) for r in rows}
    if len(keys) != len(rows):
        failures.append({"index": None, "error": f"{len(rows)} rows but {len(keys)} distinct (task, rollout) keys"})
    # Scored only when every row validated: NeMo Gym's scoring assumes the rows its collection writes.
    aggregate = compute_aggregate_metrics(rows).model_dump(mode="json") if rows and not failures else None
    sidecar_valid = sum(_keys_problem(r) is None and isinstance(r.get(NG_FAILURE_CLASS_KEY), str) for r in failure_rows)
    json.dump(
        {
            "validated": len(rows) - len({f["index"] for f in failures if f["index"] is not None}),
            "total": len(rows),
            "failures": failures,
            "aggregate": (aggregate or {}).get("agent_metrics"),
            "sidecar_valid": sidecar_valid,
            "sidecar_total": len(failure_rows),
            "sidecar_terminal": sum(is_terminal_failure(r) for r in failure_rows),
        },
        sys.stdout,
    )


if __name__ == "__main__":
    main()
