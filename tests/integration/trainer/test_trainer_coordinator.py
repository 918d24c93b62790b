"""The trainer loop against the real coordinator service over HTTP, with a minimal actor thread.

The actor here is a test stand-in (register, lease, stage the accepted version from the store,
generate with the HF backend, report); the trainer side is the real ``TrainerLoop`` with the
coordinator's sync client, a real ``Publisher`` and the store the coordinator persists into.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from deltarl.codec import state_digest  # noqa: E402
from deltarl.pipeline.publisher import Publisher  # noqa: E402
from deltarl.protocol.client import SyncCoordinatorClient  # noqa: E402
from deltarl.protocol.records import RolloutResult, Sample  # noqa: E402
from deltarl.trainer.config import TrainerConfig  # noqa: E402
from deltarl.trainer.loop import ClientCoordinator, TrainerLoop  # noqa: E402
from deltarl.trainer.rescore import rescore_rollouts, version_numbers  # noqa: E402
from tests.fixtures.coordinator import ACTOR_TOKEN, RUN, TRAINER_TOKEN, RunningCoordinator  # noqa: E402
from tests.fixtures.models import LocalRollouts  # noqa: E402

pytestmark = [pytest.mark.torch, pytest.mark.slow]


def _actor(url: str, store: Any, stop: threading.Event, reported: list[RolloutResult], errors: list[BaseException]) -> None:
    try:
        local = LocalRollouts(store, RUN)
        with SyncCoordinatorClient(url, ACTOR_TOKEN) as client:
            actor_id = client.register(region="test", backend="hf").actor_id
            last_beat = time.monotonic()
            while not stop.is_set():
                if time.monotonic() - last_beat > 1.0:
                    client.heartbeat(actor_id)
                    last_beat = time.monotonic()
                grant = client.lease(actor_id)
                if grant is None:
                    time.sleep(0.02)
                    continue
                target = grant.accepted_versions[0]
                local.sync_to(version_numbers(store, RUN)[target])
                g = grant.prompts[0].group_size
                t0 = time.perf_counter()
                gens = local.backend.generate([p.token_ids for p in grant.prompts], max_new_tokens=local.info.max_new_tokens,
                                              temperature=local.info.temperature, n=g)
                samples = [
                    Sample(prompt_id=p.prompt_id, prompt_token_ids=p.token_ids, completion_token_ids=x.completion_token_ids,
                           completion_text=local.tokenizer.decode(x.completion_token_ids), logprobs=x.logprobs,
                           reward=None, finish_reason=x.finish_reason)
                    for k, p in enumerate(grant.prompts)
                    for x in gens[k * g : (k + 1) * g]
                ]
                result = RolloutResult(step=grant.lease.step, lease_id=grant.lease.lease_id, actor_id=actor_id,
                                       version_id=local.version_id, samples=samples,
                                       gen_seconds=time.perf_counter() - t0,
                                       tokens=sum(len(s.completion_token_ids) for s in samples))
                ack = client.report(result)
                assert ack.admitted, ack
                reported.append(result)
    except BaseException as err:  # surfaced by the test
        errors.append(err)


async def test_trainer_loop_over_http(coordinator_service: RunningCoordinator, torch_threads: Any) -> None:
    store = coordinator_service.store
    cfg = TrainerConfig.tiny(run=RUN, steps=4, prompts_per_step=12, group_size=4, result_timeout_s=60)
    stop, reported, errors = threading.Event(), [], []
    actor = threading.Thread(target=_actor, args=(coordinator_service.url, store, stop, reported, errors))
    actor.start()

    def train() -> Any:
        with SyncCoordinatorClient(coordinator_service.url, TRAINER_TOKEN) as client, Publisher(store, RUN) as pub:
            loop = TrainerLoop(cfg, coordinator=ClientCoordinator(client, poll_s=5), publisher=pub, store=store)
            loop.run()
            return loop

    try:
        loop = await asyncio.wait_for(asyncio.to_thread(train), timeout=120)
    finally:
        stop.set()
        await asyncio.to_thread(actor.join, 30)
    assert not errors, errors
    assert [r.version for r in loop.reports] == [1, 2, 3, 4]
    assert all(r.stats.samples == 12 * 4 for r in loop.reports)
    assert sum(len(r.samples) for r in reported) == 4 * 12 * 4
    # every step generated with the version published just before it
    ids = version_numbers(store, RUN)
    assert {r.step - ids[r.version_id] for r in reported} == {1}
    assert all(f.ok for f in rescore_rollouts(store, RUN, reported, 1000))
    from deltarl.pipeline.replay import replay

    assert state_digest(replay(store, RUN, 4)) == state_digest(loop.trainer.export_bf16())
    # the coordinator's stored rollouts pass its audit, and rescoring them from the store passes too
    from deltarl.coordinator.audit import audit_run

    report = audit_run(store, RUN)
    assert report.ok, report.failures
    stored = [rec.result for rec in report.records]
    assert len(stored) == len(reported)
    assert all(f.ok for f in rescore_rollouts(store, RUN, stored, 50))


async def test_trainer_command_over_http(
    coordinator_service: RunningCoordinator, torch_threads: Any, tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    from deltarl.cli import main

    store = coordinator_service.store
    config = tmp_path / "trainer.yaml"
    config.write_text(
        f"store: {store.url}\nrun: {RUN}\nsteps: 2\nprompts_per_step: 6\ngroup_size: 2\n"
        "torch_threads: 1\ngrpo:\n  lr: 0.01\npublish:\n  keyframe_interval: 2\n"
    )
    stop, reported, errors = threading.Event(), [], []
    actor = threading.Thread(target=_actor, args=(coordinator_service.url, store, stop, reported, errors))
    actor.start()
    argv = ["trainer", "--config", str(config), "--coordinator", coordinator_service.url, "--token", TRAINER_TOKEN]
    try:
        rc = await asyncio.wait_for(asyncio.to_thread(main, argv), timeout=120)
    finally:
        stop.set()
        await asyncio.to_thread(actor.join, 30)
    assert not errors, errors
    assert rc == 0
    out = capsys.readouterr().out
    assert "step    1  version    1" in out
    assert "step    2  version    2" in out
    assert sorted(version_numbers(store, RUN).values()) == [0, 1, 2]
