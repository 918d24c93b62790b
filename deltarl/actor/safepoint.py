"""The safe point of the in-place update mechanism: write a staged version into the live state,
check the digest its manifest records off the pause, roll back.

:class:`SafePoint` is the part of :class:`~deltarl.actor.subscriber.Subscriber` the caller uses
between batches (``ready``, ``commit``, ``confirm``); the subscriber stages the versions it
commits, in the background. The state digest is checked *after* the commit: the commit writes the
changed values and returns, a worker thread hashes the state while the caller generates on it, and
:meth:`SafePoint.confirm` waits for that hash; a mismatch rolls the version back (every value the
commit wrote is restored) before it raises.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import MutableMapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from deltarl.actor.updates import CommitInfo, DigestCheck, Staged, timed_digest
from deltarl.errors import IntegrityError, StagingError

log = logging.getLogger(__name__)

#: Commits kept in :attr:`SafePoint.commits` (the most recent).
COMMITS_KEPT = 256


class SafePoint:
    """Commit, confirm and roll back the staged version of ``state`` (see the module docstring)."""

    state: MutableMapping[str, Any]
    #: a backend whose served weights are a copy of ``state`` kept in step (None: ``state`` is live)
    backend: Any | None
    version: int | None
    version_id: str | None
    verify_digest: bool
    #: every commit, its entry replaced once its digest check has finished (the last COMMITS_KEPT)
    commits: list[CommitInfo]
    _check: DigestCheck | None
    _digests: ThreadPoolExecutor | None
    _staged: Staged | None
    _wake: asyncio.Event
    _error: BaseException | None
    _fatal: BaseException | None

    @property
    def running(self) -> bool:
        """Whether versions are being staged in the background (the subclass's loop)."""
        return False

    async def _stop_background(self) -> None:
        """Stop staging in the background (the subclass's loop)."""

    def _restart(self) -> None:
        """Start staging in the background again (the subclass's loop)."""

    def ready(self) -> bool:
        """Whether a version is staged and can be committed now."""
        return self._staged is not None

    @property
    def staged(self) -> Staged | None:
        """The version staged and ready to commit, or None."""
        return self._staged

    @property
    def staged_version(self) -> int | None:
        return None if self._staged is None else self._staged.version

    @property
    def staged_at(self) -> float | None:
        """Wall-clock time (``time.time()``) at which the staged version became ready, or None."""
        return None if self._staged is None else self._staged.staged_at

    @property
    def digest_pending(self) -> bool:
        """Whether the last commit's state digest check has not been confirmed yet."""
        return self._check is not None

    @property
    def fatal(self) -> BaseException | None:
        """Why the background loop stopped for good (:class:`~deltarl.errors.RunReplaced`: the run
        was re-created with another tensor table), or None while it runs."""
        return self._fatal

    @property
    def error(self) -> BaseException | None:
        """The last error of the background loop (it keeps retrying)."""
        return self._error

    def commit(self) -> CommitInfo:
        """Write the staged version into the state (call between batches). A failure part-way is
        rolled back before this raises.

        Where a delta's manifest records a state digest (and ``verify_digest``), the commit does not
        wait for it: the digest is computed in a background thread and checked by :meth:`confirm` (a
        catch-up state was checked when it was built). The
        pending check of the previous commit is settled first (waiting for it); if it mismatches,
        that version is rolled back, the version staged on top of it dropped, and this raises
        ``IntegrityError``.
        """
        staged = self._staged
        if staged is None:
            raise StagingError("nothing staged")
        self._settle()
        if not staged.full and staged.manifest.parent != self.version_id:
            self._staged = None
            self._wake.set()
            raise StagingError(f"{staged.manifest.key}: staged on {staged.manifest.parent}, we hold {self.version_id}")
        t0 = time.monotonic()
        try:
            self._write(staged)  # inside the try: a failure part-way is rolled back too
        except BaseException:
            self._undo(staged)
            self._staged = None
            self._wake.set()
            raise
        previous = (self.version, self.version_id)
        self.version, self.version_id = staged.version, staged.version_id
        self._staged = None
        self._error = None
        recorded = staged.manifest.state_digest is not None
        # a catch-up state was checked against the digest when it was built, and is copied bit for bit
        check = self.verify_digest and recorded and not staged.full
        info = CommitInfo(staged.version, staged.version_id, time.monotonic() - t0, staged.update.changed_elements,
                          True if staged.digest_checked else None, staged.stage_s, staged.staged_at, staged.full,
                          digest_pending=check)
        if check:
            if self._digests is None:
                self._digests = ThreadPoolExecutor(1, thread_name_prefix="deltarl-digest")
            self._check = DigestCheck(staged, previous, info, self._digests.submit(timed_digest, self.state, staged.manifest.state_digest.algo))  # type: ignore[union-attr]  # recorded
        self.commits.append(info)
        del self.commits[:-COMMITS_KEPT]  # bounded: a subscriber that runs for months stays flat
        self._wake.set()
        return info

    async def confirm(self) -> CommitInfo | None:
        """Wait for the last commit's state digest check; its final :class:`CommitInfo`, or None if
        no check is pending.

        If the digest differs from the manifest's (or cannot be computed) the version is rolled
        back - every value the commit wrote is restored and the subscriber holds the previous
        version again - and this raises ``IntegrityError``. Call it at the safe point, before reporting anything generated since the
        commit: a rollback writes the state.
        """
        check = self._check
        if check is None:
            return None
        await asyncio.wait([asyncio.wrap_future(check.future)])
        if check is not self._check:  # settled by a commit meanwhile
            return None
        if check.matches() or not self.running:
            return self._settle()
        await self._stop_background()  # it may be staging the next version against the state we roll back
        try:
            return self._settle()
        finally:
            self._restart()

    def _settle(self) -> CommitInfo | None:
        """Finish the pending digest check (waiting for it); a mismatch rolls its version back."""
        check, self._check = self._check, None
        if check is None:
            return None
        if check.matches():
            return self._record(check.info, state_digest_ok=True, digest_s=check.future.result()[1])
        self._undo(check.staged)
        self.version, self.version_id = check.previous
        self._staged = None  # staged on top of the version just rolled back
        self._wake.set()
        self._record(check.info, state_digest_ok=False)
        err = IntegrityError(f"{check.staged.manifest.key}: state digest differs after commit; "
                             f"rolled back to version {self.version}")
        self._error = err
        raise err from check.future.exception()

    def _record(self, info: CommitInfo, **changes: Any) -> CommitInfo:
        final = dataclasses.replace(info, digest_pending=False, **changes)
        for i in range(len(self.commits) - 1, -1, -1):
            if self.commits[i] is info:
                self.commits[i] = final
                break
        return final

    def _undo(self, staged: Staged) -> None:
        try:
            staged.update.rollback()
            if self.backend is not None:
                self.backend.load_state(self.state)  # the served weights follow the restored shadow
        except StagingError as err:  # the commit's own check refused before writing anything
            log.error("rollback of version %d: %s", staged.version, err)

    def _write(self, staged: Staged) -> None:
        if self.backend is None:
            staged.update.commit()
        elif staged.full:
            staged.update.commit()  # the shadow (keeping the old values for a rollback), then the workers
            self.backend.load_state(self.state)
        else:
            self.backend.commit(staged.update)  # workers and shadow, rolled back by the backend on failure
