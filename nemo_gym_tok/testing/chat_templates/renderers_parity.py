"""The `renderers` side of the oracle: its worker process, which renderer may mirror a family, and render parity.

A renderer stands in for a template only where it renders probe conversations to the template's own ids; where it
does not, its bridge and the splice would differ by rendering, not by splicing.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from nemo_gym_tok.common.exact_json import loads_exact
from nemo_gym_tok.splice import HFChatRenderer
from nemo_gym_tok.testing.chat_templates.oracle_episodes import TOOL
from nemo_gym_tok.testing.chat_templates.renderers_rules import common_length

WORKER = Path(__file__).with_name("renderers_worker.py")
VENV = Path(__file__).resolve().parents[3] / ".venv-renderers"
"""`make renderers-venv` builds it; NGT_RENDERERS_PYTHON names another interpreter that has `renderers`."""

# Our family (chat_templates/families.py) -> the renderers that may mirror its templates, tried in order; the first
# with render parity on a template is used for it. Families not listed have no renderer in renderers 0.1.12 (Gemma 2
# and 3, Mistral, Phi, ChatML...). GPT-OSS is left out: renderers encodes it with openai-harmony's real o200k vocabulary
# (downloaded), which the family tokenizer (Qwen BPE + GPT-OSS markers) does not have.
CANDIDATES: dict[str, tuple[str, ...]] = {
    "qwen3": ("qwen3",),
    "qwen3_coder": ("prime-qwen3",),
    "qwen3_5": ("qwen3.5", "qwen3.6", "qwen3.8"),
    "qwen2_5": ("qwen3-vl",),
    "llama3": ("llama-3",),
    "gemma4": ("gemma4",),
    "glm4": ("glm-4.5", "glm-5", "glm-5.1", "glm-5.3"),
    "deepseek_v3": ("deepseek-v3", "deepseek-r1"),
    "kimi": ("kimi-k2", "kimi-k2.5"),
    "nemotron3": ("nemotron-3", "nemotron-3-ultra", "nemotron-3.5"),
    "minimax": ("minimax-m2",),
}
# Markers a renderer looks up when it is built (image and media placeholders) that a template of its family may never
# write, so the family tokenizer lacks them; they are added as special tokens (as the real tokenizers have them).
REQUIRED_TOKENS: dict[str, tuple[str, ...]] = {
    "gemma4": ("<|image>", "<|image|>", "<image|>"),
    "qwen3_5": ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"),
    "qwen2_5": ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"),
    "kimi": ("<|media_begin|>", "<|media_content|>", "<|media_end|>", "<|media_pad|>", "<|endoftext|>"),
    "nemotron3": ("<image>", "<|endoftext|>"),
}
_CALL = {"id": "call_0", "type": "function", "function": {"name": "lookup", "arguments": '{"word": "x"}'}}
# Render-parity probes: what a bridge appends (system, user and tool messages, then the generation prompt). A bridge
# keeps the history's ids, so after history only the text after an anchor is compared (a renderer may render
# history otherwise, as Gemma 4's keeps the empty thought channel): the probe's text after `after`, and the `before`
# characters before it (the tool result's wrapper). Probes without history are compared id for id.
PROBES: tuple[tuple[bool, list[dict[str, Any]], str, int], ...] = (
    (False, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there."}], "", 0),
    (False, [{"role": "user", "content": "Hi there."}], "", 0),
    (False, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi."},
             {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "More, please."}], "Hello.", 0),
    (True, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi."},
            {"role": "assistant", "content": "", "tool_calls": [_CALL]},
            {"role": "tool", "tool_call_id": "call_0", "content": "found: x"}], "found: x", 40),
    # A second tool cycle: DeepSeek V2.5's template opens only a conversation's first tool result with
    # `<｜tool▁outputs▁begin｜>` (its flag is never reset), renderers' DeepSeek V3 every cycle's.
    (True, [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "", "tool_calls": [_CALL]},
            {"role": "tool", "tool_call_id": "call_0", "content": "found: x"},
            {"role": "assistant", "content": "", "tool_calls": [{**_CALL, "id": "call_1"}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "found: y"}], "found: y", 40),
)  # fmt: skip


def worker_python() -> Path:
    """The interpreter that has `renderers`; FileNotFoundError with the command that builds it."""
    named = os.environ.get("NGT_RENDERERS_PYTHON")
    python = Path(named) if named else VENV / "bin" / "python"
    if not python.exists():
        raise FileNotFoundError(f"{python} not found: `make renderers-venv` builds the venv that holds renderers")
    return python


class Worker:
    """The renderers worker process (one per run): one JSON job per line in, one answer per line out."""

    def __init__(self, process: subprocess.Popen[str]) -> None:
        self.process = process

    def job(self, payload: dict[str, Any]) -> dict[str, Any]:
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write(json.dumps(payload) + "\n")
        self.process.stdin.flush()
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"the renderers worker exited (code {self.process.poll()})")
        return loads_exact(line)


@contextmanager
def worker() -> Iterator[Worker]:
    process = subprocess.Popen(
        [str(worker_python()), str(WORKER)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "TOKENIZERS_PARALLELISM": "false", "TRANSFORMERS_VERBOSITY": "error"},
    )
    try:
        yield Worker(process)
    finally:
        if process.stdin:
            process.stdin.close()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def parity_renderer(
    candidates: Sequence[str],
    directory: str,
    work: Worker,
    plain: HFChatRenderer,
    with_tools: HFChatRenderer,
) -> tuple[str, str]:
    """The first candidate that renders the probes to the template's own ids, else "" and why each one does not."""
    probes: list[dict[str, Any]] = []
    expected: list[list[int]] = []
    anchors: list[tuple[str, int]] = []
    for tools, messages, after, before in PROBES:
        renderer = with_tools if tools else plain
        try:
            ids = renderer.encode(renderer.render(messages, add_generation_prompt=True))
        except Exception:  # noqa: BLE001 - a probe the template cannot render (no system role, say) proves nothing
            continue
        probes.append({"messages": messages, "tools": [TOOL] if tools else None})
        expected.append(ids)
        anchors.append((after, before))
    failures = []
    for name in candidates:
        answer = work.job({"tokenizer_dir": directory, "renderer": name, "renders": probes})
        if "error" in answer:
            failures.append(f"{name}: {answer['error']}")
            continue
        bad = [
            _excerpt(plain, want, got, anchor)
            for got, want, anchor in zip(answer["renders"], expected, anchors)
            if not _same(plain, want, got, anchor)
        ]
        if not bad and probes:
            return name, ""
        failures.append(f"{name}: {bad[0] if bad else 'no probe renders'}")
    return "", "; ".join(failures)


def _same(renderer: HFChatRenderer, want: list[int], got: Any, anchor: tuple[str, int]) -> bool:
    after, before = anchor
    if not isinstance(got, list):
        return False
    if not after:
        return got == want
    template, theirs = renderer.decode(want), renderer.decode(got)
    if after not in template or after not in theirs:
        return False
    i, j = template.rindex(after), theirs.rindex(after)
    return template[i:] == theirs[j:] and template[max(0, i - before) : i] == theirs[max(0, j - before) : j]


def _excerpt(renderer: HFChatRenderer, want: list[int], got: Any, anchor: tuple[str, int]) -> str:
    if not isinstance(got, list):
        return f"renders raise {got.get('error')}"
    n = common_length(want, got)
    return (
        f"the template renders {renderer.decode(want[n : n + 12])!r} where renderers renders "
        f"{renderer.decode(got[n : n + 12])!r}"
    )
