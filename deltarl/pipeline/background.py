"""Background publishing: one publish at a time on a thread of its own, failures raised twice
(on the future, and again by the publisher's next call). Shared by :class:`Publisher` and
:class:`ShardedPublisher`."""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Generic, TypeVar

from deltarl.errors import PublishFailed, RunError

log = logging.getLogger(__name__)

Info = TypeVar("Info")


class BackgroundPublishing(Generic[Info]):
    """A publisher's background lane: at most one publish in flight; a new one waits for it.

    ``is_closed`` tells whether the publisher still accepts versions (checked at each submit)."""

    def __init__(self, run: str, is_closed: Callable[[], bool]) -> None:
        self._run = run
        self._is_closed = is_closed
        self._executor: ThreadPoolExecutor | None = None
        self._inflight: Future[Info] | None = None  # cleared once a call has settled it

    def _log_failure(self, fut: Future[Info]) -> None:
        err = fut.exception()
        if err is not None:
            log.error("background publish of run %s failed: %s", self._run, err)

    def settle(self) -> Info | None:
        """Wait for the publish in flight; its result, or PublishFailed (chained) if it failed.

        Each background publish is settled once: a failure is raised by the first call after it."""
        fut, self._inflight = self._inflight, None
        if fut is None:
            return None
        err = fut.exception()
        if err is not None:
            raise PublishFailed(f"a background publish of run {self._run!r} failed: {err}") from err
        return fut.result()

    def wait(self) -> Info | None:
        return self.settle()

    def check_open(self) -> None:
        """Settle the publish in flight, then refuse if the publisher is closed."""
        self.settle()
        if self._is_closed():
            raise RunError(f"publisher of run {self._run!r} is closed")

    def submit(self, publish: Callable[[], Info], on_published: Callable[[Info], None] | None = None) -> Future[Info]:
        """Run ``publish`` (one version, with everything it needs already copied) on the lane, then
        ``on_published`` with its result (on the same thread; an exception in it fails the future)."""
        self.check_open()
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="deltarl-publish")

        def run() -> Info:
            info = publish()
            if on_published is not None:
                on_published(info)
            return info

        fut = self._executor.submit(run)
        fut.add_done_callback(self._log_failure)
        self._inflight = fut
        return fut

    def shutdown(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        self._inflight = None  # a failure not raised yet was logged when it happened
