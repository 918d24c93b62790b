"""A simulated fleet in virtual time, driving the real :class:`Scheduler` (benchmarks and tests).

Actors generate at a speed that drifts piecewise-constantly and may die; they lease, generate
(for exactly the tokens their prompts' completions take, which the scheduler does not know in
advance), report, and heartbeat every ``HEARTBEAT_S``; the scheduler ticks every 0.5 s.
"""

from __future__ import annotations

import heapq
import itertools
import random
from dataclasses import dataclass
from typing import Any

from deltarl.coordinator.config import SchedulerConfig
from deltarl.coordinator.scheduler import Scheduler
from deltarl.coordinator.views import check_invariants
from deltarl.protocol.records import AdmittedRecord, PromptItem, RolloutResult, Sample, StepSpec, sha256_of

HEARTBEAT_S = 2.0


@dataclass
class Fleet:
    """Speed of each actor over time: base x a drift factor per period; death at a time."""

    base: list[float]
    factors: list[list[float]]
    period: float
    death: dict[int, float]

    def speed(self, i: int, t: float) -> float:
        if t >= self.death.get(i, float("inf")):
            return 0.0
        k = min(int(t // self.period), len(self.factors[i]) - 1)
        return self.base[i] * self.factors[i][k]

    def finish(self, i: int, t0: float, tokens: float) -> float:
        """When actor ``i``, starting at ``t0``, has generated ``tokens`` (inf if it dies first)."""
        t, left = t0, tokens
        while left > 1e-9:
            s = self.speed(i, t)
            if s <= 0:
                return float("inf")
            edge = (int(t // self.period) + 1) * self.period
            if t >= self.death.get(i, float("inf")):
                return float("inf")
            edge = min(edge, self.death.get(i, float("inf")))
            if s * (edge - t) >= left:
                return t + left / s
            left -= s * (edge - t)
            t = edge
        return t

    def ideal(self, work: float) -> float:
        """Time at which the whole fleet's integrated speed reaches ``work``."""
        t, left = 0.0, work
        edges = sorted({*self.death.values()})
        while True:
            total = sum(self.speed(i, t) for i in range(len(self.base)))
            nxt = (int(t // self.period) + 1) * self.period
            nxt = min([nxt, *[e for e in edges if e > t]])
            if total * (nxt - t) >= left:
                return t + left / total
            left -= total * (nxt - t)
            t = nxt


def make_step(rng: random.Random, prompts: int, group: int) -> tuple[StepSpec, dict[str, list[int]]]:
    lengths = {
        f"p{i:05d}": [max(8, min(2048, int(rng.lognormvariate(5.8, 0.6)))) for _ in range(group)]
        for i in range(prompts)
    }
    spec = StepSpec(step=0, prompts=[PromptItem(prompt_id=p, text="", group_size=group) for p in lengths],
                    accepted_versions=["v1", "v0"])
    return spec, lengths


def simulate(cfg: SchedulerConfig, fleet: Fleet, spec: StepSpec, lengths: dict[str, list[int]]) -> dict[str, Any]:
    """Run one step to completion in virtual time; return makespan and counters."""
    now = [0.0]
    ids = itertools.count()
    sched = Scheduler(cfg, clock=lambda: now[0], new_id=lambda p: f"{p}-{next(ids)}")
    actors = [sched.register(region=f"r{i}").actor_id for i in range(len(fleet.base))]
    sched.open_step(spec)
    seq = itertools.count()
    events: list[tuple[float, int, str, int, Any]] = []
    for i in range(len(actors)):
        heapq.heappush(events, (0.0, next(seq), "request", i, None))
        heapq.heappush(events, (0.0, next(seq), "heartbeat", i, None))
    heapq.heappush(events, (0.0, next(seq), "tick", -1, None))
    makespan = None
    while events:
        t, _, kind, i, payload = heapq.heappop(events)
        now[0] = t
        dead = t >= fleet.death.get(i, float("inf"))
        if kind == "tick":
            sched.tick()
            if makespan is None:
                heapq.heappush(events, (t + 0.5, next(seq), "tick", -1, None))
        elif kind == "heartbeat" and not dead and makespan is None:
            sched.heartbeat(actors[i])
            heapq.heappush(events, (t + HEARTBEAT_S, next(seq), "heartbeat", i, None))
        elif kind == "request" and not dead and makespan is None:
            lease = sched.request_lease(actors[i])
            if lease is None:
                heapq.heappush(events, (t + 0.5, next(seq), "request", i, None))
                continue
            tokens = sum(sum(lengths[p]) for p in lease.prompt_ids)
            done = fleet.finish(i, t, tokens)
            if done != float("inf"):
                heapq.heappush(events, (done, next(seq), "report", i, lease))
        elif kind == "report" and makespan is None:
            lease = payload
            samples = [
                Sample(prompt_id=p, prompt_token_ids=[], completion_token_ids=[0] * n, completion_text="",
                       logprobs=[0.0] * n)
                for p in lease.prompt_ids
                for n in lengths[p]
            ]
            result = RolloutResult(step=0, lease_id=lease.lease_id, actor_id=actors[i], version_id="v1",
                                   samples=samples, gen_seconds=t - lease.granted_at,
                                   tokens=sum(len(s.completion_token_ids) for s in samples))
            digest = sha256_of(result)
            d = sched.begin_admission(result, digest)
            if d.kind == "admit":
                assert d.lease is not None
                rec = AdmittedRecord(step=0, result=result, lease=d.lease, admitted_at=t, result_sha256=digest)
                if sched.complete_admission(rec, lease.lease_id):
                    makespan = t
            heapq.heappush(events, (t, next(seq), "request", i, None))
    check_invariants(sched)
    assert makespan is not None, "the step did not complete"
    return {
        "makespan_s": makespan,
        "leases": sched.counters["leases_granted"],
        "revoked": sched.counters["leases_revoked"],
        "expired": sched.counters["leases_expired"],
        "rejected": sum(sched.rejections.values()),
        "share": [sched.actors[a].admitted_prompts for a in actors],
    }


SPEEDS = (1.0, 0.5, 0.3)
BASE_TPS = 3000.0


@dataclass
class Scenario:
    """One step on a drifting fleet where one actor dies: everything a policy comparison needs."""

    fleet: Fleet
    spec: StepSpec
    lengths: dict[str, list[int]]
    tokens: float
    death_at: float
    ideal: float


def scenario(seed: int, prompts: int = 256, group: int = 4, drift_period: float = 10.0,
             speeds: tuple[float, ...] = SPEEDS, dies: int = 1, death_fraction: float = 0.4) -> Scenario:
    """Speeds ``speeds`` x 3,000 tok/s drifting +-30%; actor ``dies`` stops at ``death_fraction`` of the step."""
    rng = random.Random(seed)
    spec, lengths = make_step(rng, prompts, group)
    work = float(sum(sum(v) for v in lengths.values()))
    factors = [[rng.uniform(0.7, 1.3) for _ in range(1000)] for _ in speeds]
    base = [BASE_TPS * s for s in speeds]
    death_at = death_fraction * Fleet(base, factors, drift_period, {}).ideal(work)
    fleet = Fleet(base, factors, drift_period, {dies: death_at})
    return Scenario(fleet=fleet, spec=spec, lengths=lengths, tokens=work, death_at=death_at, ideal=fleet.ideal(work))
