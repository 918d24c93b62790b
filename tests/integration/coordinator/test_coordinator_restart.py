"""Kill the coordinator process mid-step (SIGKILL); a restarted one on the same store continues the step
without losing or repeating any admitted result, and honours leases granted before the crash."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import pytest

from deltarl.errors import AdmissionRejected, CoordinatorError
from deltarl.protocol.client import CoordinatorClient, SyncCoordinatorClient
from deltarl.protocol.records import Ack, LeaseGrant
from tests.fixtures.coordinator import ACTOR_TOKEN, TRAINER_TOKEN, CoordinatorProcess, make_result, make_spec


async def _lease(client: CoordinatorClient, actor_id: str, n: int) -> LeaseGrant:
    grant = (await client.lease(actor_id, max_prompts=n)).grant
    assert grant is not None
    return grant


async def test_sigkill_mid_step_then_restart_continues(
    tmp_path: Path, coordinator_process: Callable[..., CoordinatorProcess]
) -> None:
    store_url = str(tmp_path / "store")
    first = coordinator_process(store_url, probe_prompts=4, lease_margin_s=60.0)
    spec = make_spec(7, 24, versions=("v7", "v6"))
    async with CoordinatorClient(first.url, TRAINER_TOKEN) as trainer, CoordinatorClient(first.url, ACTOR_TOKEN) as c:
        await trainer.open_step(7, spec.prompts, spec.accepted_versions)
        a = (await c.register(region="eu", backend="test")).actor_id
        b = (await c.register(region="us", backend="test")).actor_id
        done = await _lease(c, a, 4)
        acked = await c.report(make_result(done))
        held_a = await _lease(c, a, 3)  # granted, not reported before the crash
        held_b = await _lease(c, b, 3)
        # Fire several reports at once and kill the process while they are in flight.
        extra = [await _lease(c, a, 1) for _ in range(3)]
        inflight = [asyncio.create_task(c.report(make_result(g))) for g in extra]
        await asyncio.sleep(0.01)
        first.kill()
        outcomes = await asyncio.gather(*inflight, return_exceptions=True)
        kept = c.actor_secrets  # the actors' secrets outlive the coordinator process
    acked_before = [acked] + [o for o in outcomes if isinstance(o, Ack)]
    assert all(isinstance(o, (Ack, CoordinatorError)) for o in outcomes), outcomes

    second = coordinator_process(store_url, probe_prompts=4, lease_margin_s=60.0)
    async with CoordinatorClient(second.url, TRAINER_TOKEN) as trainer, CoordinatorClient(second.url, ACTOR_TOKEN) as c:
        for aid, secret in kept.items():
            c.set_actor_secret(aid, secret)
        status = await c.status()
        assert {x["actor_id"] for x in status["actors"]} == {a, b}
        # Every result acknowledged before the crash survived: re-reporting it is a duplicate.
        again = await c.report(make_result(done))
        assert again.duplicate
        assert again.key == acked.key
        for grant in extra:  # in flight at the crash: admitted exactly once, whatever happened
            ack = await c.report(make_result(grant))
            assert ack.admitted
        # Leases granted before the crash are still valid.
        assert (await c.report(make_result(held_a))).admitted
        await c.heartbeat(b)
        assert (await c.report(make_result(held_b))).admitted
        # A forged version is still refused after the restart.
        rest = await _lease(c, b, 2)
        with pytest.raises(AdmissionRejected):
            await c.report(make_result(rest, version="v-other"))
        await c.report(make_result(rest))
        while True:
            resp = await c.lease(a, max_prompts=5)
            if resp.grant is None:
                break
            await c.report(make_result(resp.grant))
        results = await trainer.wait_step(7, poll_s=5.0, deadline_s=60.0)
    assert results.complete
    prompt_ids = [s.prompt_id for r in results.results for s in r.result.samples]
    assert sorted(prompt_ids) == sorted(p.prompt_id for p in spec.prompts)  # none lost, none twice
    keys = {r.lease.lease_id for r in results.results}
    assert {x.key.rsplit("/", 1)[-1].removesuffix(".json") for x in acked_before if x.key} <= keys


def test_sync_client_against_a_process(tmp_path: Path, coordinator_process: Callable[..., CoordinatorProcess]) -> None:
    proc = coordinator_process(str(tmp_path / "store"))
    spec = make_spec(0, 3)
    with SyncCoordinatorClient(proc.url, TRAINER_TOKEN) as trainer, SyncCoordinatorClient(proc.url, ACTOR_TOKEN) as c:
        assert trainer.open_step(0, spec.prompts, spec.accepted_versions).created
        aid = c.register(region="r").actor_id
        c.heartbeat(aid)
        while (grant := c.lease(aid)) is not None:
            assert c.report(make_result(grant)).admitted
        assert trainer.wait_step(0, poll_s=2.0, deadline_s=30.0).complete
        assert c.status()["counters"]["results_admitted"] >= 1


def test_cli_refuses_without_tokens(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from deltarl.cli import main

    monkeypatch.delenv("DELTARL_COORDINATOR_TOKEN", raising=False)
    assert main(["coordinator", "--store", str(tmp_path), "--run", "r", "--listen", "127.0.0.1:0"]) == 2
    assert main(["coordinator", "--store", str(tmp_path), "--run", "r", "--listen", "nonsense", "--token", "t"]) == 2
