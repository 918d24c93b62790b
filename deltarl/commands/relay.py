"""``deltarl relay``: a regional relay (cache, cut-through, long-poll, fan-out) in front of a store
or another relay."""

from __future__ import annotations

import argparse
import os
import re

HELP = "serve a run namespace from a bounded cache in front of a store or another relay (ranged HTTP, cut-through, long-poll)"

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)?\s*$", re.IGNORECASE)


def parse_bytes(text: str) -> int:
    """``"8G"``, ``"512MiB"``, ``"1000000"`` → bytes (binary multiples)."""
    m = _SIZE.match(text)
    if m is None:
        raise argparse.ArgumentTypeError(f"not a byte size: {text!r}")
    scale = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}[m.group(2).lower()]
    return int(float(m.group(1)) * scale)


def parse_listen(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit():
        raise argparse.ArgumentTypeError(f"--listen wants HOST:PORT, got {text!r}")
    return host.strip("[]") or "0.0.0.0", int(port)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default=None, metavar="FILE",
                        help="deployment file: take upstream, listen, cache_dir and cache_bytes from 'relays: <REGION>:'; flags override")
    parser.add_argument("--region", default=None, help="which relay of the --config file's 'relays:' section this is")
    parser.add_argument("--upstream", default=None, metavar="URL",
                        help="where objects come from: a store URL (path, file://, s3://bucket/prefix) or another relay (http://host:port)")
    parser.add_argument("--listen", type=parse_listen, default=None, metavar="HOST:PORT",
                        help="address to serve on (default: 127.0.0.1:8470)")
    parser.add_argument("--cache-dir", default=None, metavar="DIR", help="cache directory (kept across restarts)")
    parser.add_argument("--cache-bytes", type=parse_bytes, default=None, metavar="N", help="cache budget, e.g. 50G (default: 8G)")
    parser.add_argument("--token", default=os.environ.get("DELTARL_RELAY_TOKEN"), metavar="T",
                        help="bearer token that authorises pushes (default: $DELTARL_RELAY_TOKEN; none: pushes refused)")
    parser.add_argument("--upstream-token", default=os.environ.get("DELTARL_UPSTREAM_TOKEN"), metavar="T",
                        help="token to forward pushes to an upstream relay (default: $DELTARL_UPSTREAM_TOKEN)")
    parser.add_argument("--piece-bytes", type=parse_bytes, default=1 << 20, metavar="N", help="upstream pull grain (default: 1M)")
    parser.add_argument("--pull-streams", type=int, default=4, metavar="N", help="pieces of one object in flight upstream (default: 4)")
    parser.add_argument("--head-ttl", type=float, default=0.2, metavar="S", help="HEAD coalescing window in seconds (default: 0.2)")
    parser.add_argument("--no-cut-through", action="store_true", help="store-and-forward (for comparison only)")
    parser.add_argument("--no-serve-check", action="store_true",
                        help="do not re-hash cached objects on whole-object responses (saves CPU; clients still verify)")


def _apply_deployment(args: argparse.Namespace) -> None:
    """Fill unset flags from the deployment file's ``relays: <region>:`` section, then the defaults."""
    from deltarl.configfile import load_section
    from deltarl.errors import ConfigError

    conf: dict[str, object] = {}
    if args.config:
        if not args.region:
            raise ConfigError("--config needs --region (which relay of the 'relays:' section to run)")
        conf = load_section(args.config, "relays", args.region)
    args.upstream = args.upstream or conf.get("upstream")
    args.cache_dir = args.cache_dir or conf.get("cache_dir")
    if not args.upstream or not args.cache_dir:
        raise ConfigError("give --upstream and --cache-dir (or --config FILE --region NAME)")
    if args.listen is None:
        args.listen = parse_listen(str(conf.get("listen", "127.0.0.1:8470")))
    if args.cache_bytes is None:
        args.cache_bytes = parse_bytes(str(conf.get("cache_bytes", 8 << 30)))


def run(args: argparse.Namespace) -> int:
    import asyncio
    import logging
    import signal

    from deltarl.errors import DeltaRLError
    from deltarl.relay import RelayConfig, RelayServer

    log = logging.getLogger("deltarl.relay")
    try:
        _apply_deployment(args)
        config = RelayConfig(
            cache_dir=args.cache_dir, cache_bytes=args.cache_bytes, token=args.token, upstream_token=args.upstream_token,
            piece_bytes=args.piece_bytes, pull_streams=args.pull_streams, head_ttl_s=args.head_ttl,
            cut_through=not args.no_cut_through, check_on_serve=not args.no_serve_check,
        )
    except (DeltaRLError, argparse.ArgumentTypeError) as err:
        print(f"deltarl relay: {err}")
        return 2
    host, port = args.listen

    async def serve() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        server = RelayServer(args.upstream, config, host=host, port=port)
        await server.start()
        print(f"deltarl relay: serving {args.upstream} on {server.url} (cache {args.cache_dir}, {args.cache_bytes} bytes)", flush=True)
        log.info("metrics at %s/metrics", server.url)
        try:
            await stop.wait()
        finally:
            await server.stop()

    asyncio.run(serve())
    return 0
