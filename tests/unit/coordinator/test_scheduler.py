"""Scheduler state machine: shares, leases, expiry, death, version gating, admission."""

from __future__ import annotations

import itertools

import pytest

from deltarl.coordinator.config import SchedulerConfig
from deltarl.coordinator.scheduler import Reason, Scheduler, proportional_split
from deltarl.coordinator.views import check_invariants, fleet_status
from deltarl.errors import CoordinatorError, InvariantViolation, UnknownActor
from deltarl.protocol.records import (
    AdmittedRecord,
    LeaseRecord,
    RolloutResult,
    Sample,
    sha256_of,
)
from tests.fixtures.coordinator import Clock
from tests.fixtures.coordinator import make_spec as spec


def make_scheduler(**cfg: object) -> tuple[Scheduler, Clock]:
    clock = Clock()
    counter = itertools.count()
    sched = Scheduler(SchedulerConfig(**cfg), clock=clock, new_id=lambda p: f"{p}-{next(counter)}")  # type: ignore[arg-type]
    return sched, clock


def result_for(lease: LeaseRecord, version: str = "v1", tokens_each: int = 10, group: int = 1) -> RolloutResult:
    samples = [
        Sample(
            prompt_id=pid, prompt_token_ids=[1, 2], completion_token_ids=list(range(tokens_each)),
            completion_text="x", logprobs=[-0.5] * tokens_each, reward=1.0, finish_reason="stop",
        )
        for pid in lease.prompt_ids
        for _ in range(group)
    ]
    return RolloutResult(
        step=lease.step, lease_id=lease.lease_id, actor_id=lease.actor_id, version_id=version,
        samples=samples, gen_seconds=1.0, tokens=tokens_each * len(samples),
    )


def admit(sched: Scheduler, result: RolloutResult) -> tuple[str, bool | None, Reason | None]:
    """Run both admission phases as the service does (the 'store' write always succeeds)."""
    digest = sha256_of(result)
    d = sched.begin_admission(result, digest)
    if d.kind != "admit":
        return d.kind, None, d.reason
    assert d.lease is not None
    rec = AdmittedRecord(step=result.step, result=result, lease=d.lease, admitted_at=sched.now(), result_sha256=digest)
    return "admit", sched.complete_admission(rec, f"k/{d.lease.lease_id}"), None


def measure(sched: Scheduler, clock: Clock, actor: str, tps: float) -> None:
    """Give the actor one lease of a throwaway step and report it at the given speed."""
    step = 1000 + len(sched.steps)
    sched.open_step(spec(step, 1))
    lease = sched.request_lease(actor, max_prompts=1)
    assert lease is not None
    clock.t += 100 / tps
    assert admit(sched, result_for(lease, tokens_each=100))[0] == "admit"
    sched.close_step(step)


def test_proportional_split_largest_remainder() -> None:
    assert proportional_split(300, {"a": 5000, "b": 2500}) == {"a": 200, "b": 100}
    assert sum(proportional_split(10, {"a": 1, "b": 1, "c": 1}).values()) == 10
    assert proportional_split(5, {"a": 0.0}) == {"a": 0}


def test_5000_and_2500_split_300_prompts_200_100() -> None:
    sched, clock = make_scheduler(chunks=1, max_lease_seconds=1e9)
    a, b = sched.register().actor_id, sched.register().actor_id
    measure(sched, clock, a, 5000)
    measure(sched, clock, b, 2500)
    assert sched.rate_of(a) == pytest.approx(5000)
    sched.open_step(spec(1, 300))
    assert sched.shares() == {a: 200, b: 100}
    la, lb = sched.request_lease(a), sched.request_lease(b)
    assert la is not None
    assert lb is not None
    assert (len(la.prompt_ids), len(lb.prompt_ids)) == (200, 100)
    # Same expected finish: the work per second matches.
    assert la.expected_tokens / 5000 == pytest.approx(lb.expected_tokens / 2500)


def test_new_actor_gets_probe_then_is_measured_quickly() -> None:
    sched, clock = make_scheduler(probe_prompts=2)
    a = sched.register().actor_id
    sched.open_step(spec(1, 100))
    lease = sched.request_lease(a)
    assert lease is not None
    assert len(lease.prompt_ids) == 2
    clock.t += 2.0
    admit(sched, result_for(lease, tokens_each=1000))
    assert sched.rate_of(a) == pytest.approx(1000.0)
    bigger = sched.request_lease(a)
    assert bigger is not None
    assert len(bigger.prompt_ids) > 2



def test_a_lease_expecting_no_tokens_expires_without_zeroing_the_rate() -> None:
    """A result of empty completions makes the expected tokens a sample 0; a lease granted then that
    expires says nothing of the actor's speed. It used to set every rate to 0 and the next lease
    divided by a zero sum of weights (hypothesis's scheduler state machine, on a fresh clone)."""
    sched, clock = make_scheduler(heartbeat_timeout_s=10.0, lease_margin_s=5.0, probe_prompts=2)
    sched.open_step(spec(0, 1))
    sched.open_step(spec(1, 1))
    a = sched.register().actor_id
    b = sched.register().actor_id
    lease = sched.request_lease(a)
    assert lease is not None
    assert admit(sched, result_for(lease, tokens_each=0))[0] == "admit"
    idle = sched.request_lease(a)
    assert idle is not None
    assert idle.expected_tokens == 0.0
    clock.t += 8.0  # past the lease's deadline, heartbeats still in time
    sched.heartbeat(a)
    sched.heartbeat(b)
    sched.tick()
    assert sched.leases[idle.lease_id].status.value == "expired"
    assert sched.rate_of(a) > 0
    assert sched.request_lease(b) is not None


def test_new_actor_prior_is_median_of_measured() -> None:
    sched, clock = make_scheduler()
    a = sched.register().actor_id
    measure(sched, clock, a, 3000)
    b = sched.register().actor_id
    assert sched.rate_of(b) == pytest.approx(3000)


def test_expired_lease_returns_prompts_and_late_result_is_rejected() -> None:
    sched, clock = make_scheduler(lease_margin_s=5, probe_prompts=3)
    a = sched.register().actor_id
    sched.open_step(spec(1, 3))
    lease = sched.request_lease(a)
    assert lease is not None
    clock.t = lease.deadline + 1
    sched.heartbeat(a)
    sched.tick()
    assert len(sched.steps[1].pool) == 3
    assert admit(sched, result_for(lease)) == ("reject", None, Reason.LEASE_EXPIRED)
    assert sched.rejections["lease_expired"] == 1
    assert sched.rate_of(a) < sched.config.prior_tokens_per_second  # it proved slower than assumed
    complete = False
    while (again := sched.request_lease(a)) is not None:
        assert again.lease_id != lease.lease_id
        complete = bool(admit(sched, result_for(again))[1])
    assert complete
    check_invariants(sched)


def test_dead_actor_leases_revoked_and_rejoin() -> None:
    sched, clock = make_scheduler(heartbeat_timeout_s=10)
    a, b = sched.register().actor_id, sched.register().actor_id
    sched.open_step(spec(1, 4))
    la = sched.request_lease(a, max_prompts=2)
    assert la is not None
    clock.t += 11
    sched.heartbeat(b)
    events = sched.tick()
    assert any("dead" in e for e in events)
    assert not sched.actors[a].alive
    assert len(sched.steps[1].pool) == 4
    assert admit(sched, result_for(la))[2] is Reason.LEASE_REVOKED
    # the actor rejoins (it spoke again); its old lease stays revoked
    assert sched.actors[a].alive
    check_invariants(sched)


def test_version_gating_and_wrong_actor_and_duplicates() -> None:
    sched, _ = make_scheduler()
    a, b = sched.register().actor_id, sched.register().actor_id
    sched.open_step(spec(1, 2, versions=("v1", "v0")))
    lease = sched.request_lease(a)
    assert lease is not None
    assert admit(sched, result_for(lease, version="v-forged"))[2] is Reason.VERSION_NOT_ACCEPTED
    forged = result_for(lease).model_copy(update={"actor_id": b})
    assert admit(sched, forged)[2] is Reason.WRONG_ACTOR
    bad = result_for(lease).model_copy(update={"step": 7})
    assert admit(sched, bad)[2] is Reason.WRONG_STEP
    good = result_for(lease, version="v0")
    assert admit(sched, good)[0] == "admit"
    assert admit(sched, good)[0] == "duplicate"
    assert admit(sched, result_for(lease, version="v1"))[2] is Reason.ALREADY_ADMITTED
    assert sched.counters["results_admitted"] == 1
    assert set(sched.rejections) == {"version_not_accepted", "wrong_actor", "wrong_step", "already_admitted"}


def test_prompt_mismatch_with_group_size() -> None:
    sched, _ = make_scheduler()
    a = sched.register().actor_id
    sched.open_step(spec(1, 2, group=4))
    lease = sched.request_lease(a)
    assert lease is not None
    assert admit(sched, result_for(lease, group=3))[2] is Reason.PROMPT_MISMATCH
    assert admit(sched, result_for(lease, group=4))[0] == "admit"


def test_committing_lease_does_not_expire_and_abort_reactivates() -> None:
    sched, clock = make_scheduler(lease_margin_s=1)
    a = sched.register().actor_id
    sched.open_step(spec(1, 2))
    lease = sched.request_lease(a)
    assert lease is not None
    res = result_for(lease)
    assert sched.begin_admission(res, sha256_of(res)).kind == "admit"
    assert sched.begin_admission(res, sha256_of(res)).reason is Reason.IN_PROGRESS
    clock.t = lease.deadline + 5
    sched.heartbeat(a)
    sched.tick()
    assert sched.leases[lease.lease_id].status.value == "committing"
    sched.abort_admission(lease.lease_id)
    sched.tick()
    assert sched.leases[lease.lease_id].status.value == "expired"
    check_invariants(sched)


def test_staleness_limit_and_idempotent_open() -> None:
    sched, _ = make_scheduler(max_staleness=1)
    with pytest.raises(CoordinatorError):
        sched.open_step(spec(1, 2, versions=("v2", "v1", "v0")))
    assert sched.open_step(spec(1, 2)) is True
    assert sched.open_step(spec(1, 2)) is False
    with pytest.raises(CoordinatorError):
        sched.open_step(spec(1, 3))
    with pytest.raises(UnknownActor):
        sched.heartbeat("nobody")


def test_equal_policy_ignores_speed() -> None:
    sched, clock = make_scheduler(policy="equal", chunks=1, max_lease_seconds=1e9)
    a, b = sched.register().actor_id, sched.register().actor_id
    measure(sched, clock, a, 5000)
    measure(sched, clock, b, 1000)
    sched.open_step(spec(1, 300))
    assert sched.shares() == {a: 150, b: 150}


def test_steps_lease_oldest_first_and_complete() -> None:
    sched, _ = make_scheduler(probe_prompts=100, chunks=1)
    a = sched.register().actor_id
    sched.open_step(spec(2, 2))
    sched.open_step(spec(1, 2))
    first = sched.request_lease(a)
    assert first is not None
    assert first.step == 1
    assert admit(sched, result_for(first)) == ("admit", True, None)
    sched.close_step(1)
    second = sched.request_lease(a)
    assert second is not None
    assert second.step == 2
    assert sched.open_steps() == [2]
    assert fleet_status(sched)["steps"][0]["step"] == 2


def test_invariant_check_raises_a_specific_error_not_an_assert() -> None:
    """Recovery relies on it, so it must survive ``python -O``: a lost prompt is InvariantViolation."""
    sched, _ = make_scheduler()
    a = sched.register().actor_id
    sched.open_step(spec(1, 4))
    lease = sched.request_lease(a)
    assert lease is not None
    check_invariants(sched)
    st = sched.steps[1]
    del st.leased[lease.prompt_ids[0]]  # the books lose a prompt
    with pytest.raises(InvariantViolation, match="step 1: prompt lost"):
        check_invariants(sched)
