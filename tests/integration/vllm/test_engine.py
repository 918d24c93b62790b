"""The deltarl weight-transfer engine in vLLM's real engine (CPU build): updates, refusals, bootstrap."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from tests.integration.vllm.conftest import VERSIONS, Run, engine, greedy, publish_corrupt, shut

pytestmark = [pytest.mark.slow, pytest.mark.torch, pytest.mark.filterwarnings("ignore")]  # vLLM's own warnings


def _digest(state: dict[str, Any]) -> str:
    from deltarl.codec import state_digest

    return state_digest(state)


def test_updates_equal_a_fresh_engine_on_replay(vllm_run: Run, served: Any) -> None:
    from deltarl.integrations.vllm import status, update

    assert status(served, digest=True)[0]["digest"] == _digest(vllm_run.states[0])
    prefetched = []
    for v in range(1, VERSIONS + 1):
        got = update(served, v)
        assert got["version"] == v
        assert got["changed"] > 0
        prefetched.append(got["prefetched"])
    assert any(prefetched)  # staged in the background, after the previous commit, before it was asked for
    st = status(served, digest=True)[0]
    assert st["version"] == VERSIONS
    assert st["digest"] == _digest(vllm_run.states[VERSIONS])  # bit for bit the trainer's state
    after = greedy(served)

    fresh = engine(vllm_run.checkpoint_of(VERSIONS))  # vLLM's own loader on replay(N)
    try:
        assert greedy(fresh) == after  # tokens and logprobs, exactly
        # the same engine, late: bootstraps from keyframe 3 plus delta 4 through the relays/store
        from deltarl.integrations.vllm import attach

        boot = attach(fresh, vllm_run.store_url, vllm_run.run)
        assert (boot["version"], boot["version_id"]) == (VERSIONS, st["version_id"])
        assert status(fresh, digest=True)[0]["digest"] == st["digest"]
        assert greedy(fresh) == after
    finally:
        shut(fresh)


def test_refused_versions_leave_the_served_weights_unchanged(vllm_run: Run, served: Any) -> None:
    from deltarl.integrations.vllm import status, update
    from deltarl.testing.vllm_runs import evolve

    before = status(served, digest=True)[0]
    tokens = greedy(served)
    v = before["version"]
    with pytest.raises(Exception, match=r"no object .*manifest"):
        update(served, v + 1)  # missing: not published yet
    with pytest.raises(Exception, match="does not apply to the served version"):
        update(served, v + 2)  # wrong base
    nxt = evolve(vllm_run.states[v], 0.01, seed=100 + v)
    seg = publish_corrupt(vllm_run.store_url, vllm_run.run, nxt, v + 1, keyframe_interval=1000)
    with pytest.raises(Exception, match="no source delivered bytes matching its manifest"):
        update(served, v + 1)
    after = status(served, digest=True)[0]
    assert (after["version"], after["digest"]) == (v, before["digest"])  # bit-identical
    assert greedy(served) == tokens  # and it still serves
    data = bytearray(seg.read_bytes())
    data[len(data) // 2] ^= 0x01  # the bit flipped back
    seg.write_bytes(bytes(data))
    got = update(served, v + 1)  # the intact version still applies
    assert got["version"] == v + 1
    assert status(served, digest=True)[0]["digest"] == _digest(nxt)


def test_a_relay_restart_is_survived(vllm_run: Run, served: Any, tmp_path: Path) -> None:
    """Engine workers reading through a relay only: with the relay down an update is refused and the
    weights stay as they were; once it is back on its address the same update goes through."""
    from deltarl.integrations.vllm import attach, status, update
    from deltarl.pipeline.publisher import Publisher
    from deltarl.pipeline.replay import replay
    from deltarl.relay import RelayConfig
    from deltarl.relay.runner import BackgroundRelay
    from deltarl.storage.open import open_store
    from deltarl.testing.vllm_runs import evolve

    def relay(port: int = 0) -> BackgroundRelay:
        cfg = RelayConfig(cache_dir=str(tmp_path / "relay-cache"), piece_bytes=256 << 10, poll_interval_s=0.02, head_ttl_s=0.1)
        return BackgroundRelay(vllm_run.store_url, cfg, port=port)

    first = relay()
    port = int(first.url.rsplit(":", 1)[1])
    try:
        boot = attach(served, first.url, vllm_run.run)  # the relay is the only source
        v = boot["version"]
    finally:
        first.close()  # before the next version exists: the engine's background staging, which
        # follows HEAD through the relay, must not have it already (it did when published first)
    store = open_store(vllm_run.store_url)
    head = replay(store, vllm_run.run)
    nxt = evolve(head, 0.01, seed=200 + v)
    with Publisher(store, vllm_run.run, keyframe_interval=1000) as pub:
        pub.publish(nxt, v + 1)
    store.close()
    before = status(served, digest=True)[0]
    with pytest.raises(Exception, match=r"127\.0\.0\.1|unreachable|connect|no source"):
        update(served, v + 1)
    assert status(served, digest=True)[0]["digest"] == before["digest"]
    second = relay(port)
    try:
        deadline = time.monotonic() + 120  # a loaded box (make test runs this suite beside the main one)
        while True:  # the fetcher may hold the failed source back for its cooldown
            try:
                got = update(served, v + 1)
                break
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(1.0)
        assert got["version"] == v + 1
        assert status(served, digest=True)[0]["digest"] == _digest(nxt)
    finally:
        second.close()


def test_a_digest_mismatch_at_the_commit_rolls_back(vllm_run: Run, served: Any) -> None:
    """A version whose bytes all verify but whose recorded state digest is not what it builds (its
    writer encoded against a state that was not the base it named): the commit is undone."""
    import torch

    from deltarl.integrations.vllm import attach, status, update
    from deltarl.pipeline.publisher import Publisher
    from deltarl.storage.open import open_store
    from deltarl.testing.vllm_runs import evolve

    store = open_store(vllm_run.store_url)
    s0 = vllm_run.states[0]
    s1 = evolve(s0, 0.01, seed=300)
    with Publisher(store, "forged", digest_interval=1000) as pub:
        pub.publish(s0, 0)
        pub.publish(s1, 1)  # no digest recorded: a resume below can hand in any "previous" state
    wrong = {n: t.clone() for n, t in s1.items()}
    name = sorted(wrong)[0]
    wrong[name].view(-1).view(torch.int16)[:64] += 1  # the writer's idea of version 1, off in 64 elements
    with Publisher(store, "forged", previous_state=wrong, digest_interval=1, digest_on_resume=True) as pub:
        pub.publish(evolve(wrong, 0.01, seed=301), 2)  # version 2 records the digest of what it meant
    store.close()
    boot = attach(served, vllm_run.store_url, "forged", version=1)
    before = status(served, digest=True)[0]
    assert (boot["version"], before["digest"]) == (1, _digest(s1))
    with pytest.raises(Exception, match="rolled back"):
        update(served, 2)
    after = status(served, digest=True)[0]
    assert (after["version"], after["digest"]) == (1, before["digest"])  # bit-identical to version 1
