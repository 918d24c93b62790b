"""Read-only views of the scheduler: the fleet status the service serves, and the invariant check.

Views read the scheduler; the scheduler never imports them.
"""

from __future__ import annotations

from typing import Any

from deltarl.coordinator.scheduler import Scheduler
from deltarl.coordinator.state import LeaseStatus
from deltarl.errors import InvariantViolation


def invariant_problems(sched: Scheduler) -> list[str]:
    """Every way the scheduler's books do not add up (empty when a prompt is in exactly one place)."""
    problems = []
    for n, st in sched.steps.items():
        pool, leased, admitted = list(st.pool), set(st.leased), set(st.admitted)
        checks = [
            (len(pool) == len(set(pool)), "prompt twice in the pool"),
            (not (set(pool) & leased), "prompt pooled and leased"),
            (not (set(pool) | leased) & admitted, "admitted prompt pooled or leased"),
            (set(pool) | leased | admitted == set(st.group), "prompt lost"),
            (st.pool.samples == sum(st.group[p] for p in pool), "pool sample count drifted"),
        ]
        problems += [f"step {n}: {what}" for ok, what in checks if not ok]
        for pid, lid in st.leased.items():
            if sched.leases[lid].status not in (LeaseStatus.ACTIVE, LeaseStatus.COMMITTING):
                problems.append(f"step {n}: prompt {pid} leased by {lid}, which is {sched.leases[lid].status.value}")
        for pid, lid in st.admitted.items():
            if sched.leases[lid].status is not LeaseStatus.ADMITTED:
                problems.append(f"step {n}: prompt {pid} admitted by {lid}, which is {sched.leases[lid].status.value}")
    return problems


def check_invariants(sched: Scheduler) -> None:
    """Raise :class:`InvariantViolation` naming every problem if a prompt is lost, duplicated or
    admitted twice (recovery runs it on the state it rebuilt; tests run it after every operation)."""
    problems = invariant_problems(sched)
    if problems:
        raise InvariantViolation("scheduler invariants broken: " + "; ".join(problems))


def fleet_status(sched: Scheduler) -> dict[str, Any]:
    """The fleet view: actors, speeds, shares, leases, steps and counters (JSON-ready)."""
    now = sched.now()
    shares = sched.shares()
    actors = [
        {
            "actor_id": aid, "region": a.record.region, "backend": a.record.backend, "alive": a.alive, "left": a.left,
            "tokens_per_second": round(sched.rate_of(aid), 3), "measured": a.measured,
            "share": shares.get(aid, 0), "leases": sorted(a.leases),
            "leased_prompts": sum(len(sched.leases[i].record.prompt_ids) for i in a.leases),
            "admitted_prompts": a.admitted_prompts, "admitted_tokens": a.admitted_tokens,
            "last_seen_s": round(now - a.last_seen, 3),
        }
        for aid, a in sorted(sched.actors.items())
    ]
    steps = [
        {
            "step": n, "prompts": len(st.group), "pool": len(st.pool), "leased": len(st.leased),
            "admitted": len(st.admitted), "complete": st.complete, "closed": st.closed,
            "accepted_versions": list(st.spec.accepted_versions),
        }
        for n, st in sorted(sched.steps.items())
        if not st.closed
    ]
    return {
        "now": now, "actors": actors, "steps": steps, "tokens_per_sample": round(sched.tokens_per_sample, 3),
        "counters": dict(sched.counters), "rejections": dict(sched.rejections),
    }
