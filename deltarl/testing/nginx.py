"""Run a real nginx, configured by :func:`deltarl.relay.nginx.nginx_config`, as a child process on
loopback (tests and benchmarks): its config, pid file, temp files and cache all live in one
directory, ``nginx -p DIR/ -c DIR/nginx.conf -g 'daemon off;'``; :meth:`NginxProcess.stop` ends
that child only.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

from deltarl.relay.nginx import NginxRelayConfig, nginx_config


def find_nginx() -> str | None:
    """The nginx binary on PATH or in /usr/sbin, or None."""
    found = shutil.which("nginx")
    if found is None and os.access("/usr/sbin/nginx", os.X_OK):
        found = "/usr/sbin/nginx"
    return found


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class NginxProcess:
    """One nginx in front of ``upstream`` (a relay URL, or a bucket endpoint with ``bucket=True``)."""

    def __init__(self, upstream: str, directory: str | Path, *, bucket: bool = False, binary: str | None = None) -> None:
        found = binary or find_nginx()
        if found is None:
            raise FileNotFoundError("nginx not installed (apt-get install nginx-light)")
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        for attempt in range(5):  # a port found free can be taken before nginx binds it: retry
            port = _free_port()
            conf = self.dir / "nginx.conf"
            conf.write_text(nginx_config(NginxRelayConfig(upstream, listen=f"127.0.0.1:{port}", cache_dir=str(self.dir),
                                                           bucket=bucket)))
            glob = "daemon off;" + (" user root;" if os.geteuid() == 0 else "")  # workers must reach DIR
            with (self.dir / "nginx.log").open("ab") as log:
                self.proc = subprocess.Popen([found, "-p", f"{self.dir}/", "-c", str(conf), "-g", glob],
                                             stdout=log, stderr=subprocess.STDOUT)
            self.url = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 15
            while self.proc.poll() is None and time.monotonic() < deadline:
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=1).close()
                    return
                except OSError:
                    time.sleep(0.05)
            self.stop()
            if "Address already in use" not in self.log() or attempt == 4:
                raise RuntimeError(f"nginx did not start:\n{self.log()}")

    def log(self) -> str:
        path = self.dir / "nginx.log"
        return path.read_text(errors="replace")[-3000:] if path.exists() else ""

    def stop(self) -> None:
        """Fast shutdown of this master (and its workers) only."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
