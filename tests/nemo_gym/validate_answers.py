"""Validate answers with NeMo Gym's own models; runs in .venv-nemo-gym, reads a JSON list on stdin, prints a report.

Each entry is `{"kind": "response" | "chat", "body": {...}}`: a Responses answer is checked with `NeMoGymResponse`,
a chat completion with `NeMoGymChatCompletion` (what NeMo Gym's agents and its vllm_model parse answers with).
Prints a JSON object: `validated` (count), `total`, and `failures` (index, kind, NeMo Gym's error text).
"""

import json
import sys

from nemo_gym.openai_utils import NeMoGymChatCompletion, NeMoGymResponse
from pydantic import ValidationError

MODELS = {"response": NeMoGymResponse, "chat": NeMoGymChatCompletion}


def main() -> None:
    entries = json.load(sys.stdin)
    failures = []
    for index, entry in enumerate(entries):
        try:
            MODELS[entry["kind"]].model_validate(entry["body"])
        except ValidationError as exc:
            failures.append({"index": index, "kind": entry["kind"], "error": str(exc)[:2000]})
    json.dump({"validated": len(entries) - len(failures), "total": len(entries), "failures": failures}, sys.stdout)


if __name__ == "__main__":
    main()
