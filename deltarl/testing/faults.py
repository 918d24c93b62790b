"""Fault hooks for tests: kill a publishing process at a named stage of one version.

:class:`CrashAt` is a :class:`~deltarl.pipeline.publisher.Publisher` ``on_progress`` hook. A test runs
a child process that builds its publisher with ``on_progress=CrashAt.from_env()`` and sets
``DELTARL_TEST_CRASH_AT=<version>:<stage>[:<k>]``; the child SIGKILLs itself at the k-th time
(default: the first) that stage of that version completes. Stages: ``segments`` (after each
segment upload), ``keyframe`` (after the keyframe upload), ``manifest`` (after the manifest is
committed, before HEAD moves).
"""

from __future__ import annotations

import logging
import os
import signal
import threading

from deltarl import defaults

log = logging.getLogger(__name__)

CRASH_ENV = defaults.TEST_CRASH_AT_ENV


class CrashAt:
    """SIGKILL this process when ``stage`` of ``version`` has completed ``k`` times (thread-safe)."""

    def __init__(self, version: int, stage: str, k: int = 0) -> None:
        self.version = version
        self.stage = stage
        self.k = k
        self._count = 0
        self._lock = threading.Lock()

    @classmethod
    def parse(cls, spec: str) -> CrashAt:
        """``"<version>:<stage>[:<k>]"`` → a hook; ``ValueError`` names a malformed spec."""
        parts = spec.split(":")
        if len(parts) not in (2, 3) or not parts[0].isdigit() or not parts[1] or (len(parts) == 3 and not parts[2].isdigit()):
            raise ValueError(f"{CRASH_ENV} wants <version>:<stage>[:<k>], got {spec!r}")
        return cls(int(parts[0]), parts[1], int(parts[2]) if len(parts) == 3 else 0)

    @classmethod
    def from_env(cls) -> CrashAt | None:
        """The hook ``$DELTARL_TEST_CRASH_AT`` describes, or ``None`` when it is unset."""
        spec = os.environ.get(CRASH_ENV, "")
        return cls.parse(spec) if spec else None

    def __call__(self, version: int, stage: str) -> None:
        if version != self.version or stage != self.stage:
            return
        with self._lock:
            self._count += 1
            if self._count >= self.k:
                log.warning("%s: killing this process at version %d %s %d", CRASH_ENV, version, stage, self._count)
                os.kill(os.getpid(), signal.SIGKILL)
