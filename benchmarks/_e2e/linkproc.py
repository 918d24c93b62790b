"""The link emulator of the full-size run, in its own process: one ``EmulatedLink`` per region (the
delay and per-connection window; the rate is the kernel's tbf on the veth behind it).

    python -m benchmarks._e2e.linkproc '{"targets": [["198.18.0.1", 8080]], "rtt_s": 0.05, "window_bytes": 2097152}'

Prints ``{"ready": true, "urls": [...]}``; each stdin line ``{"stats": 1}`` is answered with the bytes
each link has carried (down, up); closing stdin ends it.
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

from deltarl.testing.wan import EmulatedLink


async def main(cfg: dict[str, Any]) -> None:
    links = [EmulatedLink(host, port, rate_bps=cfg.get("rate_bps"), rtt_s=cfg["rtt_s"], window_bytes=cfg["window_bytes"],
                          chunk_bytes=cfg.get("chunk_bytes", 256 << 10)) for host, port in cfg["targets"]]  # fmt: skip
    for link in links:
        await link.start()
    print(json.dumps({"ready": True, "urls": [link.url for link in links]}), flush=True)
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    while line := await reader.readline():
        msg = json.loads(line)
        if "stats" in msg:
            print(json.dumps({"stats": [[link.stats.down, link.stats.up] for link in links]}), flush=True)
    for link in links:
        await link.close()


if __name__ == "__main__":
    asyncio.run(main(json.loads(sys.argv[1])))
