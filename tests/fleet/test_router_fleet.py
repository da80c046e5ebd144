"""Two hooked vLLM replicas behind the real vllm-router that `ngt run` starts: 40 rollouts collected while one replica
is SIGKILLed lose nothing and stay contiguous; `ngt push-weights -c` then pushes a checkpoint to the router's live
workers, takes the dead one out of the router and names it; a replica with another chat template is refused when it
joins and, let in past that check, on its first answer; a good replica started again on that port while a collection
runs is kept out of the router by the FleetKeeper until it serves the pushed weights and version, proven, and then
takes new sessions, not one turn coming from start-up weights; then the soak's short version, its checkpoint kept by a
FleetKeeper, kills a replica (dropped from the router at once, back only resynced and proven, and serving again before
the collection ends), the environment, the agent and the collector once each. `make test-fleet`: one test, so the
replicas start once."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest

from nemo_gym_tok.collect import CollectSummary
from nemo_gym_tok.config import load_config
from nemo_gym_tok.contract.provenance import chat_template_text
from nemo_gym_tok.records.contiguity import check_file
from nemo_gym_tok.router import RouterError, add_worker, list_workers, remove_worker
from nemo_gym_tok.router.fleet import FleetMismatchError, check_fleet, worker_fingerprint
from nemo_gym_tok.servers.launcher import Gym
from nemo_gym_tok.testing.gym_configs import demo_config_behind_router
from nemo_gym_tok.testing.soak import KINDS, MAX_RSS_GROWTH, Replica, Soak
from nemo_gym_tok.testing.soak_weights import KeepWeights
from nemo_gym_tok.vllm_server import CPU_SERVING_ARGS, TEST_BED_ARGS, TEST_BED_ENV, VLLMServer, replica_cpu_env
from nemo_gym_tok.weights import DEV_MODE_ENV, FleetKeeper, FleetWeights, ReplicaError, probe_from_checkpoint
from nemo_gym_tok.weights import Replica as WeightRoutes
from tests.fleet.headerless import converse_without_session_header
from tests.fleet.number_guess import ROWS, collect_number_guess
from tests.servers import hooked_server
from tests.weights_support import perturbed_checkpoint

REPEATS = 5
"""8 rows x 5: 40 rollouts of up to 4 model calls each."""
KILL_AFTER_ROLLOUTS = 6
SHORT_SOAK: dict[str, Any] = {
    "rollouts": 560,
    "concurrency": 32,
    # Seconds from the soak gym's start, once a tenth of the rollouts are in (a kill waits for the one before it, a
    # replica's for its restart). The environment and the agent go first, so the rollouts they fail are in the
    # failures file the next collector run redoes; then the replica, whose restart takes a minute or so while the
    # other replica carries every call, and which must be back, resynced, proven and taking calls before the end;
    # then the collector.
    "schedule": [(5.0, "environment"), (10.0, "agent"), (15.0, "replica"), (20.0, "collector")],
}
assert {kind for _, kind in SHORT_SOAK["schedule"]} == set(KINDS)


def replica(tiny_model_dir: Path, log_dir: Path, name: str, *, port: int = 0, template: Path | None = None) -> Any:
    """A hooked replica like the shared one (a context manager), on `port` when given, with `template` as its
    --chat-template when given."""
    extra = (*CPU_SERVING_ARGS, *TEST_BED_ARGS, *(("--chat-template", str(template)) if template else ()))
    return hooked_server(
        tiny_model_dir,
        served_model_name="tiny-qwen3",
        extra_args=extra,
        # Loopback: the weight routes pushes and the fleet keeper use. Its model worker on a CPU other than the shared
        # server's (replica 0's), or its start-up crawls behind that worker's busy-wait.
        env={**TEST_BED_ENV, DEV_MODE_ENV: "1", **replica_cpu_env(1)},
        log_path=log_dir / f"{name}.log",
        what=f"{name}: ",
        port=port,
    )


def run_collect(gym: Gym, output: Path, repeats: int) -> CollectSummary:
    return collect_number_guess(gym, output, repeats, concurrency=8, timeout=600)


def model_turns(lines: list[str], *, still_writing: bool = False) -> list[list[dict[str, Any]]]:
    """Per rollout record, its model calls' output items (those carrying a bundle). `still_writing`: the collection
    runs, so a last line still being written is skipped rather than failing."""
    rollouts = []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            if still_writing:
                continue
            raise
        output = record["response"]["output"]
        rollouts.append([i for i in output if isinstance(i, dict) and i.get("generation_token_ids") is not None])
    return rollouts


@pytest.fixture
def doomed(tiny_model_dir: Path, tmp_path: Path) -> Iterator[VLLMServer]:
    with replica(tiny_model_dir, tmp_path, "replica-b") as server:
        yield server


def test_a_fleet_behind_the_router_survives_a_killed_replica_and_refuses_a_foreign_one(
    vllm_server: VLLMServer, doomed: VLLMServer, tiny_model_dir: Path, tmp_path: Path
) -> None:
    live, dead = vllm_server.base_url, doomed.base_url
    config_path = demo_config_behind_router(tmp_path, [live, dead])
    model_name = f"policy_model_name={vllm_server.served_model_name}"
    config = load_config([str(config_path)], [model_name, "head_server.port=0"])
    output = tmp_path / "rollouts.jsonl"
    with ExitStack() as stack:
        http = stack.enter_context(httpx.Client(timeout=120))
        gym = stack.enter_context(Gym(config))
        (router,) = gym.routers.values()
        fleet = worker_fingerprint(live, vllm_server.served_model_name, http=http)
        assert fleet is not None

        # 1. 40 rollouts; the second replica SIGKILLed once both served some and a few rollouts are done.
        killed: dict[str, float] = {}
        answered_before = answered_calls(dead)  # the fleet check's probe

        def kill_when_ready() -> None:
            deadline = time.monotonic() + 600
            while time.monotonic() < deadline:
                lines = output.read_text().splitlines() if output.exists() else []
                written = [t["replica"] for turns in model_turns(lines, still_writing=True) for t in turns]
                # Calls the doomed replica answered for rollouts not yet written: conversations part-way through
                # there, whose next calls must go to the live replica.
                mid_episode = answered_calls(dead) - answered_before - written.count(dead)
                if len(lines) >= KILL_AFTER_ROLLOUTS and set(written) == {live, dead} and mid_episode >= 2:
                    assert doomed.process is not None
                    doomed.process.kill()  # API server and engine: a crash, no goodbye
                    killed["at_rollouts"], killed["mid_episode"] = len(lines), mid_episode
                    return
                time.sleep(0.05)

        killer = threading.Thread(target=kill_when_ready)
        killer.start()
        summary = run_collect(gym, output, REPEATS)
        killer.join()
        assert killed, "no moment came where both replicas had served rollouts"
        assert summary.total == 40 and summary.done_now == 40, summary
        assert not summary.failures_path.exists(), summary.failures_path.read_text()
        report = check_file(output)
        assert report.ok and report.contiguous == report.rollouts == 40, report.format()
        rollouts = model_turns(output.read_text().splitlines())
        by_replica = Counter(turn["replica"] for turns in rollouts for turn in turns)
        assert set(by_replica) == {live, dead}, by_replica  # both used, and every turn says which
        moved = sum(1 for turns in rollouts if len({turn["replica"] for turn in turns}) > 1)
        after_kill = sum(1 for turns in rollouts if turns[0]["replica"] == live)
        print(
            f"\nfleet: 40 rollouts, 0 lost, 40 contiguous; killed {dead} after {killed['at_rollouts']} rollouts, "
            f"{killed['mid_episode']:.0f} of its answered calls in rollouts not yet done; turns per replica "
            f"{dict(by_replica)}; {40 - moved} rollouts on one replica throughout, {moved} moved mid-episode; "
            f"{after_kill} began on {live}"
        )
        doomed.process.wait(timeout=60)

        # 1b. A push with the dead replica still listed by the router: taken out of it, the push goes on without it.
        step1 = perturbed_checkpoint(tiny_model_dir, tmp_path / "step1", seed=1)  # unlike the start-up weights
        probe = probe_from_checkpoint(step1)
        head_port = gym.head_url.rsplit(":", 1)[1]
        command = [sys.executable, "-m", "nemo_gym_tok", "push-weights", str(step1), "--version", "fleet-1"]
        command += ["-c", str(config_path), "--set", model_name, "--set", f"head_server.port={head_port}"]
        started = time.monotonic()
        pushed = subprocess.run(command, capture_output=True, text=True, timeout=300)
        assert pushed.returncode == 0, pushed.stdout + pushed.stderr
        assert f"policy_model: pushing to the workers its running router {router.url} lists now" in pushed.stdout
        assert f"taken out of the router, not answering: {dead} (" in pushed.stdout, pushed.stdout
        assert list_workers(router.url) == [live]
        assert WeightRoutes(live, http).weight_version() == "fleet-1"
        print(f"fleet: ngt push-weights -c with {dead} down, {time.monotonic() - started:.1f} s:\n{pushed.stdout}")

        # 2. A replica with another chat template (the same text plus a comment) on the dead one's port.
        template = tmp_path / "other_template.jinja"
        template.write_text((chat_template_text(tiny_model_dir) or "") + "{#- another template -#}\n")
        with replica(tiny_model_dir, tmp_path, "replica-b-foreign", port=doomed.port, template=template) as foreign:
            with pytest.raises(FleetMismatchError, match=f"worker {foreign.base_url} serves the chat template"):
                check_fleet([foreign.base_url], vllm_server.served_model_name, http=http, expected=fleet)
            add_worker(router.url, foreign.base_url)  # past the check: the adapter refuses its first answer
            refusals = ask_until_refused(gym, vllm_server.served_model_name)
            assert f"replica {foreign.base_url} serves the chat template unlike" in refusals
            remove_worker(router.url, foreign.base_url)

        # 3. A good replica started again on that port, a FleetKeeper on the router and a collection running from the
        # moment it answers: out of the router until it serves the pushed weights and version, proven; then new
        # sessions reach it. (Not a collection during its whole start: a replica starting beside a busy one on a
        # machine of 2 CPUs is slow enough as it is.)
        keeper = FleetKeeper(router.url, fleet=FleetWeights("fleet-1", str(step1), probe), log=print).start()
        stack.callback(keeper.stop)
        keeper.add(dead)  # the push took it out of the router
        watch = RouterWatch(router.url, dead, http)
        stack.callback(watch.stop)
        started = time.monotonic()
        starting: dict[str, VLLMServer] = {}
        starter = threading.Thread(
            target=lambda: starting.update(
                server=stack.enter_context(replica(tiny_model_dir, tmp_path, "replica-b-again", port=doomed.port))
            )
        )
        starter.start()
        while not answers_health(dead) and starter.is_alive():
            time.sleep(0.05)
        up = time.monotonic()
        collecting = tmp_path / "while_back.jsonl"
        collector = start_collector(gym, collecting)
        stack.callback(collector.kill)
        starter.join()
        assert "server" in starting, f"the replica did not start: {tmp_path / 'replica-b-again.log'}"
        back = starting["server"]
        readmitted = keeper.wait_for("readmitted", back.base_url, timeout=300)
        on_back = turns_on(collecting, back.base_url)
        deadline = time.monotonic() + 120
        while turns_on(collecting, back.base_url) < on_back + 8 and time.monotonic() < deadline:
            assert collector.poll() is None, "the collection ended before the replica was back"
            time.sleep(0.5)
        collector.kill()
        collector.wait()
        watch.stop()
        lines = complete_lines(collecting)
        versions = Counter(turn.get("weight_version") for turns in model_turns(lines) for turn in turns)
        served = Counter(turn["replica"] for turns in model_turns(lines) for turn in turns)
        assert versions == {"fleet-1": sum(versions.values())}, versions  # not one turn from start-up weights
        assert served[back.base_url] >= 8, served
        assert watch.labels and set(watch.labels) == {"fleet-1"}, watch.labels  # whenever listed, on the fleet's
        assert "proven against the push's probe" in readmitted.detail, readmitted.detail
        assert sorted(list_workers(router.url)) == sorted([live, back.base_url])
        check_fleet([back.base_url], vllm_server.served_model_name, http=http, expected=fleet)
        (tmp_path / "while_back_complete.jsonl").write_text("".join(f"{line}\n" for line in lines))
        assert check_file(tmp_path / "while_back_complete.jsonl").contiguous == len(lines)
        keeper.stop()

        # 3b. A client that sends no session header, through the adapter: its conversations spread over both
        # replicas (the adapter keys each by its opening), each kept on one, every turn exact.
        headerless = converse_without_session_header(
            gym.urls["policy_model"], vllm_server.served_model_name, conversations=16, turns=3
        )
        homes = [{reply["replica"] for reply in replies} for replies in headerless]
        assert all(len(home) == 1 for home in homes), homes
        assert set().union(*homes) == {live, back.base_url}, homes
        for replies in headerless:
            for before, after in zip(replies, replies[1:], strict=False):
                prefix = before["prompt_token_ids"] + before["generation_token_ids"]
                assert after["prompt_token_ids"][: len(prefix)] == prefix
        spread = Counter(home.pop() for home in homes)
        print(f"fleet: 16 conversations without a session header, 3 turns each: per replica {dict(spread)}, exact")
        print(
            f"fleet: {back.base_url} started again, a collection running from its first /health: up in "
            f"{up - started:.0f} s, routed "
            f"{readmitted.at - up:.2f} s after it was up (its resync {readmitted.seconds:.2f} s, {readmitted.detail}); "
            f"{len(lines)} rollouts, bundles per version {dict(versions)}, turns per replica {dict(served)}; the "
            f"router listed it {len(watch.labels)} times, each time on {sorted(set(watch.labels))}"
        )
        gym.stop()

        # 4. The soak's short version on the same two replicas: one kill of each kind during a collection behind a
        # new gym and router (`make soak` runs twenty minutes with random kills). A perturbed checkpoint is pushed
        # first and a FleetKeeper keeps the fleet on it: the restarted replica comes back on its start-up weights.
        killable = Replica(back, owned=True)
        stack.callback(lambda: killable.server.stop())  # a restart replaces the server `back` started
        (tmp_path / "soak").mkdir()
        keep = KeepWeights(step1, "soak-1", probe)
        soak = Soak([Replica(vllm_server, owned=False), killable], tmp_path / "soak", keep=keep, **SHORT_SOAK)
        report = soak.run()
        print(report.format())
        total = sum(report.versions.values())
        assert report.versions == {"soak-1": total}, report.format()  # not one turn from start-up weights
        (restarted,) = report.replicas
        assert restarted["url"] == back.base_url and restarted["drop_seconds"] is not None, report.format()
        assert "proven against the push's probe" in (restarted["readmitted"] or ""), report.format()
        assert sorted(report.routed_at_end) == sorted([live, back.base_url]), report.format()
        assert [kill["kind"] for kill in report.kills] == [kind for _, kind in SHORT_SOAK["schedule"]], report.format()
        assert report.lost == 0 and report.duplicated == 0 and report.output.torn_lines == 0, report.format()
        assert report.output.unasked_segments == 0, report.format()
        assert report.output.contiguous == report.expected == SHORT_SOAK["rollouts"], report.format()
        assert restarted["share_after_readmission"] and report.rejoined, report.format()  # back and serving in time
        assert report.collect_runs >= 2  # the collector's kill, at least, made it resume
        assert report.redone, report.format()  # the rollouts the environment's and the agent's kills failed
        names = {"number_guess", "number_guess_agent", "policy_model", "head", "router:policy_model"}
        assert names <= report.rss_kib.keys() and report.worst_rss_growth < MAX_RSS_GROWTH, report.format()


def start_collector(gym: Gym, output: Path) -> subprocess.Popen[bytes]:
    """`ngt collect` of far more number_guess rollouts than the test waits for (it is killed once it has what it
    needs)."""
    command = [sys.executable, "-m", "nemo_gym_tok", "collect", "--input", str(ROWS), "--output", str(output)]
    command += ["--agent", "number_guess_agent", "--head-url", gym.head_url, "--repeats", "100", "--concurrency", "8"]
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def answers_health(base_url: str) -> bool:
    try:
        return httpx.get(f"{base_url}/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def complete_lines(path: Path) -> list[str]:
    """The rollout lines written whole (a collector killed mid-write leaves its last line torn)."""
    lines = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            json.loads(line)
        except ValueError:
            continue
        lines.append(line)
    return lines


def turns_on(path: Path, replica_url: str) -> int:
    return sum(turn["replica"] == replica_url for turns in model_turns(complete_lines(path)) for turn in turns)


class RouterWatch:
    """Polls the router's worker list every 0.1 s; each time it lists `worker`, reads the worker's weight version."""

    def __init__(self, router_url: str, worker: str, http: httpx.Client) -> None:
        self.labels: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(router_url, worker, http), daemon=True)
        self._thread.start()

    def _run(self, router_url: str, worker: str, http: httpx.Client) -> None:
        while not self._stop.wait(0.1):
            try:
                if worker in list_workers(router_url, http=http):
                    self.labels.append(WeightRoutes(worker, http).weight_version())
            except (RouterError, ReplicaError) as exc:  # listed yet not answering: as wrong as a stale label
                self.labels.append(f"no answer: {exc}")

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()  # idempotent: called again at the test's end


def answered_calls(base_url: str) -> float:
    """How many requests vLLM finished (its /metrics counter `vllm:request_success_total`, every finish reason)."""
    try:
        text = httpx.get(f"{base_url}/metrics", timeout=10).text
    except httpx.HTTPError:
        return 0.0
    counter = "vllm:request_success_total"
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(counter))


def ask_until_refused(gym: Gym, model: str) -> str:
    """Chat calls through the gym's adapter, each its own session, until the router sends one to the foreign replica
    and the adapter refuses its answer; returns the refusal's message."""
    adapter = gym.urls["policy_model"]
    body = {"model": model, "messages": [{"role": "user", "content": "Hi."}], "max_tokens": 2}
    for session in range(64):
        answer = httpx.post(
            f"{adapter}/v1/chat/completions", json=body, headers={"x-session-id": f"probe-{session}"}, timeout=120
        )
        if answer.status_code != 200:
            assert answer.status_code == 502, answer.text
            assert answer.json()["error"]["type"] == "replica_mismatch"
            return str(answer.json()["error"]["message"])
    raise AssertionError("64 sessions and none reached the foreign replica")
