"""The full-size run's processes: real ``deltarl relay`` processes, the link emulator and the actors,
each its own OS process, so CPU seconds and peak RSS are measured per role (``/proc/<pid>``).

Every child speaks JSON lines on stdout (the first line says it is ready, with its address where
it serves one) and takes commands on stdin; closing stdin ends it.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

CLK_TCK = os.sysconf("SC_CLK_TCK")


def proc_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (all its threads) so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def proc_rss(pid: int, field: str = "VmHWM") -> int:
    """``VmHWM`` (peak) or ``VmRSS`` of process ``pid`` in bytes (0 if gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def deltarl_exe() -> list[str]:
    """The ``deltarl`` console script of this interpreter's environment."""
    exe = Path(sys.executable).with_name("deltarl")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "deltarl.cli"]


class RelayProc:
    """A ``deltarl relay`` process (optionally inside network namespace ``netns``), port picked freely."""

    def __init__(self, name: str, upstream: str, cache_dir: Path, *, listen: str = "127.0.0.1:0", netns: str | None = None,
                 piece_bytes: int = 1 << 20, pull_streams: int = 8, head_ttl_s: float = 0.05) -> None:  # fmt: skip
        self.name = name
        cmd = [*deltarl_exe(), "relay", "--upstream", upstream, "--cache-dir", str(cache_dir), "--listen", listen,
               "--cache-bytes", "8G", "--piece-bytes", str(piece_bytes), "--pull-streams", str(pull_streams),
               "--head-ttl", str(head_ttl_s)]  # fmt: skip
        if netns is not None:
            cmd = ["ip", "netns", "exec", netns, *cmd]  # ip execs the command: the pid is the relay's
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        m = re.search(r" on (http://\S+) ", line)
        if m is None:
            rest = self.proc.stdout.read() if self.proc.poll() is not None else ""
            raise RuntimeError(f"relay {name} did not start: {line.strip()} {rest[-2000:]}")
        self.url = m.group(1)
        self.port = int(self.url.rsplit(":", 1)[1])
        self.killed = False

    @property
    def pid(self) -> int:
        return self.proc.pid

    def cpu_s(self) -> float:
        return proc_cpu_s(self.pid) if self.proc.poll() is None else 0.0

    def peak_rss(self) -> int:
        return proc_rss(self.pid)

    def kill(self) -> None:
        """SIGKILL: the region loses its relay at once (no clean shutdown)."""
        self.killed = True
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=20)


class Child:
    """A benchmark child process speaking JSON lines (``python -m <module> <json config>``)."""

    def __init__(self, name: str, module: str, config: dict[str, Any]) -> None:
        self.name = name
        self.config = config
        self._module = module
        self.proc: asyncio.subprocess.Process | None = None
        self.lines: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self._reader: asyncio.Task[None] | None = None
        self.ready: dict[str, Any] = {}

    async def start(self) -> dict[str, Any]:
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", self._module, json.dumps(self.config),
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, limit=1 << 24,
        )  # fmt: skip
        self._reader = asyncio.ensure_future(self._read())
        self.ready = await self.expect("ready")
        return self.ready

    async def _read(self) -> None:
        assert self.proc is not None
        assert self.proc.stdout is not None
        while line := await self.proc.stdout.readline():
            text = line.decode().strip()
            if text.startswith("{"):
                await self.lines.put(json.loads(text))
        await self.lines.put({"eof": True, "rc": await self.proc.wait()})

    async def expect(self, kind: str, timeout: float | None = None) -> dict[str, Any]:
        msg = await asyncio.wait_for(self.lines.get(), timeout)
        if kind not in msg:
            raise RuntimeError(f"{self.name}: expected {kind!r}, got {msg}")
        return msg

    def send(self, **msg: Any) -> None:
        assert self.proc is not None
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(msg) + "\n").encode())

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def cpu_s(self) -> float:
        return proc_cpu_s(self.pid) if self.proc is not None and self.proc.returncode is None else 0.0

    async def close(self) -> None:
        if self.proc is None:
            return
        if self.proc.returncode is None and self.proc.stdin is not None:
            self.proc.stdin.close()
            try:
                await asyncio.wait_for(self.proc.wait(), 60)
            except TimeoutError:
                self.proc.kill()
                await self.proc.wait()
        if self._reader is not None:
            await asyncio.gather(self._reader, return_exceptions=True)


def cleanup_dirs(paths: Sequence[Path]) -> None:
    for p in paths:
        shutil.rmtree(p, ignore_errors=True)
