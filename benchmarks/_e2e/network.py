"""The emulated multi-region network: an origin in the trainer region, one relay per actor region.

::

    trainer ─put─▶ origin store (local dir) ◀─ origin relay (its HTTP face, trainer region)
                                                   ▲  one emulated WAN link per actor region
                                                   │  (delay RTT/2 each way, per-connection
                                                   │   window, one shared rate per direction)
                                  region relay r ──┘  (cut-through, long-poll, cache)
                                        ▲  loopback (the region's LAN)
                                   actor fetcher r  (relay first, the origin over the WAN second)

Every byte an actor region receives crosses its link once, whoever asks for it (the region relay
pulls one copy), so ``LinkStats`` of each link are the bytes over that WAN link.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from pathlib import Path

from deltarl.netem import EmulatedLink
from deltarl.storage import LocalStore
from deltarl.storage.relay import RelayConfig, RelayServer

log = logging.getLogger(__name__)

#: Relay pull grain and fetch range: request overheads do not shrink with the model, so these
#: stay fixed (see scale.py); both are small enough that a scaled delta spans several streams.
PIECE_BYTES = 64 << 10
RANGE_BYTES = 256 << 10
STREAMS = 4
#: Upstream streams of a region relay per object: enough that windows/RTT exceeds the link rate.
PULL_STREAMS = 8


@dataclass
class Region:
    name: str
    link: EmulatedLink
    relay: RelayServer

    @property
    def sources(self) -> list[str]:
        """Where this region's actors read: their relay, then the origin across the WAN."""
        return [self.relay.url, self.link.url]


class Network:
    """Build with ``async with Network(root, regions, rate_bps, rtt_s, window_bytes)``."""

    def __init__(self, root: Path, regions: int, *, rate_bps: float, rtt_s: float, window_bytes: int) -> None:
        self.root = root
        self.n_regions = regions
        self.rate_bps = rate_bps
        self.rtt_s = rtt_s
        self.window_bytes = window_bytes
        self.origin = LocalStore(str(root / "origin"))
        self.origin_relay: RelayServer | None = None
        self.regions: list[Region] = []
        self._stack = contextlib.AsyncExitStack()

    def _config(self, name: str) -> RelayConfig:
        return RelayConfig(
            cache_dir=str(self.root / f"cache-{name}"), piece_bytes=PIECE_BYTES, pull_streams=PULL_STREAMS,
            poll_interval_s=0.01, head_ttl_s=0.05,
        )  # fmt: skip

    async def __aenter__(self) -> Network:
        origin_relay = await self._stack.enter_async_context(RelayServer(self.origin, self._config("origin")))
        self.origin_relay = origin_relay
        for i in range(self.n_regions):
            name = f"region-{i + 1}"
            link = EmulatedLink(
                origin_relay.host, origin_relay.port, rate_bps=self.rate_bps, rtt_s=self.rtt_s,
                window_bytes=self.window_bytes, chunk_bytes=64 << 10,
            )  # fmt: skip
            await self._stack.enter_async_context(link)
            relay = await self._stack.enter_async_context(RelayServer(link.url, self._config(name)))
            self.regions.append(Region(name, link, relay))
        log.info("network: origin relay %s, %d regions at %.1f Mbit/s, RTT %.1f ms, window %d B",
                 origin_relay.url, self.n_regions, self.rate_bps / 1e6, self.rtt_s * 1e3, self.window_bytes)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._stack.aclose()

    def link_bytes(self) -> dict[str, int]:
        """Bytes each WAN link has carried so far (both directions)."""
        return {r.name: r.link.stats.down + r.link.stats.up for r in self.regions}
