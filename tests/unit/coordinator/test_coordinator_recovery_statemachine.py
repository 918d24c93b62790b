"""Hypothesis state machine over scheduler + store: crashes at any point lose no admitted result.

The driver persists as the service does (actor and lease records before they are returned, an
admitted record before the admission completes, a manifest when a step completes); the ``crash``
rule throws the scheduler away and rebuilds it with ``recover`` from a real MemoryStore.

Ids come from one counter per machine (zero-padded, so their sorted order is their creation order),
never from the scheduler's random epoch: what the rules draw (``sampled_from`` over actors and
grants) must depend only on what hypothesis drew, or a replay draws from another list and fails
with ``FlakyStrategyDefinition``.
"""

from __future__ import annotations

import itertools

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from deltarl.coordinator.config import SchedulerConfig
from deltarl.coordinator.persistence import CoordinatorStore, build_manifest, recover
from deltarl.coordinator.views import check_invariants
from deltarl.protocol.records import AdmittedRecord, LeaseGrant, sha256_of
from deltarl.storage.memory import MemoryStore
from tests.fixtures.coordinator import Clock, make_result, make_spec

RUN = "run-sm"
CFG = SchedulerConfig(heartbeat_timeout_s=10.0, lease_margin_s=5.0, lease_slack=1.5, chunks=2, probe_prompts=2)


class RecoveryMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.clock = Clock()
        self.store = MemoryStore()
        self.cs = CoordinatorStore(self.store, RUN)
        ids = itertools.count()
        self.new_id = lambda prefix: f"{prefix}-{next(ids):06d}"
        self.sched = recover(self.store, RUN, CFG, clock=self.clock, new_id=self.new_id).scheduler
        self.grants: list[LeaseGrant] = []
        self.admitted: set[tuple[int, str]] = set()
        self.next_step = 0

    def _persisted_prompts(self) -> set[tuple[int, str]]:
        out = set()
        for n in self.cs.steps():
            for _, rec in self.cs.results(n):
                out.update((n, pid) for pid in rec.lease.prompt_ids)
        return out

    @rule(n=st.integers(1, 8), group=st.integers(1, 2))
    def open_step(self, n: int, group: int) -> None:
        spec = self.cs.put_spec(make_spec(self.next_step, n, group=group))
        self.sched.open_step(spec)
        self.next_step += 1

    @rule()
    def register(self) -> None:
        record = self.sched.new_actor(region="r")
        self.cs.put_actor(record)
        self.sched.add_actor(record)

    @precondition(lambda self: bool(self.sched.actors))
    @rule(data=st.data())
    def lease(self, data: st.DataObject) -> None:
        aid = data.draw(st.sampled_from(sorted(self.sched.actors)))
        rec = self.sched.request_lease(aid, max_prompts=data.draw(st.integers(1, 4)))
        if rec is not None:
            self.cs.put_lease(rec)
            spec = self.sched.steps[rec.step].spec
            self.grants.append(LeaseGrant(lease=rec, prompts=self.sched.prompts_of(rec),
                                          accepted_versions=spec.accepted_versions))

    @precondition(lambda self: bool(self.grants))
    @rule(data=st.data(), crash_before_ack=st.booleans())
    def report(self, data: st.DataObject, crash_before_ack: bool) -> None:
        grant = data.draw(st.sampled_from(self.grants))
        result = make_result(grant)
        digest = sha256_of(result)
        d = self.sched.begin_admission(result, digest)
        if d.kind != "admit":
            return
        assert d.lease is not None
        rec = AdmittedRecord(step=result.step, result=result, lease=d.lease, admitted_at=d.at, result_sha256=digest)
        key = self.cs.put_admitted(rec)  # durable first ...
        for pid in d.lease.prompt_ids:
            assert (result.step, pid) not in self.admitted, "double admission"
            self.admitted.add((result.step, pid))
        if crash_before_ack:  # ... the process dies before it updates its memory or acknowledges
            self.crash()
            return
        if self.sched.complete_admission(rec, key):
            spec = self.sched.steps[result.step].spec
            self.cs.put_manifest(build_manifest(spec, self.cs.results(result.step), closed_at=self.clock.t))
            self.sched.close_step(result.step)

    @rule(dt=st.floats(0.0, 20.0))
    def advance(self, dt: float) -> None:
        self.clock.t += dt
        self.sched.tick()

    @rule()
    def crash(self) -> None:
        rec = recover(self.store, RUN, CFG, clock=self.clock, new_id=self.new_id)
        self.sched = rec.scheduler
        for step in rec.to_close:  # the restarted service closes what was left complete
            self.cs.put_manifest(build_manifest(rec.specs[step], self.cs.results(step), closed_at=self.clock.t))
            self.sched.close_step(step)

    @invariant()
    def nothing_lost_or_doubled(self) -> None:
        check_invariants(self.sched)
        assert self._persisted_prompts() == self.admitted
        in_memory = {(n, pid) for n, s in self.sched.steps.items() for pid in s.admitted}
        assert in_memory == {(n, pid) for n, pid in self.admitted if n in self.sched.steps}


RecoveryMachine.TestCase.settings = settings(
    max_examples=40, stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestRecovery = RecoveryMachine.TestCase
