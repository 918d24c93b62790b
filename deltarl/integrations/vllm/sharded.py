"""The engine's ranks as one: a bootstrap, a stage and a commit that happen on every rank or on none.

``DeltaRLEngine`` calls these where one worker would act alone; with one worker they reduce to it.
Each is a collective over :class:`~deltarl.integrations.vllm.ranks.Ranks` (vLLM calls every
weight-transfer method on every worker, in the same order).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from deltarl.errors import DeltaRLError, IntegrityError, RunError, StagingError, short_pair

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Bootstrapped:
    """What a sharded bootstrap served (the fields of ``CaughtUp`` the engine reads)."""

    manifest: Any
    version_id: str
    keyframe_version: int
    deltas: int


def _refusal(ranks: Any, err: BaseException | None, oks: list[bool], what: str) -> BaseException:
    if err is not None:
        return err
    bad = [r for r, ok in enumerate(oks) if not ok]
    return StagingError(f"{what} refused on rank(s) {bad} of {ranks.size}: no rank keeps it")


def agreed(engine: Any, stage: Callable[[Any], None], update_info: Any) -> None:
    """Run ``stage(update_info)`` on this rank; keep what it staged only if every rank staged the
    same version (otherwise every rank drops it and raises: the failing rank its own error)."""
    err: BaseException | None = None
    try:
        stage(update_info)
    except Exception as e:  # reported to every rank before it is raised here
        err = e
    staged = engine._staged
    mine = (err is None, None if staged is None else staged[2])  # (ok, version id staged)
    votes = engine.ranks.gather(mine)
    if all(ok for ok, _ in votes) and len({vid for _, vid in votes}) == 1:
        return
    engine._staged = None
    if err is None and engine.served is not None:
        engine._prefetch()  # what this rank staged is dropped: stage the next version again
    raise _refusal(engine.ranks, err, [ok and vid == votes[0][1] for ok, vid in votes], "the update")


def commit_on_every_rank(ranks: Any, staged: Any) -> None:
    """Commit ``staged`` here; if any rank's commit is refused, every rank that wrote rolls back."""
    err: BaseException | None = None
    try:
        staged.commit()
    except DeltaRLError as e:
        err = e
    oks = ranks.gather(err is None)
    if all(oks):
        return
    if err is None:
        staged.rollback()
    raise _refusal(ranks, err, oks, "the commit")


def sharded_bootstrap(engine: Any, init_info: Any, call: Callable[[Any], Any]) -> Bootstrapped:
    """Load the run's version into every rank's part (keyframe then deltas, each rank reading for its
    regions), agree that every rank got there, and check the newest recorded state digest together."""
    from deltarl.updater.shards import catch_up_regions

    async def load() -> tuple[Any, str, Any, int]:
        version = init_info.version
        if version is None:
            head = await engine._source.head()
            if head is None:
                raise RunError(f"run {init_info.run!r} has no HEAD: nothing to serve yet")
            version = head.version
        manifest, vid, digest_at = await catch_up_regions(engine._source, version, engine.views, engine.placements,
                                                          engine.table, verify=init_info.verify)
        return manifest, vid, digest_at, version

    err: BaseException | None = None
    got: tuple[Any, str, Any, int] | None = None
    try:
        got = call(load())
    except Exception as e:  # every rank learns of it before it is raised
        err = e
    votes = engine.ranks.gather(None if got is None else got[1])
    if err is not None or len(set(votes)) != 1 or votes[0] is None:
        raise _refusal(engine.ranks, err, [v is not None and v == votes[0] for v in votes], "the bootstrap")
    assert got is not None
    manifest, vid, digest_at, _ = got
    if init_info.verify and digest_at is not None:
        have = engine.engine_digest()
        if have != digest_at.state_digest.value:
            shown_got, shown_rec = short_pair(have, digest_at.state_digest.value)
            raise IntegrityError(f"{digest_at.key}: the ranks' rebuilt state hashes to {shown_got}, the manifest "
                                 f"records {shown_rec}")
    keyframe = manifest.version if manifest.keyframe is not None else -1
    return Bootstrapped(manifest, vid, keyframe, 0)
