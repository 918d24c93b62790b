"""WeightsMetrics: commits, failures, results and the fetcher's counters as Prometheus reads them."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from deltarl.actor.events import CommitTiming
from deltarl.actor.metrics import WeightsMetrics
from deltarl.exposition import MetricsServer


def _scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(url, timeout=10) as resp:
        text = resp.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def test_commits_results_and_bytes_by_source_over_http() -> None:
    m = WeightsMetrics("follower")
    stats = {"bytes_by_source": {"http://relay-a:8470": 1000}, "objects": 2, "retries": 1, "failovers": 0,
             "integrity_refetches": 0}
    m.follow_fetcher(lambda: stats)
    m.bootstrapped(4)
    m.committed(CommitTiming(version=5, version_id="v5", publish_to_staged_s=0.3, publish_to_commit_s=0.7,
                             pause_ms=2.0, digest_checked=True))
    m.record_commit(6, publish_to_staged_s=None, publish_to_commit_s=1.2, pause_s=0.004)
    m.commit_failed()
    m.result("admitted")
    m.result("stale_version")
    with MetricsServer(m.registry, port=0, host="127.0.0.1") as server:
        first = _scrape(server.url)
        stats["bytes_by_source"]["s3://runs"] = 50  # counters are read from the fetcher at each scrape
        second = _scrape(server.url)
    assert first[("deltarl_follower_version", ())] == 6
    assert first[("deltarl_follower_commits_total", ())] == 2
    assert first[("deltarl_follower_commit_failures_total", ())] == 1
    assert first[("deltarl_follower_publish_to_staged_seconds_count", ())] == 1
    assert first[("deltarl_follower_publish_to_commit_seconds_sum", ())] == 0.7 + 1.2
    assert first[("deltarl_follower_commit_pause_seconds_bucket", (("le", "0.0025"),))] == 1
    assert first[("deltarl_follower_results_total", (("outcome", "stale_version"),))] == 1
    assert first[("deltarl_follower_fetch_retries_total", ())] == 1
    assert first[("deltarl_follower_fetched_bytes_total", (("source", "http://relay-a:8470"),))] == 1000
    assert second[("deltarl_follower_fetched_bytes_total", (("source", "s3://runs"),))] == 50


def test_server_frees_its_port_on_close() -> None:
    import socket

    server = MetricsServer(WeightsMetrics().registry, port=0, host="127.0.0.1")
    port = server.port
    server.close()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))  # free again
