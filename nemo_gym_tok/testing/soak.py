"""The soak: a long collection behind vllm-router while a replica, the environment, the agent or the collector is
SIGKILLed and restarted; counts rollouts lost and written twice, contiguity, every gym process's memory and, with a
pushed checkpoint kept by a FleetKeeper, the weight version of every bundle.

`make soak` runs about 20 minutes (`python -m nemo_gym_tok.testing.soak --help`); `make test-fleet` runs a
three-minute version with one kill of each kind (tests/fleet/test_router_fleet.py, its last step); the report's
counts and the faults they catch are nemo_gym_tok/testing/soak_report.py's.
"""

from __future__ import annotations

import argparse
import io
import json
import random
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any

from nemo_gym_tok.collect import failures_path_for, read_failures
from nemo_gym_tok.common.jsonl import read_jsonl, scan_lines
from nemo_gym_tok.config import load_config
from nemo_gym_tok.servers.launcher import Gym
from nemo_gym_tok.testing.gym_configs import demo_config_behind_router
from nemo_gym_tok.testing.soak_report import MAX_RSS_GROWTH, OutputCounts, SoakReport, calls_per_replica, redo_reason
from nemo_gym_tok.testing.soak_weights import (
    KeepWeights,
    bundle_versions,
    replica_figures,
    start_keeper,
    wait_readmitted,
)
from nemo_gym_tok.testing.tiny_model.build import build_tiny_model
from nemo_gym_tok.vllm_server import CPU_SERVING_ARGS, TEST_BED_ARGS, TEST_BED_ENV, VLLMServer, replica_cpu_env
from nemo_gym_tok.weights import DEV_MODE_ENV, probe_from_checkpoint

KINDS = ("replica", "environment", "agent", "collector")
ENVIRONMENT, AGENT = "number_guess", "number_guess_agent"
ROWS = Path(__file__).resolve().parents[2] / "resources_servers" / ENVIRONMENT / "data" / "example.jsonl"
MODEL_NAME = "tiny-qwen3"
MAX_COLLECT_RUNS = 40


class Replica:
    """One hooked vLLM of the tiny model on a fixed port; `owned` ones can be killed and started again there."""

    def __init__(self, server: VLLMServer, *, owned: bool) -> None:
        self.server, self.owned = server, owned

    @property
    def url(self) -> str:
        return self.server.base_url

    def kill_and_restart(self) -> None:
        assert self.server.process is not None
        self.server.process.kill()  # the API server and its engine: a crash, no goodbye
        old = self.server
        self.server = VLLMServer(
            old.model,
            served_model_name=old.served_model_name,
            extra_args=old.extra_args,
            host=old.host,
            port=old.port,
            env=dict(old.env),
            log_path=old.log_path.with_name(f"{old.log_path.stem}-restarted.log"),
        ).start()


@contextmanager
def owned_replicas(count: int, workdir: Path) -> Iterator[list[Replica]]:
    """`count` hooked replicas of the tiny model, started one after the other, stopped on exit."""
    model = build_tiny_model()
    with ExitStack() as stack:
        replicas = []
        for index in range(count):
            server = VLLMServer(
                model,
                served_model_name=MODEL_NAME,
                extra_args=(*CPU_SERVING_ARGS, *TEST_BED_ARGS),
                # Loopback: the weight routes the push and the keeper use. A worker CPU each, or a restart crawls.
                env={**TEST_BED_ENV, DEV_MODE_ENV: "1", **replica_cpu_env(index)},
                log_path=workdir / f"replica-{index}.log",
            ).start()
            replica = Replica(server, owned=True)
            stack.callback(lambda r=replica: r.server.stop())  # the server it runs at the end: a restart replaces it
            replicas.append(replica)
        yield replicas


class Soak:
    """One soak run: the demo gym behind a router over `replicas`, `rollouts` number_guess rollouts at `concurrency`,
    kills from `schedule` ((seconds, kind) pairs) or, without one, every `kill_every` seconds at random, from the
    moment a tenth of the rollouts are written (the memory readings after warm-up come first). With `keep`, its
    checkpoint is pushed first and a FleetKeeper keeps the replicas on it (they need VLLM_SERVER_DEV_MODE=1)."""

    def __init__(
        self,
        replicas: Sequence[Replica],
        workdir: Path,
        *,
        rollouts: int,
        concurrency: int,
        schedule: Sequence[tuple[float, str]] | None = None,
        kill_every: tuple[float, float] = (60.0, 120.0),
        kinds: Sequence[str] = KINDS,
        seed: int = 0,
        log: Callable[[str], None] = print,
        keep: KeepWeights | None = None,
    ) -> None:
        rows = len(read_jsonl(ROWS))
        if rollouts % rows:
            raise ValueError(f"rollouts must be a multiple of {rows} (the number_guess rows)")
        self.replicas, self.workdir = list(replicas), workdir
        self.repeats, self.expected, self.concurrency = rollouts // rows, rollouts, concurrency
        self.schedule = list(schedule) if schedule is not None else None
        self.kill_every, self.kinds, self.random = kill_every, tuple(kinds), random.Random(seed)
        self.log, self.keep = log, keep
        self.routed_at_end: list[str] = []
        self.collected_at = 0.0
        self.keeper_events: list[Any] = []
        self.output = workdir / "rollouts.jsonl"
        self.kills: list[dict[str, Any]] = []
        self.redone: Counter[str] = Counter()
        self.redone_examples: dict[str, str] = {}
        self.sizes: list[tuple[float, int]] = []
        """(seconds from the start, bytes written then), every half second: where the calls after a time begin (a
        stat, not a read of the growing file)."""
        self._collector: subprocess.Popen[bytes] | None = None
        self._collector_lock = threading.Lock()
        self._done = threading.Event()
        self._warm = threading.Event()
        self._started = 0.0

    def run(self) -> SoakReport:
        self.output.unlink(missing_ok=True)
        config = load_config(
            [str(demo_config_behind_router(self.workdir, [replica.url for replica in self.replicas]))],
            [f"policy_model_name={MODEL_NAME}", "head_server.port=0", "restart.max_restarts=20"],
        )
        self._started = time.monotonic()
        stop_supervising = threading.Event()
        with Gym(config) as gym, ExitStack() as keeping:
            (router,) = gym.routers.values()
            keeper = start_keeper(router.url, self.keep, self.log) if self.keep is not None else None
            if keeper is not None:
                keeping.callback(keeper.stop)
            supervisor = threading.Thread(target=self._supervise, args=(gym, stop_supervising), daemon=True)
            supervisor.start()
            killer = threading.Thread(target=self._kill_loop, args=(gym,), daemon=True)
            killer.start()
            threading.Thread(target=self._note_sizes, daemon=True).start()
            warm_rss: dict[str, int] = {}
            try:
                runs = self._collect_until_complete(gym, warm_rss)
                self.collected_at = self._elapsed()
                self._done.set()
                killer.join()
                end_rss = gym_rss(gym)
                if keeper is not None:  # a killed replica may still be starting: the report says whether it got back
                    self.routed_at_end = wait_readmitted(keeper, router.url, [r.url for r in self.replicas])
                    self.keeper_events = list(keeper.events)
            finally:
                self._done.set()
                # The servers ngt run restarted were started from the supervising thread and die with it
                # (PR_SET_PDEATHSIG follows the thread that forked): it ends only once the readings are taken.
                stop_supervising.set()
                supervisor.join()
        return self._report(runs, warm_rss, end_rss)

    def _supervise(self, gym: Gym, stop: threading.Event) -> None:
        while not stop.is_set():
            fatal = gym.supervise(lambda event: self.log(f"soak: ngt run: {event}"))
            if fatal:
                self.log(f"soak: the gym gave up: {fatal}")
                return
            time.sleep(0.2)

    def _collect_until_complete(self, gym: Gym, warm_rss: dict[str, int]) -> int:
        """Run `ngt collect` (resuming) until it exits 0: every rollout in the output, none failed this run."""
        command = [
            sys.executable,
            "-m",
            "nemo_gym_tok",
            "collect",
            "--input",
            str(ROWS),
            "--output",
            str(self.output),
            "--agent",
            AGENT,
            "--head-url",
            gym.head_url,
            "--repeats",
            str(self.repeats),
            "--concurrency",
            str(self.concurrency),
            "--timeout",
            "600",
        ]
        for run in range(1, MAX_COLLECT_RUNS + 1):
            with self._collector_lock:
                self._collector = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            if run == 1:
                threading.Thread(target=self._sample_warm_rss, args=(gym, warm_rss), daemon=True).start()
            out, _ = self._collector.communicate()
            summary = out.decode(errors="replace").strip().splitlines()[-1:] or ["(no output)"]
            self.log(f"soak: collector run {run} exited {self._collector.returncode}: {summary[0]}")
            if self._collector.returncode == 0:
                return run
            for entry in read_failures(failures_path_for(self.output)).values():  # the next run redoes each
                reason = redo_reason(entry)
                self.redone[reason] += 1
                self.redone_examples.setdefault(reason, str(entry.get("reason", ""))[:300])
            time.sleep(1.0)  # a failed run retries what failed; a killed one resumes
        raise RuntimeError(f"the collection did not complete in {MAX_COLLECT_RUNS} collector runs")

    def _sample_warm_rss(self, gym: Gym, warm_rss: dict[str, int]) -> None:
        """Each gym process's RSS once a tenth of the rollouts are written (imports, pools and caches filled); the
        kills wait for it. A process down for a restart then is read once it is back."""
        while not self._done.is_set() and not self._warm.is_set():
            if self.output.exists() and self.output.read_bytes().count(b"\n") >= max(1, self.expected // 10):
                warm_rss.update(gym_rss(gym))
                self._warm.set()
            else:
                time.sleep(0.5)
        names = {child.name for child in gym.children} | {f"router:{name}" for name in gym.routers}
        while not self._done.is_set() and not names <= warm_rss.keys():
            for name, rss in gym_rss(gym).items():
                warm_rss.setdefault(name, rss)
            time.sleep(0.5)

    def _note_sizes(self) -> None:
        while not self._done.wait(0.5):
            size = self.output.stat().st_size if self.output.exists() else 0
            self.sizes.append((self._elapsed(), size))

    def _kill_loop(self, gym: Gym) -> None:
        plan = iter(self.schedule) if self.schedule is not None else None
        while not self._warm.wait(0.2):  # the memory readings to compare with come first
            if self._done.is_set():
                return
        while not self._done.is_set():
            if plan is not None:
                step = next(plan, None)
                if step is None:
                    return
                at, kind = step
            else:
                at = self._elapsed() + self.random.uniform(*self.kill_every)
                kind = self.random.choice(self.kinds)
            while self._elapsed() < at:
                if self._done.wait(0.2):
                    return
            self._kill(gym, kind)

    def _kill(self, gym: Gym, kind: str) -> None:
        at = self._elapsed()
        if kind == "replica":
            replica = self.random.choice([r for r in self.replicas if r.owned])
            replica.kill_and_restart()
            ready_at = self._elapsed()
            back = "the fleet keeper resyncs it" if self.keep else "the router's health check takes it back"
            note = f"restarted on its port in {ready_at - at:.0f} s; {back}"
            self.kills.append({"at": at, "kind": kind, "target": replica.url, "note": note, "ready_at": ready_at})
            self.log(f"soak: {at:.0f} s: killed {kind} {replica.url}: {note}")
            return
        elif kind == "collector":
            with self._collector_lock:
                collector = self._collector
                if collector is None or collector.poll() is not None:
                    return
                collector.kill()
            target, note = f"pid {collector.pid}", "resumed by the next run"
        else:
            name = ENVIRONMENT if kind == "environment" else AGENT
            child = next(child for child in gym.children if child.name == name)
            child.process.kill()  # the server and its process group; ngt run's supervisor sees the exit
            target, note = f"{name} (pid {child.process.pid})", "restarted by ngt run"
        self.kills.append({"at": at, "kind": kind, "target": target, "note": note})
        self.log(f"soak: {at:.0f} s: killed {kind} {target}: {note}")

    def _elapsed(self) -> float:
        return time.monotonic() - self._started

    def _report(self, runs: int, warm_rss: dict[str, int], end_rss: dict[str, int]) -> SoakReport:
        replicas = (
            replica_figures(self.keeper_events, self.kills, self._started, self.collected_at) if self.keep else []
        )
        written = self.output.read_bytes()
        for figure in replicas:
            figure["share_after_readmission"] = self._share_after(figure, written)
        return SoakReport(
            expected=self.expected,
            output=OutputCounts.read(self.output),
            collect_runs=runs,
            seconds=self._elapsed(),
            redone=dict(self.redone),
            redone_examples=self.redone_examples,
            kills=self.kills,
            rss_kib={name: (warm_rss[name], end_rss[name]) for name in warm_rss if name in end_rss},
            pushed_version=self.keep.version if self.keep else None,
            versions=dict(bundle_versions(self.output)) if self.keep else {},
            replicas=replicas,
            routed_at_end=self.routed_at_end,
        )

    def _share_after(self, figure: dict[str, Any], written: bytes) -> float | None:
        """The share of the model calls written after the replica's readmission that it served (None: it was not
        readmitted while the collection ran, or nothing was written after)."""
        left = figure["collecting_after_readmission"]
        if left is None or left <= 0:
            return None
        readmitted_at = self.collected_at - left
        start = max((size for at, size in self.sizes if at <= readmitted_at), default=0)
        if start and written[start - 1 : start] != b"\n":  # a line being written then: the calls after begin past it
            start = written.find(b"\n", start) + 1 or len(written)
        served = calls_per_replica(scan_lines(io.BytesIO(written[start:])))
        total = sum(served.values())
        return served[figure["url"]] / total if total else None


def gym_rss(gym: Gym) -> dict[str, int]:
    """RSS (KiB) of every process `ngt run` started: its servers and its routers."""
    pids = {child.name: child.process.pid for child in gym.children if child.process.alive}
    pids.update({f"router:{name}": router.pid for name, router in gym.routers.items() if router.pid is not None})
    found = {}
    for name, pid in pids.items():
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        for line in status.splitlines():
            if line.startswith("VmRSS:"):
                found[name] = int(line.split()[1])
    return found


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m nemo_gym_tok.testing.soak",
        description=(
            "Start two hooked vLLM replicas of the tiny model, the demo gym behind vllm-router over them, push the "
            "tiny model to both as version soak-1 and start a FleetKeeper on the router, and collect number_guess "
            "rollouts while a replica, the environment, the agent or the collector is SIGKILLed every --kill-every "
            "seconds (each restarted: a replica on its port, taken back by the keeper once resynced and proven; the "
            "servers by ngt run; the collector by resuming). Prints, and writes as soak-report.txt and .json in "
            "--workdir, rollouts expected / written / lost / duplicated / torn, contiguity, new token segments asked "
            "for and not, rollouts redone by reason, model calls per replica, every gym process's RSS after warm-up "
            "and at the end, the kills, the bundles per weight version and the keeper's figures; exit 1 unless "
            "nothing was lost, doubled or torn, every rollout is contiguous with no segment nobody asked for, no "
            f"process grew {MAX_RSS_GROWTH:.0%} or more, every bundle carries soak-1 and a killed replica came back "
            "and served calls before the collection ended."
        ),
    )
    parser.add_argument(
        "--rollouts",
        type=int,
        default=3200,
        help="rollouts to collect, a multiple of 8 (3200: about 20 minutes on 2 cores)",
    )
    parser.add_argument("--concurrency", type=int, default=32, help="rollouts in flight (32)")
    parser.add_argument(
        "--kill-every", type=float, nargs=2, default=(60.0, 120.0), metavar=("MIN", "MAX"), help="seconds (60 120)"
    )
    parser.add_argument("--seed", type=int, default=0, help="of the kills' timing and targets (0)")
    parser.add_argument("--workdir", type=Path, default=Path(".ngt/soak"), help="logs, rollouts, report (.ngt/soak)")
    parser.add_argument(
        "--no-keep-weights",
        action="store_true",
        help="skip the push of the tiny model as version soak-1 before the collection and the FleetKeeper that keeps "
        "every replica on it (by default every bundle must carry soak-1 and a killed replica be readmitted)",
    )
    args = parser.parse_args(argv)
    args.workdir.mkdir(parents=True, exist_ok=True)
    keep = None
    if not args.no_keep_weights:
        model = build_tiny_model()
        keep = KeepWeights(model, "soak-1", probe_from_checkpoint(model))
    with owned_replicas(2, args.workdir) as replicas:
        soak = Soak(
            replicas,
            args.workdir,
            rollouts=args.rollouts,
            concurrency=args.concurrency,
            kill_every=tuple(args.kill_every),
            seed=args.seed,
            log=lambda line: print(line, flush=True),
            keep=keep,
        )
        report = soak.run()
    print(report.format(), flush=True)
    (args.workdir / "soak-report.json").write_text(json.dumps(asdict(report), indent=2) + "\n")
    (args.workdir / "soak-report.txt").write_text(report.format() + "\n")
    return 0 if report.ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
