"""Child processes of the demo: started as ``python -m deltarl.cli …``, logged to files, always stopped.

Children run in their own session (a terminal's Ctrl-C reaches only the demo, which then stops them
in order) and, on Linux, get SIGKILL if the demo itself dies (``PR_SET_PDEATHSIG``), so no relay,
coordinator or actor outlives it.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from deltarl.errors import ChildError

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # runs in the child between fork and exec
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)



class Child:
    """One ``deltarl`` subcommand in a child process, its output in ``log_path``."""

    def __init__(self, name: str, args: Sequence[str], log_path: Path, env: dict[str, str] | None = None) -> None:
        self.name = name
        self.log_path = log_path
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        cmd = [sys.executable, "-m", "deltarl.cli", *args]
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        preexec: Callable[[], None] | None = _die_with_parent if sys.platform.startswith("linux") else None
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=full_env,
                                     start_new_session=True, preexec_fn=preexec)
        log.info("started %s (pid %d): %s", name, self.proc.pid, " ".join(args))

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_for(self, pattern: str, timeout: float = 60.0) -> re.Match[str]:
        """Wait until the child's output matches ``pattern``; ``ChildError`` if it exits or times out."""
        rx = re.compile(pattern)
        deadline = time.monotonic() + timeout
        while True:
            m = rx.search(self.output())
            if m is not None:
                return m
            if not self.alive:
                raise ChildError(f"{self.name} exited with {self.proc.returncode}:\n{self.output()[-2000:]}")
            if time.monotonic() > deadline:
                raise ChildError(f"{self.name} not ready after {timeout:.0f}s:\n{self.output()[-2000:]}")
            time.sleep(0.05)

    def terminate(self) -> None:
        """Ask the child to stop (SIGTERM); see :meth:`wait`."""
        if self.alive:
            self.proc.send_signal(signal.SIGTERM)

    def wait(self, timeout: float = 20.0) -> int:
        """Wait for the child to exit, SIGKILL it after ``timeout``; return its exit status."""
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            log.warning("%s (pid %d) did not stop in %.0fs; killing it", self.name, self.proc.pid, timeout)
            self.proc.kill()
            return self.proc.wait(timeout=10)
        finally:
            if not self._log.closed:
                self._log.close()

    def stop(self, timeout: float = 20.0) -> int:
        self.terminate()
        return self.wait(timeout)


def stop_all(children: Sequence[Child], timeout: float = 20.0) -> dict[str, int]:
    """SIGTERM every child at once, then wait for each (SIGKILL past ``timeout``)."""
    for c in children:
        c.terminate()
    return {c.name: c.wait(timeout) for c in children}
