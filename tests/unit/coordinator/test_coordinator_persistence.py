"""Coordinator records in a real store (MemoryStore): write-once, recovery, format versions, config."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from deltarl.coordinator.config import CoordinatorConfig, SchedulerConfig
from deltarl.coordinator.persistence import CoordinatorStore, build_manifest, recover
from deltarl.coordinator.scheduler import Scheduler
from deltarl.errors import ConfigError, FormatError, RecordConflict, UnsupportedFormatVersion
from deltarl.protocol.records import AdmittedRecord, LeaseGrant, StepSpec, decode, encode, sha256_of
from deltarl.storage.memory import MemoryStore
from tests.fixtures.coordinator import Clock, make_result, make_spec

RUN = "run-p"


def _grant(sched: Scheduler, actor: str, n: int) -> LeaseGrant:
    lease = sched.request_lease(actor, max_prompts=n)
    assert lease is not None
    st = sched.steps[lease.step].spec
    return LeaseGrant(lease=lease, prompts=sched.prompts_of(lease), accepted_versions=st.accepted_versions)


def _admit(sched: Scheduler, cs: CoordinatorStore, grant: LeaseGrant) -> str:
    result = make_result(grant, tokens_each=50)
    digest = sha256_of(result)
    d = sched.begin_admission(result, digest)
    assert d.kind == "admit"
    assert d.lease is not None
    rec = AdmittedRecord(step=result.step, result=result, lease=d.lease, admitted_at=sched.now(), result_sha256=digest)
    key = cs.put_admitted(rec)
    sched.complete_admission(rec, key)
    return key


def test_recover_rebuilds_leases_results_and_speeds() -> None:
    store, clock = MemoryStore(), Clock()
    ids = itertools.count()
    cfg = SchedulerConfig(heartbeat_timeout_s=5.0, probe_prompts=2, chunks=1)
    sched = Scheduler(cfg, clock=clock, new_id=lambda p: f"{p}-{next(ids)}")
    cs = CoordinatorStore(store, RUN)
    a, b = sched.register(region="x"), sched.register(region="y")
    cs.put_actor(a)
    cs.put_actor(b)
    spec = cs.put_spec(make_spec(4, 6))
    sched.open_step(spec)
    g1 = _grant(sched, a.actor_id, 2)
    cs.put_lease(g1.lease)
    clock.t += 1.0
    _admit(sched, cs, g1)
    g2 = _grant(sched, b.actor_id, 2)  # b then dies: its lease is revoked and re-leased to a
    cs.put_lease(g2.lease)
    clock.t += 6.0
    sched.heartbeat(a.actor_id)
    sched.tick()
    g3 = _grant(sched, a.actor_id, 4)
    cs.put_lease(g3.lease)
    assert set(g2.lease.prompt_ids) <= set(g3.lease.prompt_ids)

    rec = recover(store, RUN, cfg, clock=clock)
    r = rec.scheduler
    assert set(r.actors) == {a.actor_id, b.actor_id}
    assert r.leases[g2.lease.lease_id].status.value == "revoked"  # proven by the later grant
    assert r.leases[g3.lease.lease_id].status.value == "active"
    assert set(r.steps[4].admitted) == set(g1.lease.prompt_ids)
    assert r.rate_of(a.actor_id) == pytest.approx(sched.rate_of(a.actor_id))
    assert rec.to_close == []
    # The recovered coordinator admits the lease granted before the "crash".
    _admit(r, cs, g3)
    assert r.steps[4].complete
    # A complete step without a manifest is listed to close; with one it is not loaded at all.
    assert recover(store, RUN, cfg, clock=clock).to_close == [4]
    cs.put_manifest(build_manifest(spec, cs.results(4), closed_at=clock.t))
    assert recover(store, RUN, cfg, clock=clock).scheduler.steps == {}


def test_write_once_conflicts_and_idempotent_retries() -> None:
    store = MemoryStore()
    cs = CoordinatorStore(store, RUN)
    spec = make_spec(1, 2)
    stored = cs.put_spec(spec)
    assert cs.put_spec(spec.model_copy(update={"opened_at": 5.0})) == stored  # a retried open
    with pytest.raises(RecordConflict):
        cs.put_spec(make_spec(1, 3))
    sched = Scheduler(clock=Clock())
    actor = sched.register()
    sched.open_step(spec)
    grant = _grant(sched, actor.actor_id, 2)
    result = make_result(grant)
    rec = AdmittedRecord(step=1, result=result, lease=grant.lease, admitted_at=1.0, result_sha256=sha256_of(result))
    key = cs.put_admitted(rec)
    assert cs.put_admitted(rec.model_copy(update={"admitted_at": 2.0})) == key  # same result: fine
    other = make_result(grant, version="v0")
    with pytest.raises(RecordConflict):
        cs.put_admitted(AdmittedRecord(step=1, result=other, lease=grant.lease, admitted_at=1.0,
                                       result_sha256=sha256_of(other)))
    assert cs.steps() == [1]
    assert [k for k, _ in cs.results(1)] == [key]


def test_records_refuse_unknown_versions_and_garbage() -> None:
    spec = make_spec(0, 1)
    data = encode(spec)
    assert decode(StepSpec, data) == spec
    with pytest.raises(UnsupportedFormatVersion):
        decode(StepSpec, data.replace(b'"format_version":1', b'"format_version":2'))
    with pytest.raises(FormatError):
        decode(StepSpec, b"not json")
    with pytest.raises(FormatError):
        decode(StepSpec, data.replace(b'"step":0', b'"step":-1'))
    with pytest.raises(FormatError):
        decode(StepSpec, b"[1]")


def test_config_file_and_bounds(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("scheduler:\n  chunks: 8\n  max_staleness: 2\nservice:\n  port: 0\n")
    cfg = CoordinatorConfig.load(path)
    assert cfg.scheduler.chunks == 8
    assert cfg.service.port == 0
    path.write_text("scheduler:\n  ema_alpha: 2.0\n")
    with pytest.raises(ConfigError):
        CoordinatorConfig.load(path)
    with pytest.raises(ConfigError):
        CoordinatorConfig.load(tmp_path / "missing.json")
