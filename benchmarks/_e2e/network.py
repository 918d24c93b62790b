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

from aiohttp import web

from deltarl.relay import RelayConfig, RelayServer
from deltarl.relay.server import create_app
from deltarl.storage import LocalStore
from deltarl.testing.wan import EmulatedLink

from .netns import ShapedRegions

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
    """Build with ``async with Network(root, regions, rate_bps, rtt_s, window_bytes)``.

    ``netns=True`` (root only, see ``_e2e/netns.py``): the origin relay listens in its own network
    namespace and each region's link rate is enforced by the kernel (tbf on a veth pair); the
    proxy then adds only the delay and the per-connection window.
    """

    def __init__(self, root: Path, regions: int, *, rate_bps: float, rtt_s: float, window_bytes: int, netns: bool = False) -> None:
        self.root = root
        self.n_regions = regions
        self.rate_bps = rate_bps
        self.rtt_s = rtt_s
        self.window_bytes = window_bytes
        self.netns = netns
        self.origin = LocalStore(str(root / "origin"))
        self.regions: list[Region] = []
        self._stack = contextlib.AsyncExitStack()

    def _config(self, name: str) -> RelayConfig:
        return RelayConfig(
            cache_dir=str(self.root / f"cache-{name}"), piece_bytes=PIECE_BYTES, pull_streams=PULL_STREAMS,
            poll_interval_s=0.01, head_ttl_s=0.05,
        )  # fmt: skip

    async def _origin_in_netns(self) -> tuple[ShapedRegions, int]:
        shaped = ShapedRegions(self.n_regions, self.rate_bps).up()
        self._stack.callback(shaped.down)
        runner = web.AppRunner(create_app(self.origin, self._config("origin")), access_log=None, shutdown_timeout=1.0)
        await runner.setup()
        self._stack.push_async_callback(runner.cleanup)
        sock = shaped.listen_socket()
        await web.SockSite(runner, sock).start()
        return shaped, int(sock.getsockname()[1])

    async def __aenter__(self) -> Network:
        shaped: ShapedRegions | None = None
        if self.netns:
            shaped, port = await self._origin_in_netns()
        else:
            origin_relay = await self._stack.enter_async_context(RelayServer(self.origin, self._config("origin")))
            port = origin_relay.port
        for i in range(self.n_regions):
            name = f"region-{i + 1}"
            link = EmulatedLink(
                shaped.origin_ip(i) if shaped else "127.0.0.1", port, rate_bps=None if shaped else self.rate_bps,
                rtt_s=self.rtt_s, window_bytes=self.window_bytes, chunk_bytes=64 << 10,
            )  # fmt: skip
            await self._stack.enter_async_context(link)
            relay = await self._stack.enter_async_context(RelayServer(link.url, self._config(name)))
            self.regions.append(Region(name, link, relay))
        log.info("network: %d regions at %.1f Mbit/s (%s), RTT %.1f ms, window %d B", self.n_regions, self.rate_bps / 1e6,
                 "tbf in a netns" if shaped else "rootless proxy", self.rtt_s * 1e3, self.window_bytes)  # fmt: skip
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._stack.aclose()

    def link_bytes(self) -> dict[str, int]:
        """Bytes each WAN link has carried so far (both directions)."""
        return {r.name: r.link.stats.down + r.link.stats.up for r in self.regions}
