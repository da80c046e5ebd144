"""What NeMo Gym reads from a training-token capture directory; runs in .venv-nemo-gym with NeMo Gym's own reader.

Reads `{"dir": D, "results": [{"rollout_id": R, "result": <a /run answer>}]}` on stdin. Per rollout: the records its
file store returns (`TokenCaptureStore.read_entries`), and what its collector's `finalize_rollout_token_capture`
rebuilds from them for the same answer with every token id removed from its output (the case where NeMo Gym must
take the ids from the capture). Prints a JSON list, one object per rollout: `entries` (each record's bundle, parent
decision and response id), `rebuilt` (the bundles on the rebuilt output, in order), `mask_sample`, `error`, `metrics`.
"""

import asyncio
import copy
import json
import sys

from nemo_gym.token_id_capture.delivery import finalize_rollout_token_capture
from nemo_gym.token_id_capture.records import TOKEN_FIELDS
from nemo_gym.token_id_capture.store import TokenCaptureStore

BUNDLE = ("prompt_token_ids", "generation_token_ids", "generation_log_probs")


def bundles(items):
    return [{key: item[key] for key in BUNDLE} for item in items if item.get("generation_token_ids")]


async def main() -> None:
    request = json.load(sys.stdin)
    store = TokenCaptureStore(request["dir"])
    report = []
    for entry in request["results"]:
        rollout_id, result = entry["rollout_id"], copy.deepcopy(entry["result"])
        records = store.read_entries(rollout_id)
        result["response"]["output"] = [
            {key: value for key, value in item.items() if key not in TOKEN_FIELDS}
            for item in result["response"]["output"]
        ]
        build = await finalize_rollout_token_capture(result, store) or {}
        report.append(
            {
                "rollout_id": rollout_id,
                "entries": [
                    {
                        **{key: getattr(record, key) for key in BUNDLE},
                        "parent_resolution": str(record.parent_resolution),
                        "parent_call_id": record.parent_call_id,
                        "model_call_id": record.model_call_id,
                        "response_id": record.response_id,
                    }
                    for record in records
                ],
                "rebuilt": bundles(result["response"]["output"]),
                "mask_sample": build.get("mask_sample"),
                "error": build.get("error"),
                "metrics": build.get("metrics"),
            }
        )
    json.dump(report, sys.stdout)


if __name__ == "__main__":
    asyncio.run(main())
