"""Typed settings of one relay (pydantic): every field documented and bounds-checked when loaded.

:class:`RelayConfig` is how a relay behaves (cache, pulls, long-polls); :class:`RelayProcessConfig`
adds where ``deltarl relay`` pulls from and listens, and is what a deployment file's
``relays: <region>:`` section holds (:meth:`RelayProcessConfig.load`). Byte sizes may be written
``"8G"``, ``"512MiB"`` or as integers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from deltarl import defaults
from deltarl.configfile import load_model, parse_bytes


class RelayConfig(BaseModel):
    """How a relay caches, pulls from upstream and answers long-polls."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    cache_dir: str = Field(min_length=1, description="directory of the on-disk cache (survives restarts)")
    cache_bytes: int = Field(default=8 << 30, ge=0, description="cached bytes past which least-recently-used objects go")
    token: str | None = Field(
        default=None, min_length=1,
        description="bearer token that authorises pushes (PUT/DELETE); None: refused unless allow_anonymous_push",
    )
    allow_anonymous_push: bool = Field(default=False, description="accept pushes without a token (loopback tests, demos)")
    upstream_token: str | None = Field(default=None, description="token presented when forwarding pushes to an upstream relay")
    piece_bytes: int = Field(default=1 << 20, ge=4096, description="grain of upstream pulls, and of cut-through")
    pull_streams: int = Field(default=4, ge=1, le=64, description="pieces of one object in flight upstream (TCP streams over a WAN)")
    upstream_connections: int = Field(
        default=32, ge=1, le=1024, description="connections kept to an upstream relay (long-polls hold one each)"
    )
    head_ttl_s: float = Field(default=0.2, ge=0, le=60, description="how long a fetched HEAD serves every poller (coalescing)")
    poll_interval_s: float = Field(default=0.05, ge=0.001, le=10, description="how often a long-poll asks a store upstream again")
    max_wait_s: float = Field(default=120.0, ge=0, le=3600, description="longest ?wait= honoured, in seconds")
    cut_through: bool = Field(default=True, description="serve bytes while they arrive (False: store-and-forward baseline)")
    verify: bool = Field(default=True, description="check segments and keyframes against their manifest's piece hashes before caching")
    integrity_hold_s: float = Field(
        default=10.0, ge=0, le=3600,
        description="how long a key whose upstream bytes failed their manifest is answered 502 (integrity) at once, without pulling it again",
    )
    check_on_serve: bool = Field(
        default=True,
        description="check a cached object against its manifest's pieces on every whole-object response (a second pass over those bytes, ~0.2 s CPU per GB; ranges never)",
    )

    @field_validator("cache_bytes", "piece_bytes", mode="before")
    @classmethod
    def _byte_size(cls, value: Any) -> Any:
        return parse_bytes(value) if isinstance(value, str) else value


class RelayProcessConfig(RelayConfig):
    """One ``deltarl relay`` process: a :class:`RelayConfig` plus its upstream and listen address."""

    upstream: str = Field(
        min_length=1, description="a store URL (path, file://, s3://bucket/prefix) or another relay (http://host:port)"
    )
    listen: str = Field(default=defaults.RELAY_LISTEN, pattern=r"^.*:\d+$", description="HOST:PORT to serve on")

    @classmethod
    def load(cls, path: str | Path | None, region: str | None, **overrides: Any) -> RelayProcessConfig:
        """The ``relays: <region>:`` section of a deployment file (or only ``overrides`` when ``path`` is
        None), then the non-None ``overrides``; bad content raises ``ConfigError``."""
        return load_model(cls, path, ("relays", region) if region else "relay", overrides)
