"""The relay's long-polls: one shared upstream poll per key that does not exist yet, however many
clients wait for it; a push or a pull that lands the key wakes them at once."""

from __future__ import annotations

import asyncio
import logging
import time

from deltarl.errors import ObjectNotFound, StoreError, TransientStoreError
from deltarl.relay.config import RelayConfig
from deltarl.relay.metrics import RelayMetrics
from deltarl.storage.aio import AsyncSource
from deltarl.storage.retry import POLL_BACKOFF
from deltarl.storage.store import ObjectInfo

log = logging.getLogger(__name__)


class _Wait:
    """One shared long-poll for a missing key; its future resolves when the key lands."""

    def __init__(self, deadline: float) -> None:
        self.deadline = deadline
        self.found: asyncio.Future[ObjectInfo] = asyncio.get_running_loop().create_future()
        self.task: asyncio.Task[None] | None = None
        self.waiters = 0



class LongPolls:
    """Waits for keys that do not exist yet. Lives in one event loop; ``close()`` it."""

    def __init__(self, upstream: AsyncSource, config: RelayConfig, metrics: RelayMetrics) -> None:
        self.upstream = upstream
        self.config = config
        self.metrics = metrics
        self._waits: dict[str, _Wait] = {}

    def __len__(self) -> int:
        return len(self._waits)

    async def close(self) -> None:
        tasks = [w.task for w in self._waits.values() if w.task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def found(self, key: str, info: ObjectInfo) -> None:
        """``key`` landed (pushed here): wake its waiters now."""
        w = self._waits.get(key)
        if w is not None and not w.found.done():
            w.found.set_result(info)

    async def wait_for(self, key: str, timeout: float) -> ObjectInfo | None:
        """Hold until ``key`` exists upstream (or is pushed here); its info, or ``None`` after ``timeout``."""
        now = time.monotonic()
        w = self._waits.get(key)
        if w is None or w.found.done():
            w = self._waits[key] = _Wait(now + timeout)
            w.task = asyncio.ensure_future(self._poll(key, w))
        w.deadline = max(w.deadline, now + timeout)
        w.waiters += 1
        self.metrics.waiters.inc()
        try:
            return await asyncio.wait_for(asyncio.shield(w.found), timeout)
        except asyncio.TimeoutError:
            return None
        except asyncio.CancelledError:
            if w.found.cancelled() and not _current_task_cancelling():
                return None  # the poll gave up at its deadline (just before ours): not found
            raise
        finally:
            self.metrics.waiters.dec()
            w.waiters -= 1
            if w.waiters == 0 and w.task is not None and not w.found.done():
                if self._waits.get(key) is w:
                    del self._waits[key]  # a later waiter starts afresh
                w.task.cancel()  # nobody waits any more (clients left): stop asking upstream

    async def _poll(self, key: str, w: _Wait) -> None:
        misses = 0  # "not found" answered sooner than asked (an nginx or S3 upstream): back off
        try:
            while not w.found.done():
                left = w.deadline - time.monotonic()
                if left <= 0:
                    break
                try:
                    self.metrics.upstream_requests.labels("wait_head").inc()
                    info = await self.upstream.head(key, wait=left)  # backs off on early 404s itself
                except ObjectNotFound:
                    early = w.deadline - time.monotonic()
                    if early > 0.05:
                        await asyncio.sleep(min(POLL_BACKOFF.delay(misses), early))
                        misses += 1
                    else:  # the source gave up just short of the deadline: hold to it, then stop
                        await asyncio.sleep(max(0.0, early))
                        break
                    continue
                except TransientStoreError as err:
                    log.info("long-poll of %s upstream failed (%s); retrying", key, err)
                    await asyncio.sleep(self.config.poll_interval_s)
                    continue
                except StoreError as err:  # not retryable: every waiter gets it
                    if not w.found.done():
                        w.found.set_exception(err)
                    break
                if not w.found.done():
                    w.found.set_result(info)
        finally:
            if self._waits.get(key) is w:
                del self._waits[key]
            if not w.found.done():
                w.found.cancel()


def _current_task_cancelling() -> bool:
    """Whether the running task itself is being cancelled (a client left), not only what it awaited."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0
