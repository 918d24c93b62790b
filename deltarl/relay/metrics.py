"""Prometheus metrics of one relay, on its own registry (tests run many relays in one process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest


class RelayMetrics:
    """Counters and gauges a relay exports at ``/metrics``."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.bytes_in = Counter("deltarl_relay_upstream_bytes", "Bytes received from upstream", registry=r)
        self.bytes_out = Counter("deltarl_relay_served_bytes", "Body bytes sent to clients", registry=r)
        self.requests = Counter("deltarl_relay_requests", "Client requests", ["method", "status"], registry=r)
        self.cache_hits = Counter("deltarl_relay_cache_hits", "Immutable objects served from the cache", registry=r)
        self.cache_misses = Counter("deltarl_relay_cache_misses", "Immutable objects that started an upstream pull", registry=r)
        self.shared_pulls = Counter("deltarl_relay_pull_joins", "Requests served from a pull already in flight", registry=r)
        self.upstream_pulls = Counter("deltarl_relay_upstream_pulls", "Whole-object pulls from upstream", registry=r)
        self.upstream_requests = Counter("deltarl_relay_upstream_requests", "Requests sent upstream", ["op"], registry=r)
        self.head_coalesced = Counter("deltarl_relay_head_coalesced", "Mutable reads answered without an upstream request", registry=r)
        self.waiters = Gauge("deltarl_relay_waiters", "Requests held in a long-poll now", registry=r)
        self.evictions = Counter("deltarl_relay_evictions", "Objects evicted from the cache", registry=r)
        self.integrity_failures = Counter("deltarl_relay_integrity_failures", "Objects whose bytes did not match their manifest", registry=r)
        self.passthrough = Counter("deltarl_relay_passthrough", "Objects served uncached: no room on the cache's disk", registry=r)
        self.cache_bytes = Gauge("deltarl_relay_cache_bytes", "Bytes held in the cache", registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)
