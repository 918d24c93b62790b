"""The actor's configuration: one YAML/JSON file (or the ``actor:`` section of a deployment file).

Importable without torch. Flags of ``deltarl actor`` override the file's fields.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from deltarl import defaults
from deltarl.actor.backends.table import BACKENDS, BackendEntry, backend_entry
from deltarl.configfile import load_model
from deltarl.errors import ConfigError


class RegionConfig(BaseModel):
    """What actors of one region share: their relays, in order of preference."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    relays: list[str] = Field(default_factory=list, description="relay base URLs (http://host:port), nearest first")


class ActorConfig(BaseModel):
    """Everything ``deltarl actor`` needs: where the run is, whom to ask for work, how to generate."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    coordinator: str = Field(default=defaults.COORDINATOR_URL, description="base URL of the coordinator service")
    token: str | None = Field(default=None, description="actor bearer token (else $DELTARL_ACTOR_TOKEN / $DELTARL_COORDINATOR_TOKEN)")
    store: str | None = Field(default=None, description="origin store URL, the fallback after every relay; optional "
                              "when relays are given (model.json, HEAD, manifests and segments all come through them)")
    run: str = Field(default="run", description="run name; the model spec is read from <run>/model.json")
    region: str = Field(default="", description="region label, reported to the coordinator; selects 'regions[region].relays'")
    relays: list[str] = Field(default_factory=list, description="relay URLs in order of preference (overrides the region's)")
    regions: dict[str, RegionConfig] = Field(default_factory=dict, description="relays per region (deployment files)")
    streams: int = Field(default=4, ge=1, le=64, description="parallel TCP streams of the weight fetcher")
    backend: str = Field(default="hf", description=f"generation backend, by name ({', '.join(sorted(BACKENDS))}: "
                         "deltarl.actor.backends.table.BACKENDS)")
    device: str = Field(default="cpu", description="torch device of the hf backend")
    engine_options: dict[str, Any] = Field(default_factory=dict, description="the engine's keyword options (vllm: "
                                           "vllm.LLM arguments such as max_model_len, enforce_eager, tensor_parallel_size); "
                                           "a parallel size the engine cannot serve is refused here")
    throttle: float = Field(default=1.0, ge=1.0, le=1000.0, description="emulate hardware this many times slower")
    max_prompts: int | None = Field(default=None, ge=1, le=10**6, description="cap on prompts per lease (None: the coordinator decides)")
    max_batch: int = Field(default=256, ge=1, le=1 << 16, description="sequences per forward batch of the hf backend")
    seed: int = Field(default=0, ge=0, description="sampling seed (each actor should differ)")
    torch_threads: int | None = Field(default=1, ge=1, le=1024, description="torch.set_num_threads (None: torch's default)")
    idle_poll_s: float = Field(default=0.2, gt=0, le=60, description="longest sleep when the coordinator has no work")
    head_poll_s: float = Field(default=0.2, gt=0, le=60, description="how often the subscriber looks for a new version")
    bootstrap_timeout_s: float = Field(default=600.0, gt=0, description="longest wait for the run's first version")
    catch_up_timeout_s: float = Field(default=120.0, gt=0, description="longest wait for an accepted version to be staged")
    verify_digest: bool = Field(default=True, description="after a commit, check the state digest where the manifest records one")
    events: str | None = Field(default=None, description="append one JSON line per event (register, commit, result) to this file")
    state_out: str | None = Field(default=None, description="on exit, write {version, version_id, state_digest} JSON here")
    metrics_port: int | None = Field(default=None, ge=0, le=65535,
                                     description="serve Prometheus metrics at http://<metrics_host>:<port>/metrics (0: any free port)")
    metrics_host: str = Field(default="0.0.0.0", description="address the metrics endpoint binds")

    @model_validator(mode="after")
    def _check(self) -> ActorConfig:
        for url in [*self.relays, *(u for r in self.regions.values() for u in r.relays)]:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"relay URL must be http(s)://host:port, got {url!r}")
        backend_entry(self.backend).check_options(self.engine_options)
        return self

    def backend_entry(self) -> BackendEntry:
        """The backend table's row for ``backend``."""
        return backend_entry(self.backend)

    def relay_urls(self) -> list[str]:
        """Relays to try, in order: ``relays`` if given, else the region's."""
        if self.relays:
            return list(self.relays)
        region = self.regions.get(self.region)
        return list(region.relays) if region is not None else []

    def check_sources(self) -> None:
        """``ConfigError`` unless the actor has somewhere to read the run from (a relay or a store)."""
        if not self.relay_urls() and not self.store:
            raise ConfigError("give the actor at least one relay (--relay, 'relays:' or its region's) or an origin --store")

    def resolved_token(self) -> str:
        """The coordinator token from the config or the environment; ``ConfigError`` if none."""
        token = self.token or defaults.first_env(defaults.ACTOR_TOKEN_ENVS)
        if not token:
            raise ConfigError(f"give the actor's coordinator token (--token, 'token:' or ${defaults.ACTOR_TOKEN_ENV})")
        return token

    @classmethod
    def load(cls, path: str | Path | None, **overrides: Any) -> ActorConfig:
        """Read a YAML/JSON file (its ``actor:`` section if it has one), then apply non-None
        ``overrides``; errors raise ``ConfigError``. ``path=None`` starts from the defaults."""
        return load_model(cls, path, "actor", overrides)
