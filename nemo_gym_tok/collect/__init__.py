"""`ngt collect`'s library: runs every (row, repeat) rollout of a JSONL file against an agent's `/run`, resumably.

The modules: `identity` (what names a rollout), `files` (output, failures file, lock), `resume` (what an output
already holds, and refusing another input's or agent's), `runner` (the loop), `agent_lookup` (finding the agent
through the head server), `collect_errors` (what a collection refuses), `nemo_gym_rows` (records as NeMo Gym's
rollout rows) and `export` (writing them).
"""

from __future__ import annotations

from nemo_gym_tok.collect.agent_lookup import DEFAULT_HEAD_URL, HEAD_URL_ENV, resolve_agent_url
from nemo_gym_tok.collect.collect_errors import CollectError, HeadError, InputError, ResumeError
from nemo_gym_tok.collect.export import ExportSummary, export_nemo_gym, nemo_gym_failures_path_for
from nemo_gym_tok.collect.files import FAILURES_SUFFIX, failures_path_for, read_failures, repair_output, write_failures
from nemo_gym_tok.collect.identity import RolloutId, RolloutKey, read_input, read_rows, row_hash
from nemo_gym_tok.collect.nemo_gym_rows import ExportError, NemoGymExport, nemo_gym_export
from nemo_gym_tok.collect.runner import CollectSummary, collect

__all__ = [
    "DEFAULT_HEAD_URL",
    "FAILURES_SUFFIX",
    "HEAD_URL_ENV",
    "CollectError",
    "CollectSummary",
    "ExportError",
    "ExportSummary",
    "HeadError",
    "InputError",
    "NemoGymExport",
    "ResumeError",
    "RolloutId",
    "RolloutKey",
    "collect",
    "export_nemo_gym",
    "failures_path_for",
    "nemo_gym_export",
    "nemo_gym_failures_path_for",
    "read_failures",
    "read_input",
    "read_rows",
    "repair_output",
    "resolve_agent_url",
    "row_hash",
    "write_failures",
]
