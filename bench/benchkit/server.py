"""The bench's vLLM server (the tiny model at 32k context, hooked or stock), its settings and progress notes."""

from __future__ import annotations

import contextlib
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # run as `python bench/pN_....py`: the repo's packages (resources_servers, ...) too
    sys.path.insert(0, str(REPO))

from nemo_gym_tok.common.exact_json import loads_exact  # noqa: E402
from nemo_gym_tok.common.net import server_root  # noqa: E402
from nemo_gym_tok.testing.tiny_model.build import build_tiny_model  # noqa: E402
from nemo_gym_tok.vllm.hook import ENABLE_ENV  # noqa: E402
from nemo_gym_tok.vllm.metrics import STAGE_TIMES_ENV  # noqa: E402
from nemo_gym_tok.vllm_server import CPU_SERVING_ARGS, TEST_BED_ENV, VLLMServer  # noqa: E402

MODEL = "tiny-qwen3"

CONTEXT = 32768
"""The bench model's position limit and the server's --max-model-len (and --max-num-batched-tokens, so that a whole
prompt fits one step: no chunked prefill, which the CPU engine cannot do for seeded requests)."""

BENCH_ARGS = (
    *CPU_SERVING_ARGS,
    "--max-model-len",
    str(CONTEXT),
    "--max-num-batched-tokens",
    str(CONTEXT),
    "--no-enable-chunked-prefill",
    "--seed",
    "0",
    # Tool calls for P6's tool-calling episodes, as the test bed serves them (nemo_gym_tok/vllm_server.py): the hermes
    # parser, and constrained JSON without free whitespace, or a random model pads arguments until max_tokens.
    "--enable-auto-tool-choice",
    "--tool-call-parser",
    "hermes",
    "--structured-outputs-config",
    '{"backend": "xgrammar", "disable_any_whitespace": true}',
)
"""Prefix caching stays on (vLLM's default): a repeated prompt is computed once, so repeats time preprocessing."""

PYTHON = ".venv/bin/python"

JSON_HEADERS = {"content-type": "application/json"}


class BenchError(RuntimeError):
    """A request the benchmark needs failed; the message says which and why."""


def bench_model() -> Path:
    """The tiny model with its position limit raised to CONTEXT (its own cached build; the test build is untouched)."""
    return build_tiny_model(max_position_embeddings=CONTEXT)


def text_of_ids(ids: int, piece: str) -> str:
    """`piece` (a template with `{n}`, ending in a space) repeated, numbered, to about `ids` ids in the bench model's
    tokenizer (counted, not guessed: pieces end in a space, so the text's ids are about the sum of the pieces')."""
    if ids <= 0:
        return ""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(bench_model()))
    pieces: list[str] = []
    count = 0
    while count < ids:
        pieces.append(piece.format(n=len(pieces) + 1))
        count += len(tokenizer.encode(pieces[-1], add_special_tokens=False))
    return "".join(pieces)


@contextlib.contextmanager
def vllm_server(url: str | None, *, hook: bool = True, log_dir: Path | None = None) -> Iterator[str]:
    """The base URL of a vLLM serving the bench model as MODEL: `url` if given, else one started here (hooked through
    `ngt vllm-serve`, or stock with the hook switched off) and stopped on exit."""
    if url:
        yield server_root(url)
        return
    model = bench_model()
    kind = "hooked" if hook else "stock"
    log = (log_dir or Path(tempfile.mkdtemp(prefix="ngt-bench-"))) / f"vllm-{kind}.log"
    server = VLLMServer(
        model,
        served_model_name=MODEL,
        extra_args=BENCH_ARGS,
        # The hook's stage timer on (P9 reads it; a few microseconds a request for the other figures).
        env={**TEST_BED_ENV, ENABLE_ENV: "1" if hook else "0", STAGE_TIMES_ENV: "1"},
        hook=hook,
        log_path=log,
    )
    started = time.monotonic()
    note(f"starting {kind} vLLM on {model.name} (--max-model-len {CONTEXT}), log {log} ...")
    server.start()
    note(f"{kind} vLLM up at {server.base_url} after {time.monotonic() - started:.0f} s")
    try:
        yield server.base_url
    finally:
        server.stop()


def note(text: str) -> None:
    """Progress on stderr (tables go to stdout)."""
    print(f"[bench] {text}", file=sys.stderr, flush=True)


def server_version(url: str) -> str:
    try:
        return str(loads_exact(httpx.get(f"{url}/version", timeout=10).content)["version"])
    except (httpx.HTTPError, ValueError, KeyError):
        return "unknown"
