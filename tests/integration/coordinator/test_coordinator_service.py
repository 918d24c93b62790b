"""The coordinator over HTTP on loopback: auth, the full step cycle, forged results, durability."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest

from deltarl.coordinator.persistence import CoordinatorStore, recover
from deltarl.errors import AdmissionRejected, AuthError, CoordinatorError, UnknownActor
from deltarl.protocol.client import CoordinatorClient
from deltarl.protocol.records import AdmittedRecord, StepManifest, decode
from deltarl.storage.store import ObjectStore
from tests.fixtures.coordinator import (
    ACTOR_TOKEN,
    RUN,
    TRAINER_TOKEN,
    RunningCoordinator,
    make_result,
    make_spec,
    service_config,
    start_service,
)


async def test_unknown_token_gets_401_and_wrong_role_403(coordinator_service: RunningCoordinator) -> None:
    async with aiohttp.ClientSession() as s:
        async with s.get(coordinator_service.url + "/status") as r:
            assert r.status == 401
        async with s.post(coordinator_service.url + "/register", json={"format_version": 1},
                          headers={"Authorization": "Bearer nope"}) as r:
            assert r.status == 401
    async with CoordinatorClient(coordinator_service.url, "forged") as bad:
        with pytest.raises(AuthError):
            await bad.register()
    async with CoordinatorClient(coordinator_service.url, ACTOR_TOKEN) as actor:
        with pytest.raises(AuthError):
            await actor.open_step(0, make_spec(0, 1).prompts, ["v0"])
        assert (await actor.status())["run"] == RUN


async def test_step_cycle_over_http(coordinator_service: RunningCoordinator) -> None:
    url = coordinator_service.url
    async with CoordinatorClient(url, TRAINER_TOKEN) as trainer, CoordinatorClient(url, ACTOR_TOKEN) as actor:
        spec = make_spec(3, 6, versions=("v3", "v2"), group=2)
        opened = await trainer.open_step(3, spec.prompts, spec.accepted_versions)
        assert opened.created
        assert not (await trainer.open_step(3, spec.prompts, spec.accepted_versions)).created  # idempotent
        with pytest.raises(CoordinatorError):
            await trainer.open_step(3, spec.prompts[:2], spec.accepted_versions)
        waiter = asyncio.create_task(trainer.wait_step(3, poll_s=5.0, deadline_s=60.0))
        reg = await actor.register(region="us-east", backend="transformers", capabilities={"gpu": "none"})
        await actor.heartbeat(reg.actor_id)
        admitted = 0
        while admitted < 6:
            resp = await actor.lease(reg.actor_id, max_prompts=4)
            assert resp.grant is not None
            grant = resp.grant
            assert grant.accepted_versions == ["v3", "v2"]
            assert all(p.answer is not None for p in grant.prompts)
            result = make_result(grant, version="v2")
            ack = await actor.report(result)
            assert ack.admitted
            assert not ack.duplicate
            again = await actor.report(result)  # a retry is idempotent
            assert again.duplicate
            assert again.key == ack.key
            admitted += len(grant.prompts)
        done = await waiter
        assert done.complete
        assert sorted(s.prompt_id for r in done.results for s in r.result.samples) == sorted(
            [f"p{i}" for i in range(6)] * 2
        )
        assert done.manifest is not None
        assert done.manifest.prompts == 6
        status = await actor.status()
        assert status["actors"][0]["actor_id"] == reg.actor_id
        assert status["actors"][0]["measured"]
        assert (await actor.lease(reg.actor_id)).grant is None
    # Durable: every admitted record and the manifest are in the store.
    cs = CoordinatorStore(coordinator_service.store, RUN)
    manifest = cs.manifest(3)
    assert isinstance(manifest, StepManifest)
    for key in manifest.result_keys:
        rec = decode(AdmittedRecord, coordinator_service.store.get(key))
        assert rec.admitted_at <= rec.lease.deadline
        assert cs.lease(3, rec.lease.lease_id) == rec.lease


async def test_forged_results_are_rejected_with_reasons(coordinator_service: RunningCoordinator) -> None:
    url = coordinator_service.url
    async with CoordinatorClient(url, TRAINER_TOKEN) as trainer, CoordinatorClient(url, ACTOR_TOKEN) as actor:
        spec = make_spec(0, 2, versions=("v-good",))
        await trainer.open_step(0, spec.prompts, spec.accepted_versions)
        a = (await actor.register()).actor_id
        b = (await actor.register()).actor_id
        grant = (await actor.lease(a)).grant
        assert grant is not None
        with pytest.raises(AdmissionRejected) as err:
            await actor.report(make_result(grant, version="v-forged"))
        assert err.value.reason == "version_not_accepted"
        with pytest.raises(AdmissionRejected) as err:
            await actor.report(make_result(grant, actor_id=b))
        assert err.value.reason == "wrong_actor"
        forged = make_result(grant).model_copy(update={"lease_id": "lease-made-up"})
        with pytest.raises(AdmissionRejected) as err:
            await actor.report(forged)
        assert err.value.reason == "unknown_lease"
        assert (await actor.report(make_result(grant))).admitted
        status = await actor.status()
        assert status["rejections"] == {"version_not_accepted": 1, "wrong_actor": 1, "unknown_lease": 1}
    async with aiohttp.ClientSession() as s, \
            s.get(url + "/metrics", headers={"Authorization": f"Bearer {ACTOR_TOKEN}"}) as r:
        assert r.status == 200
        text = await r.text()
    assert 'deltarl_coordinator_rejections_total{reason="wrong_actor"} 1.0' in text
    assert 'deltarl_coordinator_actors{alive="true"} 2.0' in text
    # Nothing forged reached the store.
    keys = list(coordinator_service.store.list(f"{RUN}/rollouts/step-000000000000/results/"))
    assert len(keys) == 1


async def test_concurrent_duplicate_reports_admit_once(coordinator_service: RunningCoordinator) -> None:
    url = coordinator_service.url
    async with CoordinatorClient(url, TRAINER_TOKEN) as trainer, CoordinatorClient(url, ACTOR_TOKEN) as actor:
        spec = make_spec(1, 3)
        await trainer.open_step(1, spec.prompts, spec.accepted_versions)
        a = (await actor.register()).actor_id
        grant = (await actor.lease(a, max_prompts=2)).grant
        assert grant is not None
        result = make_result(grant)
        acks = await asyncio.gather(*(actor.report(result) for _ in range(8)))
        assert sum(not ack.duplicate for ack in acks) == 1
        assert len({ack.key for ack in acks}) == 1
    rec = recover(coordinator_service.store, RUN)
    assert len(rec.scheduler.steps[1].admitted) == 2
    assert len(rec.results[1]) == 1


async def test_actor_calls_need_the_actors_own_secret(coordinator_service: RunningCoordinator) -> None:
    """The shared token only registers; a secret acts only for its own actor; an unknown secret is
    an unknown actor to the client (it registers again)."""
    url = coordinator_service.url
    async with CoordinatorClient(url, ACTOR_TOKEN) as actor:
        with pytest.raises(AuthError, match="only registers"):
            await actor.heartbeat("actor-never")  # no secret for it: the shared token is refused
        a = await actor.register()
        b = await actor.register()
        assert a.actor_secret != b.actor_secret
        await actor.heartbeat(a.actor_id)
    async with aiohttp.ClientSession() as s:
        for token, who, want in ((a.actor_secret, b.actor_id, 403), (ACTOR_TOKEN, a.actor_id, 403),
                                 (a.actor_secret, a.actor_id, 200), ("made-up-secret", a.actor_id, 401)):
            async with s.post(url + "/heartbeat", json={"format_version": 1, "actor_id": who},
                              headers={"Authorization": f"Bearer {token}"}) as r:
                assert r.status == want, (token, who, await r.text())
        async with s.post(url + "/register", json={"format_version": 1},
                          headers={"Authorization": f"Bearer {a.actor_secret}"}) as r:
            assert r.status == 403  # a secret does not register new actors
    stored = coordinator_service.store.get(f"{RUN}/coordinator/actors/{a.actor_id}.json")
    assert a.actor_secret.encode() not in stored  # only its sha256 is kept
    async with CoordinatorClient(url, ACTOR_TOKEN) as other:
        other.set_actor_secret(a.actor_id, "forgotten-by-the-coordinator")
        with pytest.raises(UnknownActor):
            await other.heartbeat(a.actor_id)


async def test_long_poll_partial_death_and_closed_steps_from_store(coordinator_store: ObjectStore) -> None:
    # a heartbeats every 0.1 s: a 1 s timeout keeps it alive on a loaded box, where 0.3 s did not always
    cfg = service_config(heartbeat_timeout_s=1.0, lease_margin_s=5.0)
    cfg = cfg.model_copy(update={"service": cfg.service.model_copy(update={"keep_closed_steps": 0})})
    runner, running = await start_service(coordinator_store, cfg)
    try:
        async with CoordinatorClient(running.url, TRAINER_TOKEN) as trainer, \
                CoordinatorClient(running.url, ACTOR_TOKEN) as actor:
            spec = make_spec(0, 4)
            await trainer.open_step(0, spec.prompts, spec.accepted_versions)
            a = (await actor.register(region="a")).actor_id
            b = (await actor.register(region="b")).actor_id
            first = (await actor.lease(a, max_prompts=1)).grant
            assert first is not None
            await actor.report(make_result(first))
            held = (await actor.lease(b, max_prompts=1)).grant
            assert held is not None
            partial = await trainer.step_results(0, timeout=0.2)  # long-poll times out: partial
            assert not partial.complete
            assert len(partial.results) == 1
            deadline = time.monotonic() + 30
            while True:  # b falls silent: declared dead, its lease revoked; a heartbeats on
                await actor.heartbeat(a)
                fleet = {x["actor_id"]: x for x in (await actor.status())["actors"]}
                if not fleet[b]["alive"]:
                    break
                assert time.monotonic() < deadline, "the silent actor was never declared dead"
                await asyncio.sleep(0.1)
            assert fleet[a]["alive"]
            with pytest.raises(AdmissionRejected) as err:
                await actor.report(make_result(held))
            assert err.value.reason == "lease_revoked"
            while (grant := (await actor.lease(a)).grant) is not None:
                await actor.report(make_result(grant))
            done = await trainer.step_results(0, timeout=5)
            assert done.complete  # served from the store: keep_closed_steps=0 evicted it
            assert len({s.prompt_id for r in done.results for s in r.result.samples}) == 4
            with pytest.raises(CoordinatorError):
                await trainer.step_results(99, timeout=0)
    finally:
        await runner.cleanup()


async def test_cancelled_report_still_completes_its_admission(coordinator_store: ObjectStore) -> None:
    """A client that hangs up mid-write: the record is durable and counted, and a retry is a duplicate."""
    from deltarl.coordinator.server import Coordinator
    from deltarl.protocol.records import LeaseGrant, LeaseRequest, RegisterRequest, StepSpec

    c = Coordinator(coordinator_store, RUN, service_config())
    await c.start()
    try:
        await c.open_step(make_spec(0, 2))
        aid = (await c.register(RegisterRequest())).actor_id
        grant = (await c.lease(LeaseRequest(actor_id=aid))).grant
        assert isinstance(grant, LeaseGrant)
        result = make_result(grant)
        handler = asyncio.create_task(c.report(result))
        await asyncio.sleep(0)  # the admission task has started its store write
        handler.cancel()
        with pytest.raises(asyncio.CancelledError):
            await handler
        while c._pending:
            await asyncio.sleep(0.01)
        assert c.scheduler.leases[grant.lease.lease_id].status.value == "admitted"
        assert (await c.report(result)).duplicate
        assert isinstance(c.cstore.spec(0), StepSpec)
        assert len(c.cstore.results(0)) == 1
    finally:
        await c.stop()


async def test_an_actor_that_leaves_is_not_counted_as_died(coordinator_store: ObjectStore) -> None:
    runner, running = await start_service(coordinator_store, service_config(heartbeat_timeout_s=0.3, lease_margin_s=5.0))
    try:
        async with CoordinatorClient(running.url, TRAINER_TOKEN) as trainer, \
                CoordinatorClient(running.url, ACTOR_TOKEN) as actor:
            spec = make_spec(0, 2)
            await trainer.open_step(0, spec.prompts, spec.accepted_versions)
            a = (await actor.register(region="a")).actor_id
            held = (await actor.lease(a, max_prompts=1)).grant
            assert held is not None
            await actor.leave(a)  # a clean stop (SIGTERM): its lease goes back at once
            await asyncio.sleep(0.8)  # past the heartbeat timeout: silent now, but it left
            status = await actor.status()
            fleet = {x["actor_id"]: x for x in status["actors"]}
            assert (fleet[a]["alive"], fleet[a]["left"]) == (False, True)
            assert status["counters"].get("actors_died", 0) == 0
            assert status["counters"]["actors_left"] == 1
            with pytest.raises(AdmissionRejected) as err:
                await actor.report(make_result(held))
            assert err.value.reason == "lease_revoked"
    finally:
        await runner.cleanup()
