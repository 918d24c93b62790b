"""Prometheus exposition of the coordinator's state (``GET /metrics``), read from the scheduler on scrape."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from deltarl.coordinator.scheduler import Scheduler


class SchedulerCollector(Collector):
    """Gauges and counters computed from a live scheduler at each scrape (no bookkeeping of its own)."""

    def __init__(self) -> None:
        self.scheduler: Scheduler | None = None

    def collect(self) -> Iterator[Metric]:
        sched = self.scheduler
        if sched is None:
            return
        alive = GaugeMetricFamily("deltarl_coordinator_actors", "registered actors by liveness", labels=["alive"])
        alive.add_metric(["true"], sum(a.alive for a in sched.actors.values()))
        alive.add_metric(["false"], sum(not a.alive for a in sched.actors.values()))
        yield alive
        speed = GaugeMetricFamily("deltarl_coordinator_actor_tokens_per_second",
                                  "EMA of each live actor's measured tokens/s (the prior if unmeasured)",
                                  labels=["actor", "region"])
        for aid, a in sorted(sched.actors.items()):
            if a.alive:
                speed.add_metric([aid, a.record.region], sched.rate_of(aid))
        yield speed
        prompts = GaugeMetricFamily("deltarl_coordinator_step_prompts", "prompts of open steps by state",
                                    labels=["step", "state"])
        for n in sched.open_steps():
            st = sched.steps[n]
            prompts.add_metric([str(n), "pool"], len(st.pool))
            prompts.add_metric([str(n), "leased"], len(st.leased))
            prompts.add_metric([str(n), "admitted"], len(st.admitted))
        yield prompts
        events = CounterMetricFamily("deltarl_coordinator_events", "scheduler events since start", labels=["event"])
        for name, value in sorted(sched.counters.items()):
            events.add_metric([name], value)
        yield events
        rejected = CounterMetricFamily("deltarl_coordinator_rejections", "results not admitted, by reason",
                                       labels=["reason"])
        for reason, value in sorted(sched.rejections.items()):
            rejected.add_metric([reason], value)
        yield rejected


class CoordinatorMetrics:
    """A private registry (no process-wide state) exposing one coordinator's scheduler."""

    def __init__(self) -> None:
        self.collector = SchedulerCollector()
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self.collector)

    def render(self, scheduler: Scheduler) -> bytes:
        self.collector.scheduler = scheduler
        return generate_latest(self.registry)
