"""What an actor reports about itself: per-version timings and a JSON-lines event log."""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from datetime import datetime
from typing import Any


def parse_utc(stamp: str) -> float:
    """Seconds since the epoch of a manifest's ``created_at`` (``2026-12-02T13:00:00.123Z``)."""
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


@dataclass(frozen=True)
class CommitTiming:
    """What one commit cost and how long the version took to reach this actor."""

    version: int
    version_id: str
    publish_to_staged_s: float | None
    publish_to_commit_s: float | None
    #: the whole pause at the safe point: the in-place write (the digest check runs after it)
    pause_ms: float
    #: whether the version's recorded state digest is checked against the state: in the background
    #: after the commit, before any result generated from the version is reported
    digest_checked: bool


class EventLog:
    """Appends one JSON object per line to a file (or nowhere); thread-safe."""

    def __init__(self, path: str | None, actor: str) -> None:
        self._fh = open(path, "a", buffering=1) if path else None  # noqa: SIM115 - held for the actor's life
        self._actor = actor
        self._lock = threading.Lock()

    def emit(self, event: str, **fields: Any) -> None:
        if self._fh is None:
            return
        line = json.dumps({"event": event, "t": time.time(), "actor": self._actor, **fields}, sort_keys=True)
        with self._lock:
            self._fh.write(line + "\n")

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None
