"""examples/deployment.yaml: every process's section loads with its own config class."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from deltarl.actor.config import ActorConfig
from deltarl.commands import relay
from deltarl.coordinator.config import CoordinatorConfig
from deltarl.errors import ConfigError
from deltarl.relay.config import RelayProcessConfig
from deltarl.trainer.config import TrainerConfig

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "deployment.yaml"


def test_every_section_loads() -> None:
    trainer = TrainerConfig.load(EXAMPLE)
    coordinator = CoordinatorConfig.load(EXAMPLE)
    actor_eu = ActorConfig.load(EXAMPLE, region="eu-west", throttle=2.0)
    assert trainer.run == coordinator.run == actor_eu.run
    assert trainer.store == coordinator.store == actor_eu.store
    assert trainer.coordinator.url == actor_eu.coordinator
    assert coordinator.service.port == int(actor_eu.coordinator.rsplit(":", 1)[1])
    assert actor_eu.relay_urls() == ["http://127.0.0.1:8482", "http://127.0.0.1:8481"]
    assert actor_eu.throttle == 2.0
    assert ActorConfig.load(EXAMPLE, region="us-east").relay_urls() == ["http://127.0.0.1:8481"]


def _relay_args(*argv: str) -> RelayProcessConfig:
    parser = argparse.ArgumentParser()
    relay.add_arguments(parser)
    return relay.load_config(parser.parse_args(list(argv)))


def test_relay_sections_chain_the_regions() -> None:
    us = _relay_args("--config", str(EXAMPLE), "--region", "us-east")
    eu = _relay_args("--config", str(EXAMPLE), "--region", "eu-west", "--cache-bytes", "1G")
    assert us.upstream == TrainerConfig.load(EXAMPLE).store
    assert eu.upstream == f"http://{us.listen}"
    assert eu.cache_bytes == 1 << 30
    assert us.cache_bytes == 4 << 30
    with pytest.raises(ConfigError, match="no section 'mars'"):
        _relay_args("--config", str(EXAMPLE), "--region", "mars")
    with pytest.raises(ConfigError, match="--upstream"):
        _relay_args("--listen", "127.0.0.1:0")
