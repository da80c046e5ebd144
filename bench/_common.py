"""Shared by the bench/ figures: the long-context server, a synthetic episode, timing, stats, /metrics, tables."""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import random
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import date
from pathlib import Path
from typing import Any

import httpx
import orjson

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as `python bench/pN_....py`: the repo's packages (resources_servers, ...) too
    sys.path.insert(0, str(REPO))

from nemo_gym_tok.tiny_model.build import build_tiny_model  # noqa: E402
from nemo_gym_tok.vllm.hook import ENABLE_ENV  # noqa: E402
from nemo_gym_tok.vllm.server import CPU_SERVING_ARGS, VLLMServer  # noqa: E402

MODEL = "tiny-qwen3"
CONTEXT = 32768
"""The bench model's position limit and the server's --max-model-len (and --max-num-batched-tokens, so that a whole
prompt fits one step: no chunked prefill, which the CPU engine cannot do for seeded requests)."""
BENCH_ARGS = (
    *CPU_SERVING_ARGS, "--max-model-len", str(CONTEXT), "--max-num-batched-tokens", str(CONTEXT),
    "--no-enable-chunked-prefill", "--seed", "0",
)
"""Prefix caching stays on (vLLM's default): a repeated prompt is computed once, so repeats time preprocessing."""
PYTHON = ".venv/bin/python"
JSON_HEADERS = {"content-type": "application/json"}
GENERATED_PER_TURN = 232
"""Synthetic model ids per assistant turn: 253 prompt ids a turn with the user message and the template's markup, so
call 128 of an episode holds about 32.3k ids, just inside the 32,768-position limit."""
ANY_ID_SHARE = 0.05
"""Share of a synthetic turn's ids drawn from the whole vocabulary instead of plain words: some turns then drift."""
PREPROCESS_METRIC = "nemo_gym_tok_preprocess_seconds"
"""The hook's server-side timer (a histogram labelled `path`: spliced, template, token_in, new_segment, refused)."""


class BenchError(RuntimeError):
    """A request the benchmark needs failed; the message says which and why."""


# ---------------------------------------------------------------------------------------------------------------------
# The bench server


def bench_model() -> Path:
    """The tiny model with its position limit raised to CONTEXT (its own cached build; the test build is untouched)."""
    return build_tiny_model(max_position_embeddings=CONTEXT)


@contextlib.contextmanager
def vllm_server(url: str | None, *, hook: bool = True, log_dir: Path | None = None) -> Iterator[str]:
    """The base URL of a vLLM serving the bench model as MODEL: `url` if given, else one started here (hooked through
    `ngt vllm-serve`, or stock with the hook switched off) and stopped on exit."""
    if url:
        yield url.rstrip("/").removesuffix("/v1")
        return
    model = bench_model()
    kind = "hooked" if hook else "stock"
    log = (log_dir or Path(tempfile.mkdtemp(prefix="ngt-bench-"))) / f"vllm-{kind}.log"
    server = VLLMServer(model, served_model_name=MODEL, extra_args=BENCH_ARGS, env={ENABLE_ENV: "1" if hook else "0"},
                        hook=hook, log_path=log)
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
        return str(httpx.get(f"{url}/version", timeout=10).json()["version"])
    except (httpx.HTTPError, ValueError, KeyError):
        return "unknown"


# ---------------------------------------------------------------------------------------------------------------------
# A synthetic episode


def user_message(index: int) -> dict[str, Any]:
    return {"role": "user", "content": f"Question {index}: what comes next in the plan?"}


@dataclass
class Call:
    """The k-th model call of an episode (k from 1): the request's messages three ways and the prompt the hook gives."""

    number: int
    bundled: list[dict[str, Any]]
    """History with the bundle of the previous call on the last assistant message only (what the agent sends)."""
    plain: list[dict[str, Any]]
    """The same messages without any bundle: what stock vLLM gets."""
    prompt_ids: list[int]
    """The spliced prompt (hooked `/tokenize` of `bundled`): the ids generation uses, which token-in sends."""

    @property
    def history_ids(self) -> int:
        return len(self.prompt_ids)

    def varied(self, tokenizer: Any, round_: int) -> Call:
        """This call with its last user message ending in " (round N)": a request the server has not seen, as every
        real turn is (the hook keeps renderings it made for earlier requests, splice._memo; repeating one request
        would find its own). The spliced ids get the suffix's ids where the message's text ends."""
        suffix = f" (round {round_})"
        closing = tokenizer.encode("<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
        if self.prompt_ids[-len(closing):] != closing:
            raise BenchError("the bench prompt does not end with the Qwen generation prompt")
        ids = self.prompt_ids[: -len(closing)] + tokenizer.encode(suffix, add_special_tokens=False) + closing
        last = {**self.bundled[-1], "content": self.bundled[-1]["content"] + suffix}
        return Call(self.number, self.bundled[:-1] + [last], self.plain[:-1] + [last], ids)

    def chat(self, variant: str, **fields: Any) -> dict[str, Any]:
        """The chat-completion body of `variant`: hook (bundle), stock (no bundle) or token_in (no bundle, the spliced
        ids in kv_transfer_params: vLLM's own token reuse, no templating)."""
        if variant == "hook":
            return {"model": MODEL, "messages": self.bundled, **fields}
        if variant == "stock":
            return {"model": MODEL, "messages": self.plain, **fields}
        if variant == "token_in":
            return {"model": MODEL, "messages": self.plain, "kv_transfer_params": {"prompt_token_ids": self.prompt_ids},
                    **fields}
        raise ValueError(variant)


def word_ids(tokenizer: Any) -> list[int]:
    """Ids of plain words with a leading space (` plan`, ` River`): model-like text, which re-tokenizes to the same ids
    (random ids of any kind decode to byte soup that re-tokenizes some 4% longer)."""
    tokens = tokenizer.convert_ids_to_tokens(list(range(1000, 150000)))
    return [1000 + i for i, token in enumerate(tokens) if re.fullmatch(r"\u0120[A-Za-z]{2,12}", token or "")]


def build_episode(
    url: str, calls: int, *, generated_per_turn: int = GENERATED_PER_TURN, seed: int = 0, limit: int = CONTEXT - 8,
) -> list[Call]:
    """One episode of up to `calls` model calls, grown as the gym grows it: each call's assistant answer is
    `generated_per_turn` random ids, words but for ANY_ID_SHARE of any kind (decoded to its text; so some turns
    re-tokenize to other ids, as real histories drift) whose bundle (the call's spliced prompt + those ids)
    rides on that message in the next request, and only there. Stops early where a prompt, spliced or stock, would
    pass `limit` ids. Needs the hooked server: each call's prompt is its `/tokenize` with the bundle."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(bench_model())
    vocabulary = word_ids(tokenizer)
    rng = random.Random(seed)
    episode: list[Call] = []
    plain: list[dict[str, Any]] = [user_message(0)]
    bundled = list(plain)
    with httpx.Client(base_url=url, timeout=600) as http:
        for number in range(1, calls + 1):
            if episode:
                previous = episode[-1]
                generation = [rng.choice(vocabulary) if rng.random() >= ANY_ID_SHARE else rng.randrange(1000, 150000)
                              for _ in range(generated_per_turn)]
                text = tokenizer.decode(generation)
                assistant = {"role": "assistant", "content": text}
                bundle = {"prompt_token_ids": previous.prompt_ids, "generation_token_ids": generation,
                          "generation_log_probs": [0.0] * len(generation)}
                bundled = plain + [assistant | bundle, user_message(number - 1)]
                plain = plain + [assistant, user_message(number - 1)]
            prompt = tokenize(http, bundled)
            if len(prompt) >= limit or len(tokenize(http, plain)) >= limit:
                break
            episode.append(Call(number, bundled, plain, prompt))
    return episode


def tokenize(http: httpx.Client, messages: list[dict[str, Any]]) -> list[int]:
    answer = http.post("/tokenize", content=orjson.dumps(
        {"model": MODEL, "messages": messages, "add_generation_prompt": True}), headers=JSON_HEADERS)
    if answer.status_code != 200:
        raise BenchError(f"/tokenize answered HTTP {answer.status_code}: {answer.text[:500]}")
    return list(answer.json()["tokens"])


def calls_for(history_ids: int, generated_per_turn: int = GENERATED_PER_TURN) -> int:
    """Calls an episode needs to reach about `history_ids` (a little over; 128 at most, the 32k episode)."""
    return max(2, min(128, history_ids // (generated_per_turn + 21) + 3))


def nearest_calls(episode: Sequence[Call], targets: Sequence[int]) -> list[Call]:
    """Per target history size (ids), the call of `episode` whose prompt is closest to it."""
    return [min(episode, key=lambda call: abs(call.history_ids - target)) for target in targets]


# ---------------------------------------------------------------------------------------------------------------------
# Timing and statistics


def post_ms(http: httpx.Client, path: str, content: bytes) -> float:
    """Wall milliseconds of one POST of pre-serialized JSON, its answer read whole; BenchError unless 200."""
    started = time.perf_counter()
    answer = http.post(path, content=content, headers=JSON_HEADERS)
    elapsed = (time.perf_counter() - started) * 1000
    if answer.status_code != 200:
        raise BenchError(f"POST {http.base_url}{path} answered HTTP {answer.status_code}: {answer.text[:500]}")
    return elapsed


def interleaved(requests: dict[str, Callable[[], float]], repeats: int, *, warmup: int = 1) -> dict[str, list[float]]:
    """`warmup` untimed rounds, then `repeats` rounds of every request, the order rotated each round, so that drift
    in machine load hits each variant alike. Returns each variant's milliseconds."""
    names = list(requests)
    for _ in range(warmup):
        for name in names:
            requests[name]()
    times: dict[str, list[float]] = {name: [] for name in names}
    for round_ in range(repeats):
        shift = round_ % len(names)
        for name in names[shift:] + names[:shift]:
            times[name].append(requests[name]())
    return times


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile, q in [0, 100]."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def slope(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Theil-Sen slope (the median of the slopes between every two points): a linear fit that a few load spikes on a
    shared machine do not tilt, as they tilt least squares. NaN with fewer than two points."""
    points = [(x, y) for x, y in zip(xs, ys) if y == y]
    slopes = [(y2 - y1) / (x2 - x1) for i, (x1, y1) in enumerate(points) for x2, y2 in points[i + 1:] if x2 != x1]
    return statistics.median(slopes) if slopes else float("nan")


def ratio(a: float, b: float) -> float:
    return a / b if b and b == b and a == a else float("nan")


# ---------------------------------------------------------------------------------------------------------------------
# vLLM's /metrics

_SAMPLE = re.compile(r"^([A-Za-z_:][\w:]*)(?:\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')
Metrics = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(url: str, http: httpx.Client | None = None) -> Metrics:
    """Every sample of the server's Prometheus `/metrics`, keyed by (name, labels)."""
    text = (http.get(f"{url}/metrics") if http else httpx.get(f"{url}/metrics", timeout=30)).text
    samples: Metrics = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match is None or line.startswith("#"):
            continue
        name, labels, value = match.groups()
        try:
            samples[(name, frozenset(_LABEL.findall(labels or "")))] = float(value)
        except ValueError:
            continue
    return samples


def has_preprocess_timer(metrics: Metrics) -> bool:
    return any(name.startswith(PREPROCESS_METRIC) for name, _ in metrics)


def preprocess_delta(before: Metrics, after: Metrics) -> tuple[int, float, list[str]] | None:
    """The hook's timer between two scrapes: (requests timed, seconds spent, the `path` labels that grew). None when
    the server has no such timer (a hook without it, or a stock server)."""
    if not has_preprocess_timer(after):
        return None
    done, spent, paths = 0.0, 0.0, []
    for (name, labels), count in after.items():
        if name != f"{PREPROCESS_METRIC}_count":
            continue
        grew = count - before.get((name, labels), 0.0)
        if grew > 0:
            done += grew
            key = (f"{PREPROCESS_METRIC}_sum", labels)
            spent += after.get(key, 0.0) - before.get(key, 0.0)
            paths.append(dict(labels).get("path", ""))
    return int(round(done)), spent, sorted(paths)


def http_requests(before: Metrics, after: Metrics) -> dict[str, int]:
    """HTTP requests the server answered between two scrapes, per handler (vLLM's own `http_requests_total`; it leaves
    out /metrics, /health and the like)."""
    counts: dict[str, int] = {}
    for (name, labels), value in after.items():
        if name == "http_requests_total":
            handler = dict(labels).get("handler", "?")
            done = int(round(value - before.get((name, labels), 0.0)))
            if done:
                counts[handler] = counts.get(handler, 0) + done
    return counts


# ---------------------------------------------------------------------------------------------------------------------
# A recording proxy (what one hop sends the next, byte for byte)


@dataclass
class Exchange:
    method: str
    path: str
    body: bytes
    status: int
    answer: bytes = b""


@dataclass
class RecordingProxy:
    """Forwards every request verbatim to `target` and records each one (method, path, raw body, status)."""

    target: str
    exchanges: list[Exchange] = field(default_factory=list)
    url: str = ""

    def app(self) -> Any:
        from starlette.applications import Starlette
        from starlette.requests import Request
        from starlette.responses import Response
        from starlette.routing import Route

        client: httpx.AsyncClient | None = None

        async def forward(request: Request) -> Response:
            nonlocal client
            if client is None:
                client = httpx.AsyncClient(base_url=self.target, timeout=600)
            raw = await request.body()
            headers = {k: v for k, v in request.headers.items() if k.lower() in ("content-type", "authorization",
                                                                                    "x-session-id", "accept")}
            upstream = await client.request(request.method, request.url.path, content=raw, headers=headers,
                                            params=request.query_params)
            self.exchanges.append(
                Exchange(request.method, request.url.path, raw, upstream.status_code, upstream.content))
            kept = {k: v for k, v in upstream.headers.items() if k.lower() == "content-type"}
            return Response(upstream.content, status_code=upstream.status_code, headers=kept)

        return Starlette(routes=[Route("/{path:path}", forward, methods=["GET", "POST"])])

    def posts(self, path: str) -> list[Exchange]:
        return [e for e in self.exchanges if e.method == "POST" and e.path == path]


@contextlib.contextmanager
def serve_app(app: Any) -> Iterator[str]:
    """An ASGI app on a free loopback port in a thread of this process (as the tests serve the adapter)."""
    from nemo_gym_tok.servers.inprocess import serve_in_thread

    with serve_in_thread(app) as url:
        yield url


# ---------------------------------------------------------------------------------------------------------------------
# CPU time of processes


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / ticks


# ---------------------------------------------------------------------------------------------------------------------
# Tables and figures


def fmt(value: Any, digits: int = 1) -> str:
    if isinstance(value, float):
        if value != value:
            return "n/a"
        return f"{value:.{digits}f}"
    return str(value)


@dataclass
class Table:
    title: str
    headers: list[str]
    rows: list[list[str]] = field(default_factory=list)

    def add(self, *cells: Any, digits: int = 1) -> None:
        self.rows.append([fmt(cell, digits) for cell in cells])

    def text(self) -> str:
        widths = [max(len(h), *(len(r[i]) for r in self.rows)) if self.rows else len(h)
                  for i, h in enumerate(self.headers)]
        lines = [self.title, "  ".join(h.rjust(w) for h, w in zip(self.headers, widths))]
        lines += ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in self.rows]
        return "\n".join(lines)

    def markdown(self) -> str:
        def escape(cell: str) -> str:
            return cell.replace("|", "\\|")
        lines = [f"**{self.title}**", "", "| " + " | ".join(map(escape, self.headers)) + " |",
                 "| " + " | ".join("---" for _ in self.headers) + " |"]
        lines += ["| " + " | ".join(map(escape, row)) + " |" for row in self.rows]
        return "\n".join(lines)


@dataclass
class Figure:
    """One figure's result: its tables, the command that reproduces it, notes, and raw data (for the plot)."""

    key: str
    title: str
    command: str
    tables: list[Table] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    data: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0

    def text(self) -> str:
        parts = [f"== {self.key}: {self.title}", *(t.text() for t in self.tables), *self.notes,
                 f"command: {self.command}  ({self.seconds:.0f} s)"]
        return "\n\n".join(parts)


def command(script: str, argv: Sequence[str]) -> str:
    """The shell command that runs `script` (bench/NAME.py) with `argv`."""
    return shlex.join([PYTHON, f"bench/{script}", *argv])


def run_standalone(
    make_parser: Callable[[], argparse.ArgumentParser], run: Callable[..., Figure | list[Figure]],
    argv: Sequence[str] | None, *, with_stock: bool = False,
) -> None:
    """A figure's script run on its own: parse its arguments, start (or reuse) the server, print its tables."""
    argv = standalone_argv(argv)
    args = make_parser().parse_args(argv)
    with vllm_server(args.vllm_url) as url:
        figures = run(url, args, argv, stock_url=args.stock_url) if with_stock else run(url, args, argv)
    print("\n\n".join(figure.text() for figure in (figures if isinstance(figures, list) else [figures])))


def standalone_argv(argv: Sequence[str] | None) -> list[str]:
    return list(sys.argv[1:] if argv is None else argv)


def machine_facts(url: str | None = None) -> dict[str, str]:
    cpu = "unknown CPU"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    memory = ""
    with contextlib.suppress(OSError, ValueError, IndexError):
        kib = int(Path("/proc/meminfo").read_text().splitlines()[0].split()[1])
        memory = f"{kib / 1024 / 1024:.0f} GiB"
    return {
        "cpu": f"{os.cpu_count()} cores ({cpu})", "memory": memory, "python": platform.python_version(),
        "vllm": server_version(url) if url else "unknown", "date": date.today().isoformat(),
        "load": " ".join(f"{x:.1f}" for x in os.getloadavg()),
        "placement": cpu_placement(url) if url else "unknown",
    }


def cpu_placement(url: str, window: float = 0.5) -> str:
    """Where vLLM's worker process runs and how busy it stays right after a request, measured: on the CPU build it is
    pinned to its own CPUs and busy-waits on its shared-memory queue for a while after every step, so everything
    else (vLLM's API server and engine core, the bench client, the adapter) shares what is left. Every CPU
    millisecond spent in the API server or the adapter is then paid for in latency, which sets what any hop costs."""
    workers = [pid for pid in _pids() if _comm(pid) == "VLLM::Worker"]
    if len(workers) != 1:
        return f"not measured ({len(workers)} vLLM worker processes on the machine)"
    worker = workers[0]
    body = orjson.dumps({"model": MODEL, "messages": [user_message(0)], "max_tokens": 1})
    try:
        pinned = sorted(os.sched_getaffinity(worker))
        with httpx.Client(timeout=120) as http:
            http.post(f"{url}/v1/chat/completions", content=body, headers=JSON_HEADERS).raise_for_status()
        before, started = process_cpu_seconds(worker), time.monotonic()
        time.sleep(window)
        busy = (process_cpu_seconds(worker) - before) / (time.monotonic() - started)
    except (OSError, httpx.HTTPError) as exc:
        return f"not measured ({type(exc).__name__}: {exc})"
    others = sorted(set(range(os.cpu_count() or 1)) - set(pinned))
    return (f"vLLM's worker process is pinned to CPU {','.join(map(str, pinned))} and kept {busy:.2f} cores busy in "
            f"the {window} s after a 1-token request; its API server, its engine core, the bench client and the "
            f"adapter share CPU {','.join(map(str, others)) or 'none'}")


def _pids() -> list[int]:
    return [int(entry.name) for entry in Path("/proc").iterdir() if entry.name.isdigit()]


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


@contextlib.contextmanager
def gym(instances: dict[str, Any]) -> Iterator[Any]:
    """The servers of a gym config (`instances`: what a config file holds, e.g. {"policy_model":
    {"responses_api_models": {"vllm_model": {...}}}}) started as `ngt run` starts them: one process each, plus the
    head, on free ports. Yields the running `Gym` (its `urls` by instance name, `children` with their processes)."""
    import yaml

    from nemo_gym_tok.config import load_config
    from nemo_gym_tok.servers.launcher import Gym

    with tempfile.TemporaryDirectory(prefix="ngt-bench-") as directory:
        path = Path(directory) / "bench.yaml"
        path.write_text(yaml.safe_dump({"head_server": {"port": 0}, **instances}))
        config = load_config([path])
    with Gym(config) as running:
        yield running


@contextlib.contextmanager
def passthrough(upstream: str) -> Iterator[str]:
    """bench/_passthrough.py in its own process in front of `upstream`: a hop that does nothing but forward."""
    from nemo_gym_tok._net import free_port

    port = free_port("127.0.0.1")
    script = Path(__file__).with_name("_passthrough.py")
    process = subprocess.Popen([sys.executable, str(script), upstream, str(port)])
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                httpx.get(f"{url}/v1/models", timeout=5)
                break
            except httpx.TransportError:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise BenchError("the pass-through process did not start") from None
                time.sleep(0.1)
        yield url
    finally:
        process.terminate()
        process.wait(timeout=30)


def adapter_instance(base_url: str, **fields: Any) -> dict[str, Any]:
    """A vllm_model adapter config (token information on, as the gym's training configs run it)."""
    return {"responses_api_models": {"vllm_model": {
        "base_url": f"{base_url}/v1", "model": MODEL, "return_token_id_information": True, **fields}}}


def counter_delta(before: Metrics, after: Metrics, name: str) -> float:
    """A counter's growth between two scrapes, summed over its label sets."""
    return sum(value - before.get(key, 0.0) for key, value in after.items() if key[0] == name)


def engine_work(before: Metrics, after: Metrics) -> dict[str, float]:
    """What vLLM's engine did between two scrapes: prompt and generated tokens, prefix-cache hit share."""
    queries = counter_delta(before, after, "vllm:prefix_cache_queries_total")
    return {
        "prompt_tokens": counter_delta(before, after, "vllm:prompt_tokens_total"),
        "generation_tokens": counter_delta(before, after, "vllm:generation_tokens_total"),
        "cache_hit": ratio(counter_delta(before, after, "vllm:prefix_cache_hits_total"), queries),
    }
