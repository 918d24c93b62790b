"""An emulated wide-area link: a TCP proxy on loopback that behaves like a long, thin pipe.

Each direction of each proxied connection is modelled as:

* **one-way delay** ``rtt_s / 2``: bytes read at *t* are written on at *t + rtt/2*;
* **window**: at most ``window_bytes`` unacknowledged bytes per connection and direction; an
  "ack" returns one RTT after the bytes were sent, so one stream moves at most
  ``window_bytes / rtt_s`` — the way a TCP stream with a capped window is RTT-bound;
* **shared rate**: every connection's bytes in one direction pass one serializer at ``rate_bps``
  (a token bucket with no burst), so N streams share the link as they would a real bottleneck.

Faults for tests: :meth:`kill` (drop every connection and refuse new ones — a dead relay or a cut
link), :meth:`stall` (stop forwarding for a while), ``truncate_after`` (cut the next connection
that carries that many bytes downstream — a truncated response). Asyncio timers limit accuracy to
about a millisecond; keep ``rate_bps`` such that a 64 KiB chunk takes well over that.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from dataclasses import dataclass
from types import TracebackType

log = logging.getLogger(__name__)


@dataclass
class LinkStats:
    """Bytes carried by a link (``down``: target → client; ``up``: client → target)."""

    down: int = 0
    up: int = 0
    connections: int = 0


class _Serializer:
    """The shared bottleneck of one direction: each send books the next free slot on the wire."""

    def __init__(self, rate_bps: float | None) -> None:
        self.rate_bps = rate_bps
        self._free_at = 0.0

    async def send(self, n: int) -> float:
        """Wait until ``n`` bytes have been clocked out; return that time (monotonic)."""
        now = time.monotonic()
        if not self.rate_bps:
            return now
        done_at = self._free_at = max(now, self._free_at) + n * 8 / self.rate_bps
        await asyncio.sleep(done_at - now)
        return done_at


class _Conn:
    def __init__(self, link: EmulatedLink, client: tuple[asyncio.StreamReader, asyncio.StreamWriter]) -> None:
        self.link = link
        self.client = client
        self.target: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        self.tasks: list[asyncio.Task[None]] = []
        self.down_bytes = 0

    def abort(self) -> None:
        for _, writer in (self.client, self.target) if self.target else (self.client,):
            if writer.transport is not None:
                writer.transport.abort()
        for task in self.tasks:
            task.cancel()


class EmulatedLink:
    """A TCP proxy to ``target_host:target_port`` that emulates a WAN link. Use as ``async with``."""

    def __init__(
        self,
        target_host: str,
        target_port: int,
        *,
        rate_bps: float | None = None,
        rtt_s: float = 0.0,
        window_bytes: int | None = None,
        host: str = "127.0.0.1",
        chunk_bytes: int = 64 << 10,
    ) -> None:
        self.target_host = target_host
        self.target_port = target_port
        self.rate_bps = rate_bps
        self.rtt_s = rtt_s
        self.window_bytes = window_bytes
        self.host = host
        self.port = 0
        self.chunk_bytes = chunk_bytes
        self.stats = LinkStats()
        #: Cut the next connection once it has carried this many bytes downstream (one-shot).
        self.truncate_after: int | None = None
        self._down = _Serializer(rate_bps)
        self._up = _Serializer(rate_bps)
        self._server: asyncio.Server | None = None
        self._conns: set[_Conn] = set()
        self._dead = False
        self._stalled_until = 0.0

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def start(self) -> EmulatedLink:
        self._server = await asyncio.start_server(self._accept, self.host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def close(self) -> None:
        for conn in list(self._conns):
            conn.abort()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None
        tasks = [t for c in self._conns for t in c.tasks]
        await asyncio.gather(*tasks, return_exceptions=True)
        self._conns.clear()

    async def __aenter__(self) -> EmulatedLink:
        return await self.start()

    async def __aexit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        await self.close()

    # --- faults -----------------------------------------------------------------------------------

    def kill(self) -> None:
        """Drop every open connection and refuse new ones (until :meth:`revive`)."""
        self._dead = True
        for conn in list(self._conns):
            conn.abort()

    def revive(self) -> None:
        self._dead = False

    def stall(self, seconds: float) -> None:
        """Forward nothing for ``seconds`` (connections stay open)."""
        self._stalled_until = time.monotonic() + seconds

    # --- proxying ---------------------------------------------------------------------------------

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._dead:
            writer.transport.abort()
            return
        conn = _Conn(self, (reader, writer))
        self._conns.add(conn)
        self.stats.connections += 1
        try:
            conn.target = await asyncio.open_connection(self.target_host, self.target_port)
        except OSError as err:
            log.info("emulated link: cannot reach %s:%d: %s", self.target_host, self.target_port, err)
            writer.transport.abort()
            self._conns.discard(conn)
            return
        conn.tasks = [
            asyncio.ensure_future(self._pipe(conn, reader, conn.target[1], self._up, down=False)),
            asyncio.ensure_future(self._pipe(conn, conn.target[0], writer, self._down, down=True)),
        ]
        try:
            await asyncio.gather(*conn.tasks)
        except (OSError, asyncio.CancelledError):
            conn.abort()
        finally:
            for _, w in (conn.client, conn.target):
                w.close()
            self._conns.discard(conn)

    async def _pipe(self, conn: _Conn, src: asyncio.StreamReader, dst: asyncio.StreamWriter, wire: _Serializer, *, down: bool) -> None:
        delay = self.rtt_s / 2
        window = self.window_bytes
        queue: deque[tuple[float, bytes]] = deque()
        have_data = asyncio.Event()
        window_open = asyncio.Event()
        window_open.set()
        inflight = 0
        loop = asyncio.get_running_loop()

        def ack(n: int) -> None:
            nonlocal inflight
            inflight -= n
            window_open.set()

        async def deliver() -> None:
            while True:
                while not queue:
                    have_data.clear()
                    await have_data.wait()
                at, data = queue.popleft()
                wait = at - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                if not data:
                    with contextlib.suppress(OSError):
                        dst.write_eof()
                    return
                dst.write(data)
                await dst.drain()

        sender = asyncio.ensure_future(deliver())
        try:
            while True:
                budget = self.chunk_bytes
                if window is not None:
                    while inflight >= window:
                        window_open.clear()
                        await window_open.wait()
                    budget = min(budget, window - inflight)
                data = await src.read(budget)
                stall = self._stalled_until - time.monotonic()
                if stall > 0:
                    await asyncio.sleep(stall)
                if not data:
                    queue.append((time.monotonic() + delay, b""))
                    have_data.set()
                    break
                sent_at = await wire.send(len(data))
                if down:
                    self.stats.down += len(data)
                    conn.down_bytes += len(data)
                    limit = self.truncate_after
                    if limit is not None and conn.down_bytes >= limit:
                        self.truncate_after = None  # one-shot: cut this connection after `limit` bytes
                        keep = len(data) - (conn.down_bytes - limit)
                        if keep > 0:
                            queue.append((sent_at + delay, data[:keep]))
                            have_data.set()
                        while queue:
                            await asyncio.sleep(delay + 0.005)
                        log.info("emulated link: cut a connection after %d bytes", limit)
                        conn.abort()
                        return
                else:
                    self.stats.up += len(data)
                if window is not None:
                    inflight += len(data)
                    loop.call_at(loop.time() + (sent_at - time.monotonic()) + self.rtt_s, ack, len(data))
                queue.append((sent_at + delay, data))
                have_data.set()
            await sender
        finally:
            if not sender.done():
                sender.cancel()
                with contextlib.suppress(asyncio.CancelledError, OSError):
                    await sender
