"""``deltarl nginx-config``: print a complete nginx.conf that makes nginx a caching relay."""

from __future__ import annotations

import argparse
import sys

HELP = "print an nginx.conf for a caching relay in front of a deltarl relay or an S3/MinIO/SeaweedFS bucket"

#: The arguments infra/nginx-relay.conf is generated with (a test checks the file matches).
EXAMPLE_ARGS = ("--upstream", "http://origin-relay.example.internal:8470", "--listen", "0.0.0.0:8470",
                "--cache-dir", "/var/cache/deltarl")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--upstream", required=True, metavar="URL",
                        help="a deltarl relay (http://host:port), or with --bucket-endpoint a bucket "
                             "endpoint http://host:port/bucket[/prefix]")
    parser.add_argument("--listen", default="0.0.0.0:8470", metavar="HOST:PORT", help="where nginx listens")
    parser.add_argument("--cache-dir", default="/var/cache/deltarl", metavar="DIR",
                        help="nginx's cache, temp files and pid file go here")
    parser.add_argument("--bucket-endpoint", action="store_true",
                        help="the upstream is an S3/MinIO/SeaweedFS bucket endpoint (anonymous reads): "
                             "paths are rewritten to /bucket/prefix/<key>")
    parser.add_argument("--max-size", default="200g", metavar="SIZE", help="cache size cap (nginx size, e.g. 200g)")


def run(args: argparse.Namespace) -> int:
    from deltarl.errors import ConfigError
    from deltarl.relay.nginx import NginxRelayConfig, nginx_config

    try:
        text = nginx_config(NginxRelayConfig(upstream=args.upstream, listen=args.listen, cache_dir=args.cache_dir,
                                             bucket=args.bucket_endpoint, max_size=args.max_size))
    except ConfigError as err:
        print(f"deltarl nginx-config: {err}", file=sys.stderr)
        return 2
    sys.stdout.write(text)
    return 0
