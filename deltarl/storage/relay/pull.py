"""One object being pulled from upstream into a temporary file, readable while it arrives."""

from __future__ import annotations

import asyncio
import contextlib
import os


class Pull:
    """Progress of one upstream pull: readers wait on :meth:`changed` and read the file prefix.

    ``prefix`` bytes of the temporary file are final (contiguous from offset 0). ``done`` means all
    ``size`` bytes arrived and passed the integrity check; ``error`` means the pull failed and
    nothing more will arrive. Only the event-loop thread mutates a pull.
    """

    def __init__(self, key: str) -> None:
        self.key = key
        self.size: int | None = None
        self.etag = ""
        self.tmp_path: str | None = None
        self.prefix = 0
        self.done = False
        self.sha256: str | None = None
        self.error: BaseException | None = None
        self.joined = 0
        self._event = asyncio.Event()

    @property
    def settled(self) -> bool:
        return self.done or self.error is not None

    def changed(self) -> asyncio.Event:
        """The event the next change sets (grab it *before* checking state, then wait on it)."""
        return self._event

    def notify(self) -> None:
        event, self._event = self._event, asyncio.Event()
        event.set()

    def fail(self, error: BaseException) -> None:
        self.error = error
        if self.tmp_path is not None:
            with contextlib.suppress(FileNotFoundError):  # already moved or removed
                os.unlink(self.tmp_path)
        self.notify()

    async def wait_ready(self) -> None:
        """Return once the size is known or the pull failed."""
        while self.size is None and self.error is None:
            await self.changed().wait()
