"""End to end over a real S3 server (SeaweedFS): coordinator, two chained relays and actors as separate
processes, the GRPO trainer in this process, for several steps, with three faults injected:

* an actor is SIGKILLed while it holds a lease: its prompts are revoked and completed by others;
* a segment is corrupted in a relay's cache: the actor that reads it refetches it from the origin
  and never applies the bad bytes;
* a result with a wrong version id is forged with a valid lease: the coordinator rejects it.

At the end every live actor's weights, and a replay from the store, equal the trainer's export bit
for bit, and the audit of every stored rollout passes.
"""

from __future__ import annotations

import json
import re
import signal
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")

from deltarl.codec import state_digest
from deltarl.coordinator.config import CoordinatorConfig, SchedulerConfig, ServiceConfig
from deltarl.demo.procs import Child, stop_all
from deltarl.errors import AdmissionRejected
from deltarl.pipeline.publisher import Publisher
from deltarl.pipeline.replay import replay
from deltarl.protocol.client import SyncCoordinatorClient
from deltarl.protocol.records import RolloutResult, Sample
from deltarl.trainer.config import TrainerConfig
from deltarl.trainer.loop import ClientCoordinator, TrainerLoop
from tests.fixtures.servers import S3Location

pytestmark = [pytest.mark.slow, pytest.mark.s3, pytest.mark.torch]

RUN = "e2e"
TOKEN = "e2e-token"
STEPS = 5
KILL_STEP = 2  # the slow actor is killed while it holds a lease of this step (or of the first later one it gets)
FORGE_STEP = 3  # a result claiming version 0 (not accepted any more) is forged in this step
JOIN_AFTER = 2  # after this step a relay's cached segment is corrupted and a new actor joins through it


def _events(path: Path) -> list[dict[str, Any]]:
    """An actor's events so far (a line still being written is left for the next read)."""
    return [json.loads(x) for x in path.read_text().split("\n")[:-1]] if path.exists() else []


def _held(path: Path) -> int:
    """The newest version an actor's events say it holds (bootstrap or commit)."""
    return max((e["version"] for e in _events(path) if e["event"] in ("bootstrap", "commit")), default=-1)


class Fleet:
    """The processes of the deployment, all stopped at the end."""

    def __init__(self, work: Path, store_url: str, endpoint: str) -> None:
        self.work, self.store_url = work, store_url
        self.env = {"DELTARL_S3_ENDPOINT": endpoint, "DELTARL_COORDINATOR_TOKEN": TOKEN, "OMP_NUM_THREADS": "1"}
        self.children: list[Child] = []

    def start(self, name: str, *args: str) -> Child:
        child = Child(name, list(args), self.work / f"{name}.log", self.env)
        self.children.append(child)
        return child

    def actor(self, name: str, coordinator: str, relays: list[str], *, throttle: float = 1.0, region: str = "") -> Child:
        args = ["actor", "--coordinator", coordinator, "--store", self.store_url, "--run", RUN, "--name", name,
                "--throttle", str(throttle), "--seed", str(len(self.children)), "--region", region,
                "--events", str(self.work / f"{name}.events.jsonl"), "--state-out", str(self.work / f"{name}.state.json")]
        for r in relays:
            args += ["--relay", r]
        return self.start(name, *args)

    def stop(self) -> None:
        stop_all([c for c in self.children if c.name.startswith("actor")])
        stop_all([c for c in self.children if not c.name.startswith("actor")])


@pytest.fixture
def fleet(tmp_path: Path, seaweed_s3: S3Location) -> Iterator[Fleet]:
    f = Fleet(tmp_path, seaweed_s3.url, seaweed_s3.endpoint_url)
    try:
        yield f
    finally:
        f.stop()


def _wait(cond: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def _corrupt_cached_segment(cache_dir: Path, version: int) -> str:
    """Flip one byte of a relay's cached segment of ``version`` (same size: only sha256 can tell)."""
    prefix = f"{RUN}/versions/{version:012d}/"
    for meta in cache_dir.glob("*.json"):
        key = json.loads(meta.read_text())["key"]
        if key.startswith(prefix) and "seg-" in key[len(prefix):]:  # e<epoch>-seg-r<rank>-<i>.bin
            data = meta.with_suffix(".data")
            raw = bytearray(data.read_bytes())
            raw[len(raw) // 2] ^= 0xFF
            data.write_bytes(bytes(raw))
            return str(key)
    raise AssertionError(f"no cached segment of version {version} in {cache_dir}")


def _kill_in_lease(victim: Child, events: Path, url: str, victim_id: str, done: threading.Event) -> dict[str, Any]:
    """SIGKILL ``victim`` while it provably holds a lease of step ``KILL_STEP`` or later; that lease
    (its event), or nothing if ``done`` is set first. Every lease the actor's log announces (before its generation
    starts) freezes it (SIGSTOP); a second later, so that a report already on its way has been
    admitted even on a loaded box (well inside the 3 s heartbeat timeout), the actor is killed if the coordinator still lists the lease as its own, and resumed
    otherwise (its result got in first) to wait for its next lease. No polling window can miss one."""
    seen: set[str] = set()
    with SyncCoordinatorClient(url, TOKEN) as watcher:
        while not done.is_set():
            for e in _events(events):
                if e["event"] != "lease" or e["step"] < KILL_STEP or e["lease_id"] in seen:
                    continue
                seen.add(e["lease_id"])
                victim.proc.send_signal(signal.SIGSTOP)
                time.sleep(1.0)
                mine = next(a for a in watcher.status()["actors"] if a["actor_id"] == victim_id)
                if e["lease_id"] in mine["leases"]:
                    victim.proc.kill()
                    victim.wait()
                    return e
                victim.proc.send_signal(signal.SIGCONT)
            done.wait(0.01)
    return {}


class FaultyCoordinator(ClientCoordinator):
    """The trainer's coordinator client, forging a result with a stale version right after one step opens."""

    def __init__(self, client: Any, url: str, version_ids: list[str]) -> None:
        super().__init__(client, poll_s=5.0)
        self.url, self.version_ids = url, version_ids
        self.forged: AdmissionRejected | None = None
        self.step_done: dict[int, threading.Event] = {s: threading.Event() for s in range(1, STEPS + 1)}
        self.results: dict[int, list[RolloutResult]] = {}
        self.joined = threading.Event()
        self.victim_registered = threading.Event()

    def open_step(self, spec: Any) -> Any:
        if spec.step == KILL_STEP:  # actor-3 must be registered when this step's leases are handed out
            assert self.victim_registered.wait(120), "actor-3 did not register"
        if spec.step == JOIN_AFTER + 1:  # the late actor joins mid-run: hold the next step until it has
            assert self.joined.wait(120), "the late actor did not register"
        out = super().open_step(spec)
        if spec.step == FORGE_STEP:
            self._forge(spec.step)
        return out

    def _forge(self, step: int) -> None:
        with SyncCoordinatorClient(self.url, TOKEN) as forger:
            me = forger.register(region="nowhere", backend="forged").actor_id
            grant = _wait(lambda: forger.lease(me, 1), 10, "a lease for the forger")
            samples = [Sample(prompt_id=p.prompt_id, prompt_token_ids=p.token_ids or [1], completion_token_ids=[48, 258],
                              completion_text="0", logprobs=[-0.1, -0.1], reward=1.0, finish_reason="stop")
                       for p in grant.prompts for _ in range(p.group_size)]
            stale = self.version_ids[0]  # version 0: a real id of this run, but step 3 accepts only v2 and v1
            assert stale not in grant.accepted_versions
            forged = RolloutResult(step=step, lease_id=grant.lease.lease_id, actor_id=me, version_id=stale,
                                   samples=samples, gen_seconds=0.01, tokens=2 * len(samples))
            try:
                forger.report(forged)
            except AdmissionRejected as err:
                self.forged = err  # the forger then goes silent: its lease is revoked and redone by others

    def wait_results(self, step: int, *, timeout: float) -> list[RolloutResult]:
        results = super().wait_results(step, timeout=timeout)
        self.results[step] = results
        self.step_done[step].set()
        return results


def test_end_to_end_over_seaweedfs_with_faults(fleet: Fleet, seaweed_s3: S3Location, tmp_path: Path, torch_threads: Any) -> None:
    t_start = time.monotonic()
    cfg = CoordinatorConfig(
        scheduler=SchedulerConfig(heartbeat_interval_s=0.5, heartbeat_timeout_s=3.0, lease_margin_s=10.0,
                                  prior_tokens_per_sample=6.0),
        service=ServiceConfig(tick_interval_s=0.1),
    )
    (tmp_path / "coordinator.json").write_text(cfg.model_dump_json())
    coord = fleet.start("coordinator", "coordinator", "--store", seaweed_s3.url, "--run", RUN, "--listen", "127.0.0.1:0",
                        "--config", str(tmp_path / "coordinator.json"), "--token", TOKEN)
    cache_a = tmp_path / "cache-a"
    relay_a = fleet.start("relay-a", "relay", "--upstream", seaweed_s3.url, "--listen", "127.0.0.1:0",
                          "--cache-dir", str(cache_a), "--head-ttl", "0.05")
    url_a = relay_a.wait_for(r" on (http://\S+)").group(1)
    relay_b = fleet.start("relay-b", "relay", "--upstream", url_a, "--listen", "127.0.0.1:0",
                          "--cache-dir", str(tmp_path / "cache-b"), "--head-ttl", "0.05")
    url_b = relay_b.wait_for(r" on (http://\S+)").group(1)
    url = coord.wait_for(r"listening on (http://\S+)").group(1)
    fleet.actor("actor-1", url, [url_a], region="us")
    fleet.actor("actor-2", url, [url_b], region="eu", throttle=1.5)
    # slow, but not so slow that its speed-proportional share of 8 prompts rounds to nothing
    victim = fleet.actor("actor-3", url, [url_b], region="eu", throttle=4.0)

    store = seaweed_s3.open()
    trainer_cfg = TrainerConfig.tiny(store=seaweed_s3.url, run=RUN, steps=STEPS, prompts_per_step=8, group_size=4,
                                     torch_threads=1, result_timeout_s=120)
    box: dict[str, Any] = {}
    with SyncCoordinatorClient(url, TOKEN) as client, Publisher(store, RUN, keyframe_interval=50, digest_interval=2) as pub:
        loop = TrainerLoop(trainer_cfg, coordinator=ClientCoordinator(client), publisher=pub, store=store)
        faulty = FaultyCoordinator(client, url, loop.version_ids)
        loop.coordinator = faulty

        def train() -> None:
            try:
                loop.run()
            except BaseException as err:
                box["error"] = err
                raise

        trainer = threading.Thread(target=train, name="trainer", daemon=True)
        trainer.start()
        with SyncCoordinatorClient(url, TOKEN) as watcher:
            # fault 1 (in the background): kill the slow actor while it holds a lease of step KILL_STEP or later
            victim_id = _wait(lambda: next((e["actor_id"] for e in _events(tmp_path / "actor-3.events.jsonl")
                                            if e["event"] == "registered"), None), 120, "actor-3 to register")
            faulty.victim_registered.set()
            killed: dict[str, Any] = {}
            run_over = threading.Event()
            killer = threading.Thread(name="killer", daemon=True, target=lambda: killed.update(
                _kill_in_lease(victim, tmp_path / "actor-3.events.jsonl", url, victim_id, run_over)))
            killer.start()
            # fault 2: corrupt relay A's cached copy of a segment of version 1, then a new actor joins through relay A
            assert faulty.step_done[JOIN_AFTER].wait(120)
            corrupted = _corrupt_cached_segment(cache_a, 1)
            fleet.actor("actor-4", url, [url_a], region="us")
            _wait(lambda: any(e["event"] == "registered" for e in _events(tmp_path / "actor-4.events.jsonl")), 120,
                  "actor-4 to bootstrap and register")
            faulty.joined.set()
            with urllib.request.urlopen(f"{url_a}/metrics", timeout=10) as resp:
                metrics = resp.read().decode()
            trainer.join(timeout=180)
            run_over.set()
            killer.join(timeout=30)
            assert not trainer.is_alive()
            assert "error" not in box, box.get("error")
            assert killed, f"actor-3 held no lease of step {KILL_STEP} or later to be killed in"
            status = watcher.status()
    export = loop.trainer.export_bf16()
    final = len(loop.version_ids) - 1
    assert final == STEPS

    live = ["actor-1", "actor-2", "actor-4"]
    _wait(lambda: all(_held(tmp_path / f"{n}.events.jsonl") == final for n in live), 60,
          "every live actor to commit the final version")
    for c in fleet.children:
        if c.name in live:
            c.terminate()
    for c in fleet.children:
        if c.name in live:
            assert c.wait(30) == 0, c.output()[-2000:]

    # every live actor holds the trainer's export, bit for bit
    digest = state_digest(export)
    for n in live:
        st = json.loads((tmp_path / f"{n}.state.json").read_text())
        assert (st["version"], st["version_id"], st["state_digest"]) == (final, loop.version_ids[-1], digest), n
    # fault 1: the victim's lease was revoked and its prompts were completed by others
    assert status["counters"].get("leases_revoked", 0) >= 1, status["counters"]
    killed_step = faulty.results[killed["step"]]
    assert killed["lease_id"] not in {r.lease_id for r in killed_step}
    assert sum(len(r.prompt_counts()) for r in killed_step) == trainer_cfg.prompts_per_step
    # fault 2: the corrupted segment was refetched from the next source and never applied
    joiner = _events(tmp_path / "actor-4.events.jsonl")
    boot = next(e for e in joiner if e["event"] == "bootstrap")
    # the bad bytes were caught before use, by the relay or by the actor's fetcher, and only verified
    # bytes were staged (the final weights are checked below). Which one caught them depends on
    # timing: a segment the relay cached before its manifest was committed (an actor's speculative
    # prefetch) is hashed whole before it is served, so the relay evicts it and pulls it again
    # without the actor noticing; one cached after is checked as it streams (response aborted, the
    # actor retries); and bytes the relay passed on unchecked fail the actor's sha256 (refetched
    # from the next source).
    failures = re.search(r"^deltarl_relay_integrity_failures_total (\S+)$", metrics, re.MULTILINE)
    relay_caught = failures is not None and float(failures.group(1)) >= 1
    assert relay_caught or boot["fetch"]["integrity_refetches"] >= 1, (corrupted, boot)
    assert 1 <= boot["version"] <= JOIN_AFTER
    assert any(e["event"] == "result" and e["admitted"] for e in joiner), "the late actor did some work"
    # fault 3: the forged result was rejected for its version id
    assert faulty.forged is not None
    assert faulty.forged.reason == "version_not_accepted"
    assert status["rejections"].get("version_not_accepted", 0) >= 1
    # replay from the store equals the export; the audit of every stored rollout passes
    import torch

    replayed = replay(store, RUN, final)
    assert sorted(replayed) == sorted(export)
    for name, t in export.items():
        assert torch.equal(replayed[name].view(torch.int16), t.view(torch.int16)), name
    from deltarl.coordinator.audit import audit_run

    audit = audit_run(store, RUN)
    assert audit.ok, audit.failures
    assert len(audit.steps) == STEPS
    assert all(s.state == "closed" for s in audit.steps)
    store.close()
    print(f"\ne2e: {STEPS} steps with 3 faults in {time.monotonic() - t_start:.1f}s")
