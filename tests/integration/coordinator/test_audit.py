"""``deltarl audit`` over a real published run and a real coordinator's records; tampering is caught."""

from __future__ import annotations

import pytest

from deltarl.cli import main
from deltarl.coordinator.audit import audit_run, version_chain
from deltarl.coordinator.persistence import CoordinatorStore
from deltarl.pipeline.gc import gc
from deltarl.protocol.client import CoordinatorClient
from deltarl.protocol.records import AdmittedRecord, LeaseRecord, encode, sha256_of
from deltarl.storage.local import LocalStore
from tests.fixtures.coordinator import (
    ACTOR_TOKEN,
    RUN,
    TRAINER_TOKEN,
    make_result,
    make_spec,
    service_config,
    start_service,
)
from tests.fixtures.runs import publish_run

pytestmark = pytest.mark.torch


async def _audited_run(store: LocalStore, versions: list[str], *, bogus: str | None = None) -> None:
    """Two steps through a real coordinator: step 0 accepts [v1, v0], step 1 [v2, v1] (+ a bogus id)."""
    runner, running = await start_service(store, service_config(lease_margin_s=30.0))
    try:
        async with CoordinatorClient(running.url, TRAINER_TOKEN) as trainer, \
                CoordinatorClient(running.url, ACTOR_TOKEN) as actor:
            aid = (await actor.register()).actor_id
            for step, accepted in ((0, [versions[1], versions[0]]), (1, [versions[2], bogus or versions[1]])):
                spec = make_spec(step, 5, group=2)
                await trainer.open_step(step, spec.prompts, accepted)
                i = 0
                while True:
                    grant = (await actor.lease(aid, max_prompts=2)).grant
                    if grant is None:
                        break
                    await actor.report(make_result(grant, version=accepted[i % 2]))
                    i += 1
                assert (await trainer.step_results(step, timeout=10)).complete
    finally:
        await runner.cleanup()


@pytest.fixture
def published(tmp_path_factory: pytest.TempPathFactory) -> tuple[LocalStore, list[str]]:
    store = LocalStore(str(tmp_path_factory.mktemp("audit") / "store"))
    publish_run(store, RUN, 3)
    chain = version_chain(store, RUN)
    return store, sorted(chain, key=chain.__getitem__)


async def test_clean_run_passes_and_cli_exits_zero(published: tuple[LocalStore, list[str]],
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    store, versions = published
    assert len(versions) == 3
    await _audited_run(store, versions)
    report = audit_run(store, RUN)
    assert report.ok, report.failures
    assert [s.state for s in report.steps] == ["closed", "closed"]
    assert sum(s.prompts for s in report.steps) == 10
    assert main(["audit", RUN, "--store", store.url]) == 0
    assert "OK" in capsys.readouterr().out
    assert main(["audit", RUN, "--store", store.url, "--steps", "1:"]) == 0
    assert main(["audit", "no-such-run", "--store", store.url]) == 1
    store.close()


async def test_audit_after_gc_starts_at_the_oldest_kept_keyframe(tmp_path_factory: pytest.TempPathFactory) -> None:
    store = LocalStore(str(tmp_path_factory.mktemp("audit-gc") / "store"))
    publish_run(store, RUN, 6, keyframe_interval=3)  # keyframes at 0 and 3
    before = version_chain(store, RUN)
    assert gc(store, RUN, keep_last=2).removed_versions == [0, 1, 2]  # replay of 4, 5 needs keyframe 3
    chain = version_chain(store, RUN)
    assert chain == {vid: v for vid, v in before.items() if v >= 3}
    versions = sorted(chain, key=chain.__getitem__)
    await _audited_run(store, versions)  # rollouts of versions 3, 4 and 5
    report = audit_run(store, RUN)
    assert report.ok, report.failures
    assert report.versions_in_chain == 3
    # a rollout claiming a version gc removed cannot be checked against the kept chain: flagged
    removed = next(vid for vid, v in before.items() if v == 1)
    cs = CoordinatorStore(store, RUN)
    key, rec = cs.results(1)[0]
    forged = rec.result.model_copy(update={"version_id": removed})
    store.delete(key)
    store.put(key, encode(AdmittedRecord(**{**rec.model_dump(), "result": forged, "result_sha256": sha256_of(forged)})))
    assert "version_in_chain" in audit_run(store, RUN).counts()
    store.close()


async def test_tampering_is_detected(published: tuple[LocalStore, list[str]], capsys: pytest.CaptureFixture[str]) -> None:
    store, versions = published
    # The trainer (wrongly) accepted an id that is not in the chain: the coordinator admits, audit flags.
    await _audited_run(store, versions, bogus="f" * 64)
    cs = CoordinatorStore(store, RUN)
    _, rec = cs.results(0)[0]
    # A record admitted after its lease's deadline, with a lease the coordinator never granted.
    late_lease = LeaseRecord(**{**rec.lease.model_dump(), "lease_id": "lease-forged", "deadline": rec.admitted_at - 1})
    late_result = rec.result.model_copy(update={"lease_id": "lease-forged"})
    forged = AdmittedRecord(step=0, result=late_result, lease=late_lease, admitted_at=rec.admitted_at,
                            result_sha256=sha256_of(late_result))
    store.put_if_absent(cs.result_key(0, "lease-forged"), encode(forged))
    report = audit_run(store, RUN)
    checks = report.counts()
    assert checks["version_in_chain"] >= 1  # step 1's bogus version
    assert checks["lease_valid"] == 1
    assert checks["lease_recorded"] == 1
    assert checks["double_admission"] >= 1  # the forged record repeats step 0's prompts
    assert checks["manifest"] == 1  # step 0's manifest does not list the forged record
    assert {f.step for f in report.failures} == {0, 1}
    assert main(["audit", RUN, "--store", store.url]) == 1
    assert "FAILED" in capsys.readouterr().out
    assert main(["audit", RUN, "--store", store.url, "--steps", "5:9"]) == 0  # no steps there
    store.close()
