"""``deltarl relay``: a regional relay (cache, cut-through, long-poll, fan-out) in front of a store
or another relay."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from deltarl import defaults
from deltarl.configfile import parse_bytes

if TYPE_CHECKING:
    from deltarl.relay.config import RelayProcessConfig

HELP = "serve a run namespace from a bounded cache in front of a store or another relay (ranged HTTP, cut-through, long-poll)"


def _byte_size(text: str) -> int:
    try:
        return parse_bytes(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from err


def parse_listen(text: str) -> tuple[str, int]:
    """``HOST:PORT`` → ``(host, port)`` (an empty host is every interface)."""
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit():
        raise argparse.ArgumentTypeError(f"--listen wants HOST:PORT, got {text!r}")
    return host.strip("[]") or "0.0.0.0", int(port)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    # Every default lives in RelayConfig / deltarl.defaults: a flag left out keeps the file's value.
    parser.add_argument("--config", default=None, metavar="FILE",
                        help="deployment file: take the fields of 'relays: <REGION>:' (upstream, listen, cache_dir, ...); flags override")
    parser.add_argument("--region", default=None, help="which relay of the --config file's 'relays:' section this is")
    parser.add_argument("--upstream", default=None, metavar="URL",
                        help="where objects come from: a store URL (path, file://, s3://bucket/prefix) or another relay (http://host:port)")
    parser.add_argument("--listen", default=None, metavar="HOST:PORT", help=f"address to serve on (default: {defaults.RELAY_LISTEN})")
    parser.add_argument("--cache-dir", default=None, metavar="DIR", help="cache directory (kept across restarts)")
    parser.add_argument("--cache-bytes", type=_byte_size, default=None, metavar="N", help="cache budget, e.g. 50G (default: 8G)")
    parser.add_argument("--token", default=None, metavar="T",
                        help=f"bearer token that authorises pushes (default: ${defaults.RELAY_TOKEN_ENV}; none: pushes refused)")
    parser.add_argument("--upstream-token", default=None, metavar="T",
                        help=f"token to forward pushes to an upstream relay (default: ${defaults.UPSTREAM_TOKEN_ENV})")
    parser.add_argument("--piece-bytes", type=_byte_size, default=None, metavar="N", help="upstream pull grain (default: 1M)")
    parser.add_argument("--pull-streams", type=int, default=None, metavar="N", help="pieces of one object in flight upstream (default: 4)")
    parser.add_argument("--head-ttl", type=float, default=None, metavar="S", help="HEAD coalescing window in seconds (default: 0.2)")
    parser.add_argument("--no-cut-through", action="store_true", help="store-and-forward (for comparison only)")
    parser.add_argument("--no-serve-check", action="store_true",
                        help="do not re-hash cached objects on whole-object responses (saves CPU; clients still verify)")


def load_config(args: argparse.Namespace) -> RelayProcessConfig:
    """The relay's config: the deployment file's section (if any), then the flags and environment."""
    from deltarl.errors import ConfigError
    from deltarl.relay.config import RelayProcessConfig

    if args.config and not args.region:
        raise ConfigError("--config needs --region (which relay of the 'relays:' section to run)")
    if not args.config and not (args.upstream and args.cache_dir):
        raise ConfigError("give --upstream and --cache-dir (or --config FILE --region NAME)")
    return RelayProcessConfig.load(
        args.config, args.region if args.config else None,
        upstream=args.upstream, listen=args.listen, cache_dir=args.cache_dir, cache_bytes=args.cache_bytes,
        token=args.token or defaults.first_env([defaults.RELAY_TOKEN_ENV]),
        upstream_token=args.upstream_token or defaults.first_env([defaults.UPSTREAM_TOKEN_ENV]),
        piece_bytes=args.piece_bytes, pull_streams=args.pull_streams, head_ttl_s=args.head_ttl,
        cut_through=False if args.no_cut_through else None, check_on_serve=False if args.no_serve_check else None,
    )


def run(args: argparse.Namespace) -> int:
    import asyncio
    import logging
    import signal

    from deltarl.errors import DeltaRLError
    from deltarl.relay.config import RelayConfig
    from deltarl.relay.runner import RelayServer

    log = logging.getLogger("deltarl.relay")
    try:
        process = load_config(args)
        host, port = parse_listen(process.listen)
    except (DeltaRLError, argparse.ArgumentTypeError) as err:
        print(f"deltarl relay: {err}")
        return 2
    config = RelayConfig(**process.model_dump(exclude={"upstream", "listen"}))

    async def serve() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        server = RelayServer(process.upstream, config, host=host, port=port)
        await server.start()
        print(f"deltarl relay: serving {process.upstream} on {server.url} "
              f"(cache {config.cache_dir}, {config.cache_bytes} bytes)", flush=True)
        log.info("metrics at %s/metrics", server.url)
        try:
            await stop.wait()
        finally:
            await server.stop()

    asyncio.run(serve())
    return 0
