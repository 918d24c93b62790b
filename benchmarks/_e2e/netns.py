"""Kernel rate limits for the e2e network (root only): the origin lives in a network namespace,
joined to the benchmark's namespace by one veth pair per actor region, each shaped with ``tbf``.

The same recipe as ``infra/netns-regions.sh`` (veth + tbf; this kernel has no netem), with the
regions' side left in the calling namespace so that one process can host every region: the origin
relay's listening socket is created inside the origin namespace (``setns`` in a short-lived
thread; a socket stays in the namespace it was made in), and region *r* reaches it through
veth *r* and its tbf, on a /30 of 198.18.0.0/15 (the range RFC 2544 sets aside for benchmarks,
so no real route is shadowed), picked per process so two runs do not collide. Delay and per-connection windows still come from the
rootless proxy (``EmulatedLink`` with no rate of its own) in front of it.
"""

from __future__ import annotations

import ctypes
import logging
import os
import shutil
import socket
import subprocess
import threading

log = logging.getLogger(__name__)

CLONE_NEWNET = 0x40000000


def available() -> bool:
    """Root, ``ip`` and ``tc`` present."""
    return os.geteuid() == 0 and shutil.which("ip") is not None and shutil.which("tc") is not None


def _run(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, text=True)


class ShapedRegions:
    """``n`` tbf-shaped veth links from this namespace to a fresh origin namespace."""

    def __init__(self, n: int, rate_bps: float, *, tag: str | None = None) -> None:
        self.n = n
        self.rate_bps = rate_bps
        self.tag = tag or f"{os.getpid() % 100000}"
        self.ns = f"e2e-origin-{self.tag}"
        self._veths: list[str] = []

    def _net(self, region: int) -> str:
        """The /30 of region ``region``: ``198.18.<block>.<4 * region>`` (at most 64 regions)."""
        if not 0 <= region < 64:
            raise ValueError("at most 64 regions")
        return f"198.{18 + os.getpid() % 2}.{(os.getpid() // 2) % 256}.{4 * region}"

    def _ip(self, region: int, host: int) -> str:
        a, b, c, d = self._net(region).split(".")
        return f"{a}.{b}.{c}.{int(d) + host}"

    def origin_ip(self, region: int) -> str:
        return self._ip(region, 1)

    def up(self) -> ShapedRegions:
        rate = f"{max(8000, int(self.rate_bps))}bit"
        limit = str(min(256 << 20, max(256 << 10, int(self.rate_bps / 8))))  # ~1 s of queue: drops stay rare
        burst = f"{max(32 << 10, int(self.rate_bps / 8 / 1000))}b"  # >= 1 ms at the rate, or a full-size link falls short
        try:
            _run("ip", "netns", "add", self.ns)
            _run("ip", "-n", self.ns, "link", "set", "lo", "up")
            for r in range(self.n):
                near, far = f"e2e{self.tag}r{r}", f"e2e{self.tag}o{r}"
                _run("ip", "link", "add", near, "type", "veth", "peer", "name", far)
                self._veths.append(near)
                _run("ip", "link", "set", far, "netns", self.ns)
                _run("ip", "addr", "add", f"{self._ip(r, 2)}/30", "dev", near)
                _run("ip", "-n", self.ns, "addr", "add", f"{self.origin_ip(r)}/30", "dev", far)
                _run("ip", "link", "set", near, "up")
                _run("ip", "-n", self.ns, "link", "set", far, "up")
                for ns_args, dev in (((), near), (("-n", self.ns), far)):
                    _run("tc", *ns_args, "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate, "burst", burst, "limit", limit)
        except subprocess.CalledProcessError as err:
            self.down()
            raise RuntimeError(f"netns setup failed: {' '.join(err.cmd)}: {err.stderr.strip()}") from err
        log.info("netns %s: %d veth links shaped to %s", self.ns, self.n, rate)
        return self

    def down(self) -> None:
        for near in self._veths:
            subprocess.run(["ip", "link", "del", near], capture_output=True)
        self._veths.clear()
        subprocess.run(["ip", "netns", "del", self.ns], capture_output=True)

    def listen_socket(self) -> socket.socket:
        """A listening TCP socket on all addresses of the origin namespace (port picked freely)."""
        out: list[socket.socket | BaseException] = []

        def make() -> None:
            try:
                libc = ctypes.CDLL(None, use_errno=True)
                with open(f"/var/run/netns/{self.ns}") as f:
                    if libc.setns(f.fileno(), CLONE_NEWNET) != 0:
                        raise OSError(ctypes.get_errno(), "setns failed")
                sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind(("0.0.0.0", 0))
                sock.listen(512)
                sock.setblocking(False)
                out.append(sock)
            except BaseException as err:  # handed to the caller's thread
                out.append(err)

        t = threading.Thread(target=make, name="e2e-setns")  # setns changes only this thread
        t.start()
        t.join()
        if isinstance(out[0], BaseException):
            raise out[0]
        return out[0]
