"""A short in-process RL run: GRPO on the addition task, every version published and staged by the actor."""

from __future__ import annotations

import time
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from deltarl.codec import state_digest  # noqa: E402
from deltarl.pipeline.publisher import Publisher  # noqa: E402
from deltarl.pipeline.replay import replay  # noqa: E402
from deltarl.storage import MemoryStore  # noqa: E402
from deltarl.trainer.config import TrainerConfig  # noqa: E402
from deltarl.trainer.loop import TrainerLoop  # noqa: E402
from tests.fixtures.models import LocalRollouts  # noqa: E402

pytestmark = [pytest.mark.torch, pytest.mark.slow]


@pytest.mark.parametrize("lag", [0, 1], ids=["on-policy", "one-step-stale"])
def test_reward_rises_within_25_steps(torch_threads: Any, lag: int) -> None:
    store, run = MemoryStore(), "rl"
    cfg = TrainerConfig.tiny(run=run, steps=25, torch_threads=1)
    actor = LocalRollouts(store, run, lag=lag)
    with Publisher(store, run, keyframe_interval=10) as pub:
        loop = TrainerLoop(cfg, coordinator=actor, publisher=pub, store=store)
        t0 = time.perf_counter()
        reports = loop.run()
        elapsed = time.perf_counter() - t0
    rewards = [r.stats.reward_mean for r in reports]
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    print(f"\nreward {first:.3f} -> {last:.3f} in {len(reports)} steps, {elapsed:.1f}s; per step: "
          + " ".join(f"{r:.2f}" for r in rewards))
    changed = [r.publish.stats.changed_fraction for r in reports]
    print("changed fraction per step: " + " ".join(f"{c:.3f}" for c in changed))
    print("ratio mean / clip fraction per step: " + " ".join(f"{r.stats.ratio_mean:.3f}/{r.stats.clip_frac:.3f}" for r in reports))
    assert sum(r.stale_samples for r in reports) == (24 * 32 * 8 if lag else 0)
    assert last > first + 0.2, rewards
    # the actor's live weights, replay and the trainer's export are the same bits
    final = loop.trainer.export_bf16()
    assert [r.version for r in reports] == list(range(1, 26))
    assert state_digest(replay(store, run, 25)) == state_digest(final)
    actor.sync_to(25)
    assert state_digest(actor.backend.state_dict_for_update()) == state_digest(final)
