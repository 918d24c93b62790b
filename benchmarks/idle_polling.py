"""Idle polling and pickup: how often a follower asks while nothing is published, and how soon it
commits a version once it lands, behind each kind of server it may read from.

* ``relay``: a ``deltarl relay`` (holds ``?wait=`` requests until the object lands);
* ``plain``: a server that answers 404 at once and ignores ``?wait=`` (as nginx or plain S3 do;
  :class:`deltarl.testing.plain_http.PlainServer`);
* ``nginx``: a real nginx configured by ``deltarl nginx-config`` in front of a deltarl relay
  (skipped without nginx); requests are counted at the relay behind it.

For each: a follower bootstraps, idles ``--idle`` seconds (requests counted at the server), then
``--versions`` versions are published at random gaps (0.5-2 s) and the time from each publish
returning to the follower's commit is recorded. Targets: idle <= 5 requests/s, pickup about 1 s.

    python -m benchmarks.idle_polling [--idle 10] [--versions 5] [--quick] [--out FILE]

``--quick`` (a smoke run, seconds): 1 s idle, 2 versions at 0.1-0.3 s gaps.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

RUN = "idle"
RESULTS = Path(__file__).parent / "results" / "idle_polling.json"


def _tiny_state(seed: int) -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(256, 256, generator=g).to(torch.bfloat16), "b": torch.randn(256, generator=g)}


def _step(state: dict[str, Any], seed: int) -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(seed)
    out = {k: v.clone() for k, v in state.items()}
    mask = torch.rand(out["w"].shape, generator=g) < 0.05
    out["w"][mask] = (out["w"][mask].float() * 1.01 + 1e-3).to(torch.bfloat16)
    return out


async def _measure(kind: str, idle_s: float, versions: int, tmp: Path, gaps: tuple[float, float] = (0.5, 2.0)) -> dict[str, Any] | None:
    from deltarl.actor.follower import Follower
    from deltarl.pipeline.publisher import Publisher
    from deltarl.relay import RelayConfig, RelayServer
    from deltarl.storage import MemoryStore
    from deltarl.testing.nginx import NginxProcess, find_nginx
    from deltarl.testing.plain_http import PlainServer

    origin = MemoryStore()
    pub = Publisher(origin, RUN, segment_bytes=16 << 10)
    state = _tiny_state(0)
    pub.publish(state, step=0)
    relay: RelayServer | None = None
    plain: PlainServer | None = None
    nginx: NginxProcess | None = None
    if kind == "plain":
        plain = await PlainServer(origin).start()
        url = plain.url
    else:
        if kind == "nginx" and find_nginx() is None:
            pub.close()
            return None
        relay = await RelayServer(origin, RelayConfig(cache_dir=str(tmp / f"relay-{kind}"))).start()
        url = relay.url
        if kind == "nginx":
            nginx = await asyncio.to_thread(NginxProcess, relay.url, tmp / "nginx")
            url = nginx.url

    def count() -> float:
        if plain is not None:
            return float(plain.total)
        assert relay is not None
        return sum(v for k, v in relay.counters().items() if k.startswith("deltarl_relay_requests_total"))

    pickups: list[float] = []
    try:
        async with Follower(RUN, relays=[url], poll_wait_s=5.0) as follower:
            await follower.bootstrap()
            before = count()
            await asyncio.sleep(idle_s)
            idle = count() - before
            rng = random.Random(1)
            for v in range(1, versions + 1):
                await asyncio.sleep(rng.uniform(*gaps))
                state = _step(state, v)
                await asyncio.to_thread(pub.publish, state, step=v)
                landed = time.monotonic()
                info = await follower.follow(until_version=v)
                assert info is not None
                pickups.append(time.monotonic() - landed)
    finally:
        pub.close()
        if nginx is not None:
            nginx.stop()
        if relay is not None:
            await relay.stop()
        if plain is not None:
            await plain.stop()
    return {"server": kind, "idle_s": idle_s, "idle_requests": idle, "idle_requests_per_s": round(idle / idle_s, 2),
            "pickup_s_median": round(statistics.median(pickups), 3), "pickup_s_max": round(max(pickups), 3),
            "pickups_s": [round(p, 3) for p in pickups]}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--idle", type=float, default=10.0, help="idle seconds per server")
    parser.add_argument("--versions", type=int, default=5, help="versions published per server")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 1 s idle, 2 versions, short gaps")
    parser.add_argument("--out", type=Path, default=RESULTS, help="where the JSON goes")
    args = parser.parse_args(argv)
    gaps = (0.5, 2.0)
    if args.quick:
        args.idle, args.versions, gaps = min(args.idle, 1.0), min(args.versions, 2), (0.1, 0.3)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for kind in ("relay", "plain", "nginx"):
            row = asyncio.run(_measure(kind, args.idle, args.versions, Path(tmp), gaps))
            if row is None:
                print(f"{kind}: skipped (nginx not installed)")
                continue
            rows.append(row)
    print(f"{'server':8} {'idle req/s':>10} {'pickup median s':>16} {'pickup max s':>13}")
    for r in rows:
        print(f"{r['server']:8} {r['idle_requests_per_s']:>10} {r['pickup_s_median']:>16} {r['pickup_s_max']:>13}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    doc = {"benchmark": "idle_polling", "quick": args.quick, "rows": rows,
           "targets": {"idle_requests_per_s_max": 5, "pickup_s": 1.0}}
    args.out.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"-> {args.out}")


if __name__ == "__main__":
    main()
