"""The deltarl engine in vLLM's real engine (CPU build) under faults (issue 33, items 1-8): a failed
init, an update of a version not staged, ``"latest"`` far behind, a replaced run, a relay with a
bad manifest, a missing store, machine-readable refusals, worker memory over many updates."""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integration.vllm.conftest import SPEC, engine, greedy, shut

pytestmark = [pytest.mark.slow, pytest.mark.torch, pytest.mark.filterwarnings("ignore")]  # vLLM's own warnings


class Runs:
    """A local store with runs published on demand (tiny Qwen3, ~1% of elements changed a version)."""

    def __init__(self, root: Path) -> None:
        from deltarl.integrations.vllm.plugin import request_amx
        from deltarl.model.build import ModelSpec
        from deltarl.testing.vllm_runs import write_checkpoint

        request_amx()
        self.root, self.url = root, str(root / "store")
        self.ckpt = root / "ckpt"
        self.base = write_checkpoint(self.ckpt, ModelSpec(**SPEC))
        self.states: dict[str, list[dict[str, Any]]] = {}

    def publish(self, run: str, count: int, *, seed: int = 0, **options: Any) -> list[dict[str, Any]]:
        """``count`` more versions of ``run`` (its first: the checkpoint's state)."""
        from deltarl.pipeline.publisher import Publisher
        from deltarl.storage.open import open_store
        from deltarl.testing.vllm_runs import evolve

        states = self.states.setdefault(run, [])
        store = open_store(self.url)
        try:
            with Publisher(store, run, **options) as pub:
                for _ in range(count):
                    states.append(evolve(states[-1], 0.01, seed=seed + len(states)) if states else self.base)
                    pub.publish(states[-1], len(states) - 1)
        finally:
            store.close()
        return states

    def delete(self, run: str) -> None:
        shutil.rmtree(Path(self.url) / run)
        self.states.pop(run, None)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    return Runs(tmp_path_factory.mktemp("faults"))


@pytest.fixture(scope="module")
def llm(runs: Runs) -> Iterator[Any]:
    llm = engine(runs.ckpt)
    yield llm
    shut(llm)


def _digest(state: dict[str, Any]) -> str:
    from deltarl.codec import state_digest

    return state_digest(state)


def _rpc_update(llm: Any, version: int | str, wait_s: float = 0.0) -> None:
    """One ``start_weight_update`` + ``update_weights``, as any client sends them (no asking again)."""
    llm.collective_rpc("start_weight_update")
    llm.collective_rpc("update_weights", kwargs={"update_info": {"version": version, "wait_s": wait_s}})


def _answer(llm: Any, version: int, wait_s: float = 0.0) -> str | None:
    """The kind ``update_weights`` refuses ``version`` with, or None (taken and committed)."""
    from deltarl.actor.backends.vllm import refusal_kind

    try:
        _rpc_update(llm, version, wait_s)
    except Exception as err:  # vLLM's RuntimeError, carrying the engine's tagged message
        return refusal_kind(err) or f"untagged: {err}"
    llm.collective_rpc("finish_weight_update")
    return None


def test_a_failed_init_leaves_the_served_weights_and_status_as_they_were(runs: Runs, llm: Any) -> None:
    """Issue 33.1 and 33.6: init at a version, then init at one that does not exist, at a store
    that does not exist, and on a run whose HEAD names a missing manifest: each raises with its
    kind, the weights stay bit for bit, the tokens and their logprobs (no NaN in the KV cache) and
    the status are unchanged, and the next update works."""
    from deltarl.actor.backends.vllm import refusal_kind
    from deltarl.integrations.vllm import attach, status, update

    states = runs.publish("a", 3, keyframe_interval=2)
    runs.publish("broken", 3, keyframe_interval=2)
    next((Path(runs.url) / "broken" / "versions").glob("*2/manifest.json")).unlink()  # HEAD names version 2
    attach(llm, runs.url, "a", version=1)
    before, tokens = status(llm, digest=True)[0], greedy(llm)
    assert (before["version"], before["digest"]) == (1, _digest(states[1]))
    for init, kind in (({"store": runs.url, "run": "a", "version": 999}, "ObjectNotFound"),
                       ({"store": str(runs.root / "nowhere"), "run": "a"}, "StoreNotFound"),
                       ({"store": runs.url, "run": "broken"}, "ObjectNotFound")):
        with pytest.raises(Exception, match=r"\[deltarl:\w+\]") as refused:
            llm.collective_rpc("init_weight_transfer_engine", kwargs={"init_info": init})
        assert refusal_kind(refused.value) == kind, str(refused.value)
        after = status(llm, digest=True)[0]
        assert (after["version"], after["version_id"], after["digest"]) == (1, before["version_id"], before["digest"])
        assert greedy(llm) == tokens
    assert update(llm, 2)["version"] == 2  # the old run and store still serve the next update
    assert status(llm, digest=True)[0]["digest"] == _digest(states[2])


def test_an_update_never_holds_generation_for_a_fetch(runs: Runs, llm: Any) -> None:
    """Issue 33.2: ``update_weights`` for a version published but not staged, and for one not
    published (asked to wait 8 s), answers at once (NotStaged / NotPublished) instead of fetching
    or waiting inside vLLM's RPC; a completion right after returns at once; the client that asks
    again gets the version."""
    from deltarl.integrations.vllm import attach, status, update

    runs.publish("b", 3)
    attach(llm, runs.url, "b", version=1, prefetch=False)  # nothing staged in the background
    greedy(llm)
    t0 = time.monotonic()
    answer = _answer(llm, 2)
    assert answer in ("NotStaged", None), answer  # None: staged faster than the call answered, and taken
    assert time.monotonic() - t0 < 6.0  # bounds below the 8 s wait leave slack for a loaded box (make test)
    assert update(llm, 2)["version"] == 2
    t0 = time.monotonic()
    assert _answer(llm, 3, wait_s=8.0) == "NotPublished"
    assert time.monotonic() - t0 < 6.0  # was 8 s: the wait held vLLM's RPC, and generation with it
    t1 = time.monotonic()
    greedy(llm)
    assert time.monotonic() - t1 < 8.0  # ~2 s on an idle box; a held RPC added the 8 s wait
    states = runs.publish("b", 1)
    assert update(llm, 3, wait_s=30)["version"] == 3
    assert status(llm, digest=True)[0]["digest"] == _digest(states[3])


def test_latest_catches_up_from_several_versions_behind(runs: Runs, llm: Any) -> None:
    """Issue 33.3: served 1, HEAD 5 (a keyframe at 4): ``"latest"`` lands on 5, bit for bit."""
    from deltarl.integrations.vllm import attach, status, update

    states = runs.publish("c", 6, keyframe_interval=4)
    attach(llm, runs.url, "c", version=1)
    got = update(llm, "latest")
    assert got["version"] == 5
    assert status(llm, digest=True)[0]["digest"] == _digest(states[5])


def test_a_replaced_run_never_commits_the_old_runs_staged_version(runs: Runs, llm: Any) -> None:
    """Issue 33.4: the engine staged the old run's version 2 in the background; the run is deleted
    and published again under its name (other values): ``"latest"`` commits HEAD's id, the new
    run's state."""
    from deltarl.integrations.vllm import attach, status, update

    runs.publish("d", 2)
    attach(llm, runs.url, "d", version=1)
    runs.publish("d", 1, seed=0)  # the old version 2, staged by the engine in the background
    deadline = time.monotonic() + 240
    while status(llm)[0]["staged"] != 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert status(llm)[0]["staged"] == 2
    runs.delete("d")
    new = runs.publish("d", 3, seed=500)
    got = update(llm, "latest")
    from deltarl.pipeline.reader import RunReader
    from deltarl.storage.open import open_store

    store = open_store(runs.url)
    head = RunReader(store, "d").head()
    store.close()
    assert (got["version"], got["version_id"]) == (2, head.version_id)
    assert status(llm, digest=True)[0]["digest"] == _digest(new[2])


def test_a_relay_serving_a_manifest_that_does_not_verify_falls_back_to_the_origin(
    runs: Runs, llm: Any, tmp_path: Path
) -> None:
    """Issue 33.5: a relay caches a cut manifest (the origin's, later repaired); an engine reading
    through the relay and then the origin takes the origin's manifest."""
    from deltarl.integrations.vllm import attach, status, update
    from deltarl.relay.runner import BackgroundRelay, RelayConfig

    runs.publish("e", 1)
    cfg = RelayConfig(cache_dir=str(tmp_path / "cache"), piece_bytes=256 << 10, poll_interval_s=0.02, head_ttl_s=0.1)
    relay = BackgroundRelay(runs.url, cfg)
    try:
        attach(llm, runs.url, "e", relays=[relay.url], version=0, prefetch=False)
        states = runs.publish("e", 1)  # version 1: its manifest is read first through the relay, below
        manifest = next((Path(runs.url) / "e" / "versions").glob("*1/manifest.json"))
        good = manifest.read_bytes()
        manifest.chmod(0o644)
        manifest.write_bytes(good[: len(good) // 2])  # cut
        import urllib.request

        with urllib.request.urlopen(f"{relay.url}/e/versions/{manifest.parent.name}/manifest.json") as r:
            assert r.read() == good[: len(good) // 2]  # cached at the relay, cut
        manifest.write_bytes(good)  # repaired at the origin; the relay keeps its copy
        assert update(llm, 1)["version"] == 1
        assert status(llm, digest=True)[0]["digest"] == _digest(states[1])
    finally:
        relay.close()


def test_worker_memory_stays_flat_over_many_updates(runs: Runs, llm: Any) -> None:
    """Issue 33.8: 40 updates; the worker's resident memory over the last 30 grows by less than
    2 MiB (bounded caches: 64 manifests, 256 commit records)."""
    from deltarl.integrations.vllm import attach, status, update

    states = runs.publish("f", 41, keyframe_interval=1000)
    attach(llm, runs.url, "f", version=0)
    rss = []
    for v in range(1, 41):
        update(llm, v)
        rss.append(status(llm)[0]["rss_bytes"])
    growth = rss[-1] - rss[9]
    print(f"worker RSS after update 10: {rss[9] / 2**20:.1f} MiB, after 40: {rss[-1] / 2**20:.1f} MiB "
          f"({growth / 30 / 1024:+.1f} KiB an update)")
    assert growth < 2 << 20
    assert status(llm, digest=True)[0]["digest"] == _digest(states[40])
