"""The actor loop in-process against a real coordinator service and trainer: bootstrap, lease, generate,
report tagged results, commit each published version at the safe point, and end on the trainer's bits."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")

from deltarl.actor.config import ActorConfig
from deltarl.actor.loop import ActorLoop
from deltarl.codec import state_digest
from deltarl.errors import ConfigError
from deltarl.pipeline.publisher import Publisher
from deltarl.protocol.client import SyncCoordinatorClient
from deltarl.storage.store import ObjectStore
from deltarl.trainer.config import TrainerConfig
from deltarl.trainer.loop import ClientCoordinator, TrainerLoop
from tests.fixtures.coordinator import ACTOR_TOKEN, RUN, TRAINER_TOKEN, RunningCoordinator

pytestmark = pytest.mark.torch


def _events(path: Path) -> list[dict[str, Any]]:
    """The complete lines of an event log (a line the actor thread is writing now is left for the next read)."""
    return [json.loads(line) for line in path.read_text().split("\n")[:-1]] if path.exists() else []


def _train(store: ObjectStore, url: str, steps: int) -> TrainerLoop:
    cfg = TrainerConfig.tiny(run=RUN, steps=steps, prompts_per_step=4, group_size=2, max_new_tokens=4, torch_threads=1,
                             result_timeout_s=30)
    with SyncCoordinatorClient(url, TRAINER_TOKEN) as client, Publisher(store, RUN, keyframe_interval=50,
                                                                        digest_interval=2) as pub:
        loop = TrainerLoop(cfg, coordinator=ClientCoordinator(client, poll_s=5), publisher=pub, store=store)
        loop.run()
    return loop


@pytest.mark.parametrize("backend", ["hf"], ids=["hf-in-place"])  # vllm: tests/integration/vllm/test_demo.py (a deltarl actor process with backend vllm)
async def test_actor_follows_versions_and_ends_on_the_trainers_bits(
    coordinator_service: RunningCoordinator, tmp_path: Path, torch_threads: Any, backend: str
) -> None:
    store = coordinator_service.store
    events, state_out = tmp_path / "events.jsonl", tmp_path / "state.json"
    cfg = ActorConfig(coordinator=coordinator_service.url, token=ACTOR_TOKEN, store=str(tmp_path / "store"), run=RUN,
                      events=str(events), state_out=str(state_out), idle_poll_s=0.05, head_poll_s=0.05,
                      backend=backend, metrics_port=0, metrics_host="127.0.0.1")  # type: ignore[arg-type]
    actor = ActorLoop(cfg, name="a1", store=store)
    thread = threading.Thread(target=actor.run, name="actor", daemon=True)
    thread.start()
    try:
        trainer = await asyncio.to_thread(_train, store, coordinator_service.url, 3)
        final = trainer.trainer.export_bf16()
        deadline = time.monotonic() + 60
        while (actor.weights is None or actor.weights.held is None or actor.weights.held[0] < 3) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        actor.request_state()  # what SIGUSR1 does in `deltarl actor`: write the state file, keep running
        while not state_out.exists() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert thread.is_alive()
        assert json.loads(state_out.read_text())["state_digest"] == state_digest(final)
        state_out.unlink()
        scraped = await asyncio.to_thread(_scrape, actor.metrics_server.url)
    finally:
        actor.stop()
        await asyncio.to_thread(thread.join, 180)  # a close waits for a cold codec compile under way
    assert not thread.is_alive()
    state = json.loads(state_out.read_text())
    assert state["version"] == 3
    assert state["version_id"] == trainer.version_ids[3]
    assert state["state_digest"] == state_digest(final)

    evs = _events(events)
    kinds = [e["event"] for e in evs]
    assert kinds[0] == "bootstrap"
    assert kinds[1] == "registered"
    assert kinds[-1] == "exit"
    commits = [e for e in evs if e["event"] == "commit"]
    assert [c["version"] for c in commits] == [1, 2, 3]
    for c in commits:
        assert c["pause_ms"] > 0  # recorded per commit; how short it is is measured by benchmarks.pause, not here
        assert c["publish_to_staged_s"] is not None
        assert 0 <= c["publish_to_staged_s"] < 30
    assert any(c["digest_checked"] for c in commits)  # digest_interval=2: version 2 records one
    results = [e for e in evs if e["event"] == "result"]
    assert results
    assert all(r["admitted"] for r in results)
    assert sorted({r["step"] for r in results}) == [1, 2, 3]
    # every result answers a lease the log announced before its generation started
    leased = {e["lease_id"]: i for i, e in enumerate(evs) if e["event"] == "lease"}
    for i, e in enumerate(evs):
        if e["event"] == "result":
            assert leased[e["lease_id"]] < i
    # step s accepts versions s-1 and s-2 (one-step asynchrony); nothing newer was ever used
    for r in results:
        assert r["step"] - 2 <= r["version"] <= r["step"] - 1

    # what Prometheus scraped from --metrics-port while the actor ran on version 3
    assert scraped[("deltarl_actor_version", ())] == 3
    assert scraped[("deltarl_actor_commits_total", ())] == 3
    assert scraped[("deltarl_actor_publish_to_staged_seconds_count", ())] == 3
    assert scraped[("deltarl_actor_commit_pause_seconds_count", ())] == 3
    assert scraped[("deltarl_actor_results_total", (("outcome", "admitted"),))] >= 1
    fetched = {labels: v for (name, labels), v in scraped.items() if name == "deltarl_actor_fetched_bytes_total"}
    assert fetched
    assert sum(fetched.values()) > 0


def _scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=10) as resp:
        text = resp.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_config_from_a_deployment_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "deploy.yaml"
    path.write_text(
        "trainer: {run: r}\n"
        "actor:\n  run: r\n  store: s3://b/p\n  regions:\n    eu: {relays: ['http://10.0.0.1:1', 'http://10.0.0.2:2']}\n"
    )
    cfg = ActorConfig.load(path, region="eu", throttle=2.5)
    assert cfg.relay_urls() == ["http://10.0.0.1:1", "http://10.0.0.2:2"]
    assert cfg.throttle == 2.5
    assert ActorConfig.load(path, region="eu", relays=["http://x:3"]).relay_urls() == ["http://x:3"]
    assert ActorConfig.load(path, region="us").relay_urls() == []
    monkeypatch.delenv("DELTARL_ACTOR_TOKEN", raising=False)
    monkeypatch.delenv("DELTARL_COORDINATOR_TOKEN", raising=False)
    with pytest.raises(ConfigError, match="token"):
        cfg.resolved_token()
    monkeypatch.setenv("DELTARL_ACTOR_TOKEN", "t")
    assert cfg.resolved_token() == "t"
    with pytest.raises(ConfigError, match="throttle"):
        ActorConfig.load(path, throttle=0.5)
    with pytest.raises(ConfigError, match="relay URL"):
        ActorConfig.load(path, relays=["ftp://x"])


def test_actor_waits_for_an_unreachable_coordinator(local_store: ObjectStore, tmp_path: Path, torch_threads: Any) -> None:
    """Bootstrapped but the coordinator is not up (or restarting): keep retrying, stop cleanly on request."""
    import socket

    cfg = TrainerConfig.tiny(run="r", steps=1, torch_threads=1)
    with Publisher(local_store, "r") as pub:
        TrainerLoop(cfg, coordinator=None, publisher=pub, store=local_store).start()  # type: ignore[arg-type]
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    events = tmp_path / "events.jsonl"
    actor = ActorLoop(ActorConfig(coordinator=f"http://127.0.0.1:{port}", token="t", store="unused", run="r",
                                  events=str(events)), name="a", store=local_store)
    thread = threading.Thread(target=actor.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not any(e["event"] == "bootstrap" for e in _events(events)) and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(1.5)
    assert thread.is_alive()
    assert [e["event"] for e in _events(events)] == ["bootstrap"]
    actor.stop()
    thread.join(timeout=180)
    assert not thread.is_alive()
    assert _events(events)[-1]["event"] == "exit"


async def test_relay_only_actor_needs_no_origin_store(
    coordinator_service: RunningCoordinator, tmp_path: Path, torch_threads: Any, start_relay: Any
) -> None:
    """No store URL at all: model.json, HEAD, manifests, keyframes and segments through the relay."""
    store = coordinator_service.store
    relay = await start_relay(store)
    state_out = tmp_path / "state.json"
    cfg = ActorConfig(coordinator=coordinator_service.url, token=ACTOR_TOKEN, run=RUN, relays=[relay.url],
                      state_out=str(state_out), idle_poll_s=0.05, head_poll_s=0.05)
    assert cfg.store is None
    actor = ActorLoop(cfg, name="relay-only")
    thread = threading.Thread(target=actor.run, name="actor", daemon=True)
    thread.start()
    try:
        trainer = await asyncio.to_thread(_train, store, coordinator_service.url, 2)
        final = trainer.trainer.export_bf16()
        deadline = time.monotonic() + 60
        while (actor.weights is None or actor.weights.held is None or actor.weights.held[0] < 2) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
    finally:
        actor.stop()
        await asyncio.to_thread(thread.join, 180)  # a close waits for a cold codec compile under way
    assert not thread.is_alive()
    assert json.loads(state_out.read_text())["state_digest"] == state_digest(final)
    assert actor.weights is not None
    assert set(actor.weights.fetch_stats()["bytes_by_source"]) == {relay.url}


def test_actor_without_relays_or_store_is_refused() -> None:
    with pytest.raises(ConfigError, match="relay"):
        ActorLoop(ActorConfig(token="t", run="r")).run()
