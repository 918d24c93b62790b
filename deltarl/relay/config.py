"""Typed settings of one relay; every field is documented and bounds-checked at construction."""

from __future__ import annotations

from dataclasses import dataclass

from deltarl.errors import ConfigError


@dataclass(frozen=True)
class RelayConfig:
    """How a relay caches, pulls from upstream and answers long-polls."""

    #: Directory of the on-disk cache (survives restarts). Required.
    cache_dir: str
    #: Upper bound on cached bytes; least-recently-used objects are evicted past it.
    cache_bytes: int = 8 << 30
    #: Bearer token that authorises pushes (PUT/DELETE). ``None``: pushes refused unless
    #: ``allow_anonymous_push`` (only for loopback tests and demos).
    token: str | None = None
    #: Accept pushes without a token (never on a public interface).
    allow_anonymous_push: bool = False
    #: Bearer token this relay presents when it forwards pushes to an upstream relay.
    upstream_token: str | None = None
    #: Size of the ranged pieces an object is pulled from upstream in; the cut-through grain.
    piece_bytes: int = 1 << 20
    #: Pieces of one object in flight from upstream at once (several TCP streams over a WAN).
    pull_streams: int = 4
    #: Connections kept to an upstream relay (long-polls hold one each, so leave headroom).
    upstream_connections: int = 32
    #: How long a fetched mutable object (HEAD) is reused for every poller: the coalescing window.
    head_ttl_s: float = 0.2
    #: How often a long-poll for a missing object asks a store upstream again.
    poll_interval_s: float = 0.05
    #: Longest ``?wait=`` honoured, in seconds.
    max_wait_s: float = 120.0
    #: Serve bytes of an object while it is still arriving (False: store-and-forward, a baseline).
    cut_through: bool = True
    #: Check segments and keyframes against the sha256 in their manifest before caching them.
    verify: bool = True
    #: Re-hash a cached object on every whole-object response (catches on-disk corruption; costs
    #: ~1 s of CPU per 1.5-2 GB served). Ranged responses are never re-hashed: clients check.
    check_on_serve: bool = True

    def __post_init__(self) -> None:
        if not self.cache_dir:
            raise ConfigError("relay cache_dir is required")
        checks = [
            (self.cache_bytes >= 0, "cache_bytes must be >= 0"),
            (self.piece_bytes >= 4096, "piece_bytes must be >= 4096"),
            (1 <= self.pull_streams <= 64, "pull_streams must be in [1, 64]"),
            (1 <= self.upstream_connections <= 1024, "upstream_connections must be in [1, 1024]"),
            (0 <= self.head_ttl_s <= 60, "head_ttl_s must be in [0, 60]"),
            (0.001 <= self.poll_interval_s <= 10, "poll_interval_s must be in [0.001, 10]"),
            (0 <= self.max_wait_s <= 3600, "max_wait_s must be in [0, 3600]"),
        ]
        for ok, message in checks:
            if not ok:
                raise ConfigError(f"relay config: {message}")
        if self.token is not None and not self.token:
            raise ConfigError("relay token must be non-empty when given")
