"""Writes infra/grafana/dashboards/deltarl.json (run from the repository root after changing a panel).

python infra/grafana/make_dashboard.py
"""

from __future__ import annotations

import json

DS = {"type": "prometheus", "uid": "deltarl-prometheus"}
panels = []
y = 0
pid = 0
def row(title: str) -> None:
    global y, pid
    pid += 1
    panels.append({"id": pid, "type": "row", "title": title, "collapsed": False, "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}})
    y += 1
def ts(title: str, targets: list[tuple[str, str]], unit: str = "short", w: int = 8, x: int = 0, h: int = 8,
       kind: str = "timeseries", desc: str = "") -> None:
    global pid
    pid += 1
    p = {"id": pid, "type": kind, "title": title, "description": desc, "datasource": DS,
         "gridPos": {"h": h, "w": w, "x": x, "y": y},
         "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
         "targets": [{"refId": chr(65 + i), "expr": e, "legendFormat": legend, "datasource": DS} for i, (e, legend) in enumerate(targets)]}
    panels.append(p)
def q(metric: str, p: float, by: str = "instance") -> str:
    return f"histogram_quantile({p}, sum by (le, {by}) (rate({metric}_bucket[5m])))"

row("Trainer / publisher")
ts("Latest version", [("deltarl_publisher_version", "version"), ("deltarl_trainer_step", "step")], kind="stat", w=4, h=4)
ts("Reward", [("deltarl_trainer_reward_mean", "reward mean")], w=4, x=4, h=4, kind="stat")
ts("Changed fraction per version", [("deltarl_publisher_changed_fraction", "changed")], unit="percentunit", w=8, x=8)
ts("Delta bytes per second (to the store)", [("rate(deltarl_publisher_delta_bytes_total[5m])", "delta"),
                                              ("rate(deltarl_publisher_keyframe_bytes_total[5m])", "keyframes")], unit="Bps", w=8, x=16)
y += 8
ts("Publish seconds per version (p50 / p90)", [(q("deltarl_publisher_encode_seconds", 0.5, "job"), "encode p50"),
                                               (q("deltarl_publisher_upload_seconds", 0.5, "job"), "upload p50"),
                                               (q("deltarl_publisher_commit_seconds", 0.5, "job"), "commit p50"),
                                               (q("deltarl_publisher_publish_seconds", 0.9, "job"), "whole publish p90")], unit="s", w=12)
ts("Training step and result wait (p50)", [(q("deltarl_trainer_train_seconds", 0.5, "job"), "train"),
                                           (q("deltarl_trainer_wait_seconds", 0.5, "job"), "wait for results")], unit="s", w=12, x=12)
y += 8
row("Actors and followers")
ts("Version held", [("deltarl_actor_version", "actor {{instance}}"), ("deltarl_follower_version", "follower {{instance}}"),
                    ("deltarl_publisher_version", "published")], w=8)
ts("Publish -> staged (p50 / p99)", [(q("deltarl_actor_publish_to_staged_seconds", 0.5), "p50 {{instance}}"),
                                    (q("deltarl_actor_publish_to_staged_seconds", 0.99), "p99 {{instance}}"),
                                    (q("deltarl_follower_publish_to_staged_seconds", 0.5), "follower p50 {{instance}}")], unit="s", w=8, x=8)
ts("Commit pause (p99)", [(q("deltarl_actor_commit_pause_seconds", 0.99), "{{instance}}"),
                          (q("deltarl_follower_commit_pause_seconds", 0.99), "follower {{instance}}")], unit="s", w=8, x=16)
y += 8
ts("Bytes fetched by source", [("sum by (source) (rate(deltarl_actor_fetched_bytes_total[5m]))", "{{source}}"),
                               ("sum by (source) (rate(deltarl_follower_fetched_bytes_total[5m]))", "follower {{source}}")],
   unit="Bps", w=8, desc="Which relay (or the origin store) served the weights: the origin line should stay near 0")
ts("Fetch trouble", [("sum(rate(deltarl_actor_fetch_retries_total[5m]))", "retries"),
                     ("sum(rate(deltarl_actor_fetch_failovers_total[5m]))", "failovers"),
                     ("sum(rate(deltarl_actor_fetch_integrity_refetches_total[5m]))", "integrity refetches"),
                     ("sum(rate(deltarl_actor_commit_failures_total[5m]))", "commit failures")], w=8, x=8)
ts("Results by outcome", [("sum by (outcome) (rate(deltarl_actor_results_total[5m]))", "{{outcome}}")], w=8, x=16)
y += 8
row("Relays")
ts("WAN bytes in (upstream) vs served", [("sum by (region) (rate(deltarl_relay_upstream_bytes_total[5m]))", "upstream {{region}}"),
                                         ("sum by (region) (rate(deltarl_relay_served_bytes_total[5m]))", "served {{region}}")], unit="Bps", w=8)
ts("Cache hits / misses", [("sum by (region) (rate(deltarl_relay_cache_hits_total[5m]))", "hits {{region}}"),
                           ("sum by (region) (rate(deltarl_relay_cache_misses_total[5m]))", "misses {{region}}")], w=8, x=8)
ts("Long-polls waiting, integrity failures", [("sum by (region) (deltarl_relay_waiters)", "waiters {{region}}"),
                                              ("sum(deltarl_relay_integrity_failures_total)", "integrity failures")], w=8, x=16)
y += 8
row("Coordinator")
ts("Actors alive", [("deltarl_coordinator_actors{alive=\"true\"}", "alive"), ("deltarl_coordinator_actors{alive=\"false\"}", "lost")], w=8)
ts("Actor throughput (EMA tokens/s)", [("deltarl_coordinator_actor_tokens_per_second", "{{actor}} {{region}}")], w=8, x=8)
ts("Rejected results by reason", [("sum by (reason) (rate(deltarl_coordinator_rejections_total[5m]))", "{{reason}}")], w=8, x=16)
y += 8
dash = {"uid": "deltarl", "title": "deltarl", "tags": ["deltarl"], "timezone": "browser", "schemaVersion": 39, "version": 1,
        "refresh": "10s", "time": {"from": "now-1h", "to": "now"}, "editable": True, "panels": panels,
        "templating": {"list": []}, "annotations": {"list": []}}
with open("infra/grafana/dashboards/deltarl.json", "w") as fh:
    fh.write(json.dumps(dash, indent=2) + "\n")
print(f"{len(panels)} panels")
