"""A follower whose only relay goes down: it backs off (a bounded number of requests, one warning
per outage), speculates no further than the first missing segment, and recovers when the relay is
back. A stand-in that accepts each connection and closes it at once counts the attempts; it holds
the relay's port while the relay is down."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest

from deltarl.actor.follower import Follower
from deltarl.relay import RelayConfig, RelayServer
from deltarl.storage import LocalStore
from tests.fixtures.runs import TinyTrainer, states_equal

pytestmark = [pytest.mark.torch, pytest.mark.slow]

OUTAGE_S = 10.0


class Refuser:
    """Accepts TCP connections on a port and drops each at once; counts them."""

    def __init__(self) -> None:
        self.connections = 0
        self._server: asyncio.base_events.Server | None = None

    async def start(self, port: int) -> None:
        async def drop(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            self.connections += 1
            writer.transport.abort()

        self._server = await asyncio.start_server(drop, "127.0.0.1", port, reuse_address=True)

    async def stop(self) -> None:
        assert self._server is not None
        self._server.close()
        await self._server.wait_closed()


async def test_a_relay_outage_costs_few_requests_and_one_warning(tmp_path, caplog: pytest.LogCaptureFixture) -> None:
    origin = LocalStore(str(tmp_path / "store"))
    trainer = TinyTrainer(0)
    exports: list[dict[str, Any]] = []
    from deltarl.pipeline.publisher import Publisher

    def publish(pub: Publisher, step: int) -> None:
        if step:
            trainer.step()
        exports.append(trainer.export())
        pub.publish(exports[-1], step)

    config = RelayConfig(cache_dir=str(tmp_path / "cache"), poll_interval_s=0.05, head_ttl_s=0.1)
    relay = await RelayServer(origin, config).start()
    port = relay.port
    with Publisher(origin, "r", segment_bytes=4096) as pub:
        publish(pub, 0)
        publish(pub, 1)
        async with Follower("r", relays=[relay.url], poll_wait_s=2.0) as follower:
            await asyncio.wait_for(follower.follow(until_version=1), 30)
            await relay.kill()
            refuser = Refuser()
            await refuser.start(port)
            with caplog.at_level(logging.WARNING):
                follow = asyncio.ensure_future(follower.follow(until_version=3))
                publish(pub, 2)  # several segments: speculation must not walk past the first it cannot get
                await asyncio.sleep(OUTAGE_S)
            await refuser.stop()
            warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
            assert refuser.connections <= 100, f"{refuser.connections} requests during a {OUTAGE_S:.0f} s outage"
            assert len(warnings) <= 5, [r.getMessage() for r in warnings]
            relay = await RelayServer(origin, config, port=port).start()
            publish(pub, 3)
            await asyncio.wait_for(follow, 60)
            assert follower.version == 3
            assert states_equal(follower.state, exports[3])
    await relay.stop()
