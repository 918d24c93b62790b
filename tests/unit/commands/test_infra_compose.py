"""infra/docker-compose.yml is well formed (no Docker engine needed): every service is buildable or
pulled, references resolve, and every deltarl command in it parses with the real CLI."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from deltarl.cli import build_parser

INFRA = Path(__file__).resolve().parents[3] / "infra"
COMPOSE = INFRA / "docker-compose.yml"
#: Service keys of the Compose Specification this file may use (a subset of the spec's list).
SERVICE_KEYS = {"build", "image", "restart", "environment", "command", "entrypoint", "depends_on", "ports",
                "volumes", "healthcheck", "profiles", "extra_hosts", "user"}  # fmt: skip
CONDITIONS = {"service_started", "service_healthy", "service_completed_successfully"}


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())


def _interpolate(arg: str) -> str:
    return re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", arg)


def test_services_and_references(compose: dict[str, Any]) -> None:
    assert set(compose) <= {"services", "volumes"} | {k for k in compose if k.startswith("x-")}
    services, volumes = compose["services"], set(compose["volumes"])
    for name, svc in services.items():
        assert set(svc) <= SERVICE_KEYS, (name, set(svc) - SERVICE_KEYS)
        assert "image" in svc or "build" in svc, name
        for dep, spec in (svc.get("depends_on") or {}).items():
            assert dep in services, (name, dep)
            assert spec["condition"] in CONDITIONS
            if spec["condition"] == "service_healthy":
                assert "healthcheck" in services[dep], (name, dep)
        for vol in svc.get("volumes", []):
            source = vol.split(":")[0]
            assert source.startswith(".") or source in volumes, (name, vol)
            if source.startswith("."):
                assert (COMPOSE.parent / source).exists(), vol
        host_ports = [p.split(":")[0] for p in svc.get("ports", [])]
        assert len(host_ports) == len(set(host_ports))
    all_ports = [p.split(":")[0] for s in services.values() for p in s.get("ports", [])]
    assert len(all_ports) == len(set(all_ports)), "two services publish the same host port"


def test_deltarl_commands_parse(compose: dict[str, Any]) -> None:
    parser = build_parser()
    seen = set()
    for name, svc in compose["services"].items():
        if svc.get("build", {}).get("dockerfile") != "infra/Dockerfile":
            continue
        args = parser.parse_args([_interpolate(a) for a in svc["command"]])
        seen.add(args.command)
        if args.command == "relay":
            assert args.upstream.startswith(("s3://", "http://")), name
    assert {"relay", "coordinator"} <= seen


def _listen_port(svc: dict[str, Any]) -> int | None:
    """The port a deltarl service listens on inside its container (its --listen)."""
    cmd = svc.get("command") or []
    if "--listen" in cmd:
        return int(cmd[cmd.index("--listen") + 1].rsplit(":", 1)[1])
    return None


def test_prometheus_scrapes_every_deltarl_server_in_the_compose_file(compose: dict[str, Any]) -> None:
    services = compose["services"]
    prom = services["prometheus"]
    mounted = {v.split(":")[0]: v.split(":")[1] for v in prom["volumes"] if v.startswith(".")}
    assert mounted["./prometheus.yml"] == "/etc/prometheus/prometheus.yml"
    config = yaml.safe_load((INFRA / "prometheus.yml").read_text())
    scraped: set[str] = set()
    for job in config["scrape_configs"]:
        for group in job["static_configs"]:
            for target in group["targets"]:
                host, port = target.rsplit(":", 1)
                if host == "host.docker.internal":  # the trainer, actors and followers run on the host
                    assert "host.docker.internal:host-gateway" in prom["extra_hosts"]
                    continue
                assert host in services, (job["job_name"], target)
                assert _listen_port(services[host]) == int(port), (job["job_name"], target)
                scraped.add(host)
    listening = {name for name, svc in services.items() if _listen_port(svc) is not None}
    assert listening <= scraped, f"not scraped: {listening - scraped}"
    coordinator_job = next(j for j in config["scrape_configs"] if j["job_name"] == "deltarl-coordinator")
    assert coordinator_job["authorization"]["credentials_file"] in " ".join(prom["command"])  # /metrics wants a token


def _exported_metric_names() -> set[str]:
    """Every series name deltarl's registries expose (counters with _total, histograms with their suffixes)."""
    from deltarl.actor.metrics import WeightsMetrics
    from deltarl.relay.metrics import RelayMetrics
    from deltarl.trainer.metrics import TrainerMetrics

    names: set[str] = set()
    for registry in (RelayMetrics().registry, WeightsMetrics("actor").registry, WeightsMetrics("follower").registry,
                     TrainerMetrics().registry):
        for family in registry.collect():
            names.update(sample.name for sample in family.samples)
            names.update(f"{family.name}{sfx}" for sfx in ("_total", "_bucket", "_count", "_sum"))
    # the coordinator's collector yields families only with a live scheduler: take its declared names
    coordinator = (Path(__file__).resolve().parents[3] / "deltarl" / "coordinator" / "metrics.py").read_text()
    for kind, name in re.findall(r'(\w+)MetricFamily\("(deltarl_coordinator_\w+)"', coordinator):
        names.add(name + ("_total" if kind == "Counter" else ""))
    return names


def test_grafana_dashboard_charts_only_exported_metrics(compose: dict[str, Any]) -> None:
    import json

    dash = json.loads((INFRA / "grafana" / "dashboards" / "deltarl.json").read_text())
    exported = _exported_metric_names()
    used: set[str] = set()
    for panel in dash["panels"]:
        for target in panel.get("targets", []):
            assert target["datasource"]["uid"] == "deltarl-prometheus"
            used.update(re.findall(r"deltarl_\w+", target["expr"]))
    assert used
    assert used - exported == set(), "dashboard charts series no deltarl process exports"
    for prefix in ("deltarl_publisher_", "deltarl_actor_", "deltarl_follower_", "deltarl_relay_", "deltarl_coordinator_"):
        assert any(u.startswith(prefix) for u in used), prefix
    datasource = yaml.safe_load((INFRA / "grafana" / "provisioning" / "datasources" / "prometheus.yml").read_text())
    assert datasource["datasources"][0]["uid"] == "deltarl-prometheus"
    assert datasource["datasources"][0]["url"] == "http://prometheus:9090"
    grafana = compose["services"]["grafana"]
    assert "./grafana/dashboards:/var/lib/grafana/dashboards:ro" in grafana["volumes"]
