"""``deltarl actor --backend vllm`` on vLLM's real engine: bootstrap through the deltarl engine,
generate with vLLM, commit each published version, end on the trainer's bits."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tests.fixtures.coordinator import ACTOR_TOKEN, RUN, TRAINER_TOKEN, RunningCoordinator
from tests.integration.vllm.conftest import SPEC

pytestmark = [pytest.mark.slow, pytest.mark.torch, pytest.mark.filterwarnings("ignore")]  # vLLM's own warnings


def _train(store: Any, url: str, ckpt: Path, steps: int) -> Any:
    from deltarl.model.build import ModelSpec
    from deltarl.model.tokenizer import TokenizerSpec
    from deltarl.pipeline.publisher import Publisher
    from deltarl.protocol.client import SyncCoordinatorClient
    from deltarl.trainer.config import TrainerConfig
    from deltarl.trainer.loop import ClientCoordinator, TrainerLoop

    cfg = TrainerConfig.tiny(run=RUN, steps=steps, prompts_per_step=2, group_size=2, max_new_tokens=4, torch_threads=1,
                             result_timeout_s=120, model=ModelSpec(name=str(ckpt)),
                             tokenizer=TokenizerSpec(kind="hf", path=str(ckpt)))
    with SyncCoordinatorClient(url, TRAINER_TOKEN) as client, Publisher(store, RUN, keyframe_interval=50,
                                                                        digest_interval=2) as pub:
        loop = TrainerLoop(cfg, coordinator=ClientCoordinator(client, poll_s=5), publisher=pub, store=store)
        loop.run()
    return loop


async def test_vllm_actor_follows_versions_and_ends_on_the_trainers_bits(
    coordinator_service: RunningCoordinator, tmp_path: Path
) -> None:
    from deltarl.actor.config import ActorConfig
    from deltarl.actor.loop import ActorLoop
    from deltarl.codec import state_digest
    from deltarl.integrations.vllm.plugin import request_amx
    from deltarl.model.build import ModelSpec
    from deltarl.testing.vllm_runs import write_checkpoint

    request_amx()
    ckpt = tmp_path / "ckpt"
    write_checkpoint(ckpt, ModelSpec(**SPEC))
    store = coordinator_service.store
    events, state_out = tmp_path / "events.jsonl", tmp_path / "state.json"
    cfg = ActorConfig(coordinator=coordinator_service.url, token=ACTOR_TOKEN, store=str(tmp_path / "store"), run=RUN,
                      events=str(events), state_out=str(state_out), idle_poll_s=0.05, head_poll_s=0.05, backend="vllm",
                      engine_options={"enforce_eager": True, "max_model_len": 128, "gpu_memory_utilization": 0.05,
                                    "max_num_seqs": 8})
    actor = ActorLoop(cfg, name="v1", store=store)
    thread = threading.Thread(target=actor.run, name="actor", daemon=True)
    thread.start()
    try:
        trainer = await asyncio.to_thread(_train, store, coordinator_service.url, ckpt, 2)
        final = trainer.trainer.export_bf16()
        deadline = time.monotonic() + 120
        while (actor.weights is None or actor.weights.held is None or actor.weights.held[0] < 2) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
    finally:
        actor.stop()
        await asyncio.to_thread(thread.join, 120)
    assert not thread.is_alive()
    state = json.loads(state_out.read_text())
    assert state["version"] == 2
    assert state["version_id"] == trainer.version_ids[2]
    assert state["state_digest"] == state_digest(final)  # hashed in vLLM's worker: the trainer's bits
    evs = [json.loads(line) for line in events.read_text().splitlines()]
    assert [e["event"] for e in evs][:2] == ["bootstrap", "registered"]
    assert [c["version"] for c in evs if c["event"] == "commit"] == [1, 2]
    assert any(e["event"] == "result" and e.get("admitted") for e in evs)  # vLLM generated admitted rollouts
    # the weights are fetched in vLLM's workers; their bytes reach the actor's events and metrics
    keyframe = sum(t.numel() * 2 for t in final.values()) // 4  # a keyframe compresses BF16 by well under 4x
    boot = next(e for e in evs if e["event"] == "bootstrap")
    assert sum(boot["fetch"]["bytes_by_source"].values()) > keyframe
    assert sum(actor.weights.fetch_stats()["bytes_by_source"].values()) > keyframe
