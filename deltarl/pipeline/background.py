"""Background publishing: one publish at a time on a thread of its own, failures raised twice
(on the future, and again by the publisher's next call)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol

from deltarl.errors import PublishFailed, RunError
from deltarl.pipeline.uploads import cpu_copy

VersionInfo = Any  # the publisher's VersionInfo (not imported: the publisher imports this module)


class Publisher(Protocol):
    """What the background lane needs of its :class:`~deltarl.pipeline.publisher.Publisher`."""

    run: str
    _closed: bool

    def _publish(
        self, state_dict: Mapping[str, Any], step: int, owned: bool, allow_nonfinite: bool = False
    ) -> VersionInfo: ...

log = logging.getLogger(__name__)


class BackgroundPublishing:
    """The publisher's background lane: at most one publish in flight; a new one waits for it."""

    def __init__(self, publisher: Publisher) -> None:
        self._publisher = publisher
        self._executor: ThreadPoolExecutor | None = None
        self._inflight: Future[VersionInfo] | None = None  # cleared once a call has settled it

    def _log_failure(self, fut: Future[VersionInfo]) -> None:
        err = fut.exception()
        if err is not None:
            log.error("background publish of run %s failed: %s", self._publisher.run, err)

    def settle(self) -> VersionInfo | None:
        """Wait for the publish in flight; its VersionInfo, or PublishFailed (chained) if it failed.

        Each background publish is settled once: a failure is raised by the first call after it."""
        fut, self._inflight = self._inflight, None
        if fut is None:
            return None
        err = fut.exception()
        if err is not None:
            raise PublishFailed(f"a background publish of run {self._publisher.run!r} failed: {err}") from err
        return fut.result()

    def wait(self) -> VersionInfo | None:
        return self.settle()

    def submit(
        self, state: Mapping[str, Any], step: int, *, owned: bool, allow_nonfinite: bool = False
    ) -> Future[VersionInfo]:
        self.settle()
        if self._publisher._closed:
            raise RunError(f"publisher of run {self._publisher.run!r} is closed")
        if not owned:  # the caller may change its state as soon as we return: publish a copy of it
            state = {name: cpu_copy(value) for name, value in state.items()}
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="deltarl-publish")
        fut = self._executor.submit(self._publisher._publish, state, step, True, allow_nonfinite)
        fut.add_done_callback(self._log_failure)
        self._inflight = fut
        return fut

    def shutdown(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        self._inflight = None  # a failure not raised yet was logged when it happened
