"""The coordinator over S3 (moto over real HTTP): write-once records, recovery, idempotent retries."""

from __future__ import annotations

import pytest

from deltarl.coordinator.persistence import CoordinatorStore, recover
from deltarl.errors import AdmissionRejected
from deltarl.protocol.client import CoordinatorClient
from deltarl.storage.store import ObjectStore
from tests.fixtures.coordinator import (
    ACTOR_TOKEN,
    RUN,
    TRAINER_TOKEN,
    make_result,
    make_spec,
    service_config,
    start_service,
)

pytestmark = pytest.mark.s3


async def test_step_cycle_and_recovery_on_s3(moto_store: ObjectStore) -> None:
    runner, running = await start_service(moto_store, service_config(lease_margin_s=30.0))
    try:
        async with CoordinatorClient(running.url, TRAINER_TOKEN) as trainer, \
                CoordinatorClient(running.url, ACTOR_TOKEN) as actor:
            spec = make_spec(2, 5, group=2)
            await trainer.open_step(2, spec.prompts, spec.accepted_versions)
            a = (await actor.register()).actor_id
            held = (await actor.lease(a, max_prompts=2)).grant
            assert held is not None
            first = await actor.report(make_result(held))
            # Mid-step, a second coordinator built from the same bucket sees the admitted result.
            mid = recover(moto_store, RUN)
            assert len(mid.results[2]) == 1
            assert (await actor.report(make_result(held))).key == first.key
            with pytest.raises(AdmissionRejected):
                await actor.report(make_result(held, version="v9"))
            while (grant := (await actor.lease(a)).grant) is not None:
                await actor.report(make_result(grant))
            assert (await trainer.step_results(2, timeout=10)).complete
    finally:
        await runner.cleanup()
    manifest = CoordinatorStore(moto_store, RUN).manifest(2)
    assert manifest is not None
    assert manifest.samples == 10
    assert recover(moto_store, RUN).scheduler.steps == {}
