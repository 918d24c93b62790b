"""Read-only views of the scheduler: the fleet status the service serves, and the invariant check."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from deltarl.coordinator.state import LeaseStatus

if TYPE_CHECKING:
    from deltarl.coordinator.scheduler import Scheduler


def check_invariants(sched: Scheduler) -> None:
    """Raise AssertionError if a prompt is lost, duplicated, or double-admitted (for tests)."""
    for n, st in sched.steps.items():
        pool, leased, admitted = list(st.pool), set(st.leased), set(st.admitted)
        assert len(pool) == len(set(pool)), f"step {n}: prompt twice in the pool"
        assert not (set(pool) & leased), f"step {n}: prompt pooled and leased"
        assert not (set(pool) | leased) & admitted, f"step {n}: admitted prompt pooled or leased"
        assert set(pool) | leased | admitted == set(st.group), f"step {n}: prompt lost"
        for pid, lid in st.leased.items():
            assert sched.leases[lid].status in (LeaseStatus.ACTIVE, LeaseStatus.COMMITTING), (n, pid)
        for pid, lid in st.admitted.items():
            assert sched.leases[lid].status is LeaseStatus.ADMITTED, (n, pid)
        assert st.pool.samples == sum(st.group[p] for p in pool), f"step {n}: pool sample count drifted"


def fleet_status(sched: Scheduler) -> dict[str, Any]:
    """The fleet view: actors, speeds, shares, leases, steps and counters (JSON-ready)."""
    now = sched.now()
    shares = sched.shares()
    actors = [
        {
            "actor_id": aid, "region": a.record.region, "backend": a.record.backend, "alive": a.alive,
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
