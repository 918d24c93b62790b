"""infra/docker-compose.yml is well formed (no Docker engine needed): every service is buildable or
pulled, references resolve, and every deltarl command in it parses with the real CLI."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from deltarl.cli import build_parser

COMPOSE = Path(__file__).resolve().parents[3] / "infra" / "docker-compose.yml"
#: Service keys of the Compose Specification this file may use (a subset of the spec's list).
SERVICE_KEYS = {"build", "image", "restart", "environment", "command", "entrypoint", "depends_on", "ports",
                "volumes", "healthcheck", "profiles"}  # fmt: skip
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
