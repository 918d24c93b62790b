"""Prometheus metrics of a process that follows a run's weights (an actor, a follower), on its own registry.

What operators watch: which version the process holds, how long a version took from the trainer's
commit to staged here and to live here, the pause each commit cost, bytes fetched by source (which
relay, or the origin store), fetch retries and failovers, and, for actors, results by outcome.
Histograms are filled as commits happen; the fetch counters are read from the fetcher at each scrape.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from deltarl.actor.events import CommitTiming

#: publish -> staged / commit: from sub-second on a LAN to minutes behind a slow WAN link
LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
#: the in-place commit pause: microseconds for a tiny model, seconds for a large one
PAUSE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class _FetchCollector(Collector):
    """The fetcher's cumulative counters, read at each scrape (nothing to keep in step)."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.source: Callable[[], Mapping[str, Any]] | None = None

    def collect(self) -> Iterator[Metric]:
        stats = self.source() if self.source is not None else {}
        by_source = CounterMetricFamily(f"{self.prefix}_fetched_bytes", "Bytes of weights fetched, by source "
                                        "(relay URL or the origin store)", labels=["source"])
        for source, n in sorted((stats.get("bytes_by_source") or {}).items()):
            by_source.add_metric([source], n)
        yield by_source
        for field, text in (("objects", "Objects fetched and verified"),
                            ("retries", "Range requests retried"),
                            ("failovers", "Requests moved to the next source"),
                            ("integrity_refetches", "Objects fetched again after a hash mismatch")):
            yield CounterMetricFamily(f"{self.prefix}_fetch_{field}", text, value=int(stats.get(field, 0)))


class WeightsMetrics:
    """Metrics of the weights a process follows; ``role`` names them (``deltarl_actor_…``, ``deltarl_follower_…``)."""

    def __init__(self, role: str = "actor") -> None:
        if not role.isidentifier():
            raise ValueError(f"metrics role must be an identifier, got {role!r}")
        p = f"deltarl_{role}"
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.version = Gauge(f"{p}_version", "Version of the live weights (-1 before bootstrap)", registry=r)
        self.version.set(-1)
        self.commits = Counter(f"{p}_commits", "Versions committed into the live weights", registry=r)
        self.commit_failures = Counter(f"{p}_commit_failures", "Commits refused or rolled back", registry=r)
        self.publish_to_staged = Histogram(f"{p}_publish_to_staged_seconds", "Trainer's commit to staged here "
                                           "(wall clocks; includes clock skew)", buckets=LATENCY_BUCKETS, registry=r)
        self.publish_to_commit = Histogram(f"{p}_publish_to_commit_seconds", "Trainer's commit to live here",
                                           buckets=LATENCY_BUCKETS, registry=r)
        self.commit_pause = Histogram(f"{p}_commit_pause_seconds", "Pause of the in-place commit at the safe point",
                                      buckets=PAUSE_BUCKETS, registry=r)
        self.results = Counter(f"{p}_results", "Rollout results reported, by outcome", ["outcome"], registry=r)
        self._fetch = _FetchCollector(p)
        r.register(self._fetch)

    def follow_fetcher(self, stats: Callable[[], Mapping[str, Any]]) -> None:
        """Read fetch counters from ``stats()`` (a ``FetchStats`` as a dict) at each scrape."""
        self._fetch.source = stats

    def bootstrapped(self, version: int) -> None:
        self.version.set(version)

    def committed(self, timing: CommitTiming) -> None:
        """Record one commit of an actor."""
        self.record_commit(timing.version, publish_to_staged_s=timing.publish_to_staged_s,
                           publish_to_commit_s=timing.publish_to_commit_s, pause_s=timing.pause_ms / 1000)

    def record_commit(self, version: int, *, publish_to_staged_s: float | None, publish_to_commit_s: float | None,
                      pause_s: float) -> None:
        """Record one commit from its parts (what a follower knows of a version it committed)."""
        self.version.set(version)
        self.commits.inc()
        if publish_to_staged_s is not None:
            self.publish_to_staged.observe(max(0.0, publish_to_staged_s))
        if publish_to_commit_s is not None:
            self.publish_to_commit.observe(max(0.0, publish_to_commit_s))
        self.commit_pause.observe(pause_s)

    def commit_failed(self) -> None:
        self.commit_failures.inc()

    def result(self, outcome: str) -> None:
        """One result: ``admitted`` or the rejection reason."""
        self.results.labels(outcome).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
