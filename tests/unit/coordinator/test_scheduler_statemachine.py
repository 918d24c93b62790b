"""Hypothesis state machine over the scheduler: register, lease, expire, report, drift, die, rejoin.

Properties: no prompt is ever lost or admitted twice (checked after every rule), and while at least
one actor lives every open step completes.
"""

from __future__ import annotations

import itertools

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from deltarl.coordinator.config import SchedulerConfig
from deltarl.coordinator.scheduler import Scheduler
from deltarl.coordinator.views import check_invariants
from deltarl.protocol.records import AdmittedRecord, LeaseRecord, RolloutResult, Sample, sha256_of
from tests.fixtures.coordinator import Clock
from tests.fixtures.coordinator import make_spec as spec

TIMEOUT = 10.0


def _result(lease: LeaseRecord, group: dict[str, int], version: str, tokens: int) -> RolloutResult:
    samples = [
        Sample(prompt_id=pid, prompt_token_ids=[1], completion_token_ids=[7] * tokens, completion_text="",
               logprobs=[-1.0] * tokens, reward=None, finish_reason="length")
        for pid in lease.prompt_ids
        for _ in range(group[pid])
    ]
    return RolloutResult(step=lease.step, lease_id=lease.lease_id, actor_id=lease.actor_id, version_id=version,
                         samples=samples, gen_seconds=0.1, tokens=tokens * len(samples))


class SchedulerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.clock = Clock()
        ids = itertools.count()
        cfg = SchedulerConfig(heartbeat_timeout_s=TIMEOUT, lease_margin_s=5.0, lease_slack=1.5, chunks=2,
                              probe_prompts=2, prior_tokens_per_sample=10.0)
        self.sched = Scheduler(cfg, clock=self.clock, new_id=lambda p: f"{p}-{next(ids)}")
        self.held: list[LeaseRecord] = []  # leases actors believe they hold (some expired/revoked)
        self.reported: list[RolloutResult] = []
        self.admitted: set[tuple[int, str]] = set()
        self.silent: set[str] = set()  # actors that stopped heartbeating ("died")
        self.next_step = 0

    # --- helpers ----------------------------------------------------------------------------------

    def _live(self) -> list[str]:
        return sorted(a for a, s in self.sched.actors.items() if s.alive and a not in self.silent)

    def _report(self, result: RolloutResult) -> str:
        digest = sha256_of(result)
        d = self.sched.begin_admission(result, digest)
        if d.kind == "admit":
            assert d.lease is not None
            for pid in d.lease.prompt_ids:
                key = (d.lease.step, pid)
                assert key not in self.admitted, f"double admission of {key}"
                self.admitted.add(key)
            rec = AdmittedRecord(step=result.step, result=result, lease=d.lease, admitted_at=self.clock.t,
                                 result_sha256=digest)
            if self.sched.complete_admission(rec, f"k/{d.lease.lease_id}"):
                self.sched.close_step(result.step)
        return d.kind

    def _heartbeat_living(self) -> None:
        for aid in self.sched.actors:
            if aid not in self.silent:
                self.sched.heartbeat(aid)

    # --- rules ------------------------------------------------------------------------------------

    @rule(n=st.integers(1, 12), group=st.integers(1, 3))
    def open_step(self, n: int, group: int) -> None:
        self.sched.open_step(spec(self.next_step, n, versions=(f"v{self.next_step}", f"v{self.next_step - 1}"),
                                  group=group))
        self.next_step += 1

    @rule()
    def register(self) -> None:
        self.sched.register(region="r", backend="b")

    @precondition(lambda self: bool(self.sched.actors))
    @rule(data=st.data(), max_prompts=st.one_of(st.none(), st.integers(1, 5)))
    def lease(self, data: st.DataObject, max_prompts: int | None) -> None:
        aid = data.draw(st.sampled_from(sorted(self.sched.actors)))
        self.silent.discard(aid)  # asking for work is speaking: a silent actor rejoins
        got = self.sched.request_lease(aid, max_prompts=max_prompts)
        if got is not None:
            self.held.append(got)

    @precondition(lambda self: bool(self.held))
    @rule(data=st.data(), stale=st.booleans(), tokens=st.integers(0, 40))
    def report(self, data: st.DataObject, stale: bool, tokens: int) -> None:
        lease = data.draw(st.sampled_from(self.held))
        group = self.sched.steps[lease.step].group
        version = "forged" if stale else f"v{lease.step - data.draw(st.integers(0, 1))}"
        result = _result(lease, group, version, tokens)
        kind = self._report(result)
        if kind == "admit":
            self.reported.append(result)
        if kind in ("admit", "duplicate"):
            self.held.remove(lease)

    @precondition(lambda self: bool(self.reported))
    @rule(data=st.data())
    def duplicate(self, data: st.DataObject) -> None:
        result = data.draw(st.sampled_from(self.reported))
        assert self._report(result) == "duplicate"

    @rule(dt=st.floats(0.0, 30.0))
    def advance(self, dt: float) -> None:
        """Time passes (actors drift: results arrive later or sooner); the living heartbeat."""
        self.clock.t += dt
        self._heartbeat_living()
        self.sched.tick()

    @precondition(lambda self: bool(self.sched.actors))
    @rule(data=st.data())
    def die(self, data: st.DataObject) -> None:
        self.silent.add(data.draw(st.sampled_from(sorted(self.sched.actors))))

    @precondition(lambda self: bool(self.silent))
    @rule(data=st.data())
    def rejoin(self, data: st.DataObject) -> None:
        aid = data.draw(st.sampled_from(sorted(self.silent)))
        self.silent.discard(aid)
        self.sched.heartbeat(aid)

    @rule()
    def drain(self) -> None:
        """With one live actor, every open step completes in a bounded number of leases."""
        live = self._live()
        if not live:
            return
        aid = live[0]
        for _ in range(1000):
            if not self.sched.open_steps():
                break
            self.clock.t += 0.5
            self._heartbeat_living()
            got = self.sched.request_lease(aid)
            if got is None:
                self.clock.t += TIMEOUT  # others hold the rest: wait for their leases to expire
                self._heartbeat_living()
                self.sched.tick()
                continue
            group = self.sched.steps[got.step].group
            assert self._report(_result(got, group, f"v{got.step}", 3)) == "admit"
        assert not self.sched.open_steps(), "a step did not complete although an actor lives"

    @invariant()
    def no_prompt_lost_or_doubled(self) -> None:
        check_invariants(self.sched)
        admitted = {(n, pid) for n, s in self.sched.steps.items() for pid in s.admitted}
        assert admitted == self.admitted


SchedulerMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestScheduler = SchedulerMachine.TestCase
