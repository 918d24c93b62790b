"""The one catch-up path: a version's full state from the newest keyframe at or before it.

Replay, the actors' subscriber and the weights-only follower all rebuild a state the same way, and
differ only in where they read (a store, or relays then the origin) — a :class:`VersionSource`:

1. walk the manifests down from the target to the newest keyframe, every parent link checked;
   with ``verify``, also walk up from the target to HEAD, so that a manifest below HEAD edited
   into another valid one (its id no longer its child's parent) is caught;
2. load the keyframe (straight into the caller's tensors when given); one that no source delivers
   intact is skipped with a warning naming it, and the walk goes on down to an older keyframe,
   whose deltas lead back up (every version stores its delta);
3. apply each delta after it in order, all or nothing (staged against the values it was encoded
   from, then committed), the next version's segments fetched while one is applied;
4. with ``verify``, check the newest state digest the chain records: one pass at the end proves
   every step (each delta is staged against the exact values it was encoded from, so a state that
   went wrong at any version either fails a later commit or is still wrong there). A keyframe
   alone was checked piece by piece as it landed and is not hashed again.

Any failure raises before the state is returned, so a caller never holds a half-built state.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from deltarl.errors import (
    ChainBroken,
    FormatError,
    IntegrityError,
    ObjectNotFound,
    RunError,
    StoreError,
    TensorMismatch,
    TransferError,
    short_pair,
)
from deltarl.pipeline.layout import RunLayout
from deltarl.pipeline.manifest import HeadRecord, Manifest, RunInfo

logger = logging.getLogger(__name__)

Chain = list[tuple[Manifest, str]]

#: What makes a keyframe unusable from every source (so an older one is tried): missing, corrupt,
#: truncated, not the run's tensors, or undeliverable (every relay and the origin failed on it).
KEYFRAME_FAILURES: tuple[type[BaseException], ...] = (FormatError, ObjectNotFound, TensorMismatch, TransferError, StoreError)


class VersionSource(Protocol):
    """Where a catch-up reads one run from. Every read is verified by the source: manifests belong
    to the run and version asked for, segments and keyframe parts match their manifest's hashes."""

    layout: RunLayout

    async def run_info(self) -> RunInfo: ...

    async def manifest(self, version: int) -> tuple[Manifest, str]:
        """The manifest of ``version`` and its id."""
        ...

    async def head(self) -> HeadRecord | None:
        """The HEAD record, or None if the run has none."""
        ...

    async def segments(self, manifest: Manifest) -> list[bytes]:
        """Every segment of ``manifest``, verified (any order)."""
        ...

    async def keyframe(self, manifest: Manifest, into: dict[str, Any] | None) -> dict[str, Any]:
        """The full state of a keyframe version, verified, in fresh tensors or in ``into``'s."""
        ...


@dataclass(frozen=True)
class HeldState:
    """A version the caller already holds: a catch-up may start from a copy of it (``copy()``,
    made only if it is chosen) and apply the deltas after it, when they fetch fewer bytes than the
    newest keyframe and the deltas after that."""

    version: int
    version_id: str
    copy: Callable[[], dict[str, Any]]


@dataclass(frozen=True)
class CaughtUp:
    """A state rebuilt by :func:`catch_up`."""

    #: kept out of the repr: formatting a full model's tensors costs seconds (asyncio formats a
    #: finished task's result when ``asyncio.run`` restores its SIGINT handler)
    state: dict[str, Any] = field(repr=False)
    manifest: Manifest
    version_id: str
    #: the keyframe it started from (older than the newest one when that one was unusable)
    keyframe_version: int
    #: the deltas applied onto the keyframe
    deltas: int
    #: whether a state digest was checked (False: none in the chain, or a keyframe alone, verified piece by piece)
    digest_checked: bool


async def walk_down(source: VersionSource, version: int, *, down_to: int | None = None) -> Chain:
    """Manifests from ``version`` down to the newest keyframe at or before it (or down to version
    ``down_to``), ascending, each checked to be the parent its child names."""
    if down_to is not None and not 0 <= down_to <= version:
        raise ValueError(f"down_to {down_to} is not in [0, {version}]")
    chain: Chain = []
    v = version
    while True:
        manifest, vid = await source.manifest(v)
        if chain and chain[-1][0].parent != vid:
            named, has = short_pair(chain[-1][0].parent, vid)
            raise ChainBroken(f"{chain[-1][0].key}: broken parent chain: it names parent {named}, "
                              f"but {manifest.key} has id {has}")
        chain.append((manifest, vid))
        if v == down_to or (down_to is None and manifest.keyframe is not None):
            break
        if v == 0:
            raise RunError(f"{source.layout.run}: no keyframe at or before version {version}")
        v -= 1
    chain.reverse()
    return chain


async def check_up_to_head(source: VersionSource, version: int, vid: str) -> None:
    """Check that ``version`` (id ``vid``) is in the history HEAD commits to: every manifest from
    ``version + 1`` up to HEAD names the one below it as its parent. A version at or past HEAD has
    nothing above it to check (a manifest past HEAD is one a writer committed before moving HEAD)."""
    head = await source.head()
    if head is None or head.version <= version:
        if head is not None and head.version == version and head.version_id != vid:
            named, has = short_pair(head.version_id, vid)
            raise ChainBroken(f"{source.layout.head}: names id {named} for version {version}, "
                              f"but {source.layout.manifest(version)} has id {has}")
        return
    below = vid
    for v in range(version + 1, head.version + 1):
        manifest, mid = await source.manifest(v)
        if manifest.parent != below:
            named, has = short_pair(manifest.parent, below)
            raise ChainBroken(f"{manifest.key}: names parent {named}, but version {v - 1} has id {has}: "
                              f"version {version} is not in the history HEAD (version {head.version}) commits to")
        below = mid
    if below != head.version_id:
        named, has = short_pair(head.version_id, below)
        raise ChainBroken(f"{source.layout.head}: names id {named} for version {head.version}, "
                          f"but its manifest has id {has}")


async def load_base(source: VersionSource, chain: Chain, into: dict[str, Any] | None = None) -> dict[str, Any]:
    """The state of ``chain[0]``'s keyframe. One that no source delivers intact (or that does not
    load) is skipped with a warning naming it: ``chain`` is extended in place down to an older
    keyframe, whose deltas lead back up."""
    while True:
        kf = chain[0][0]
        assert kf.keyframe is not None
        try:
            return await source.keyframe(kf, into)
        except KEYFRAME_FAILURES as err:
            if kf.version == 0:
                raise
            try:
                older = await walk_down(source, kf.version - 1)
            except (RunError, FormatError, ObjectNotFound, TensorMismatch, TransferError, StoreError):
                raise err from None
            if kf.parent != older[-1][1]:
                raise ChainBroken(f"{kf.key}: parent is not the id of version {kf.version - 1}") from err
            logger.warning("keyframe of version %d (%s) is unusable (%s); falling back to keyframe %d plus %d deltas",
                           kf.version, ", ".join(kf.keyframe.keys), err, older[0][0].version, len(older) - 1 + len(chain))
            chain[:0] = older


def _digest_at(chain: Chain) -> int | None:
    """Where the one digest check goes: the newest delta of the chain whose manifest records a
    digest (a keyframe was verified piece by piece as it landed: hashing it again proves nothing)."""
    return max((i for i in range(1, len(chain)) if chain[i][0].state_digest is not None), default=None)


async def check_digest(state: dict[str, Any], manifest: Manifest) -> None:
    """IntegrityError unless ``state`` hashes to the digest ``manifest`` records."""
    from deltarl.codec.tensors import state_digest

    recorded = manifest.state_digest
    assert recorded is not None
    got = await asyncio.to_thread(state_digest, state, recorded.algo)
    if got != recorded.value:
        shown_got, shown_recorded = short_pair(got, recorded.value)
        raise IntegrityError(f"{manifest.key}: rebuilt state digest {shown_got} ({recorded.algo}) differs from the "
                             f"recorded {shown_recorded}")


async def apply_chain(
    source: VersionSource,
    state: dict[str, Any],
    chain: Chain,
    *,
    check_at: int | None = None,
    warm: Awaitable[Any] | None = None,
    on_delta: Callable[[int], None] | None = None,
    fetching: dict[int, asyncio.Task[list[bytes]]] | None = None,
) -> None:
    """Apply the deltas of ``chain[1:]`` in place onto ``state``, which holds ``chain[0]``: each
    version staged (checked) then committed, all or nothing, the next version's segments fetched
    while one is applied; the digest of ``chain[check_at]`` checked once it is applied."""
    from deltarl.codec.stager import stage_delta

    fetching = {} if fetching is None else fetching

    def prefetch(pos: int) -> None:
        if pos < len(chain) and chain[pos][0].version not in fetching:
            fetching[chain[pos][0].version] = asyncio.ensure_future(source.segments(chain[pos][0]))

    try:
        for pos in range(1, len(chain)):
            manifest, _ = chain[pos]
            parent_id = chain[pos - 1][1]
            if manifest.parent != parent_id:
                named, has = short_pair(manifest.parent, parent_id)
                raise ChainBroken(f"{manifest.key}: parent {named} is not the id of version {manifest.version - 1} ({has})")
            prefetch(pos)
            prefetch(pos + 1)  # the next version's segments while this one is decoded
            segments = await fetching.pop(manifest.version)
            if warm is not None:
                await warm
            staged = await asyncio.to_thread(stage_delta, state, segments, base=parent_id)
            del segments
            staged.commit()
            if pos == check_at:
                await check_digest(state, manifest)
            if on_delta is not None:
                on_delta(manifest.version)
    finally:
        for task in fetching.values():
            task.cancel()
        await asyncio.gather(*fetching.values(), return_exceptions=True)


def _delta_bytes(chain: Chain) -> int:
    """Bytes of the deltas of ``chain[1:]``."""
    return sum(ref.size for m, _ in chain[1:] for ref in m.segments)


async def _from_held(source: VersionSource, version: int, held: HeldState, chain: Chain) -> Chain | None:
    """The chain from ``held`` up to ``version`` when its deltas fetch fewer bytes than ``chain``
    (the newest keyframe and the deltas after it) and ``held`` is in ``version``'s history; else None."""
    if not held.version < version:
        return None
    kf = chain[0][0].keyframe
    from_keyframe = (sum(p.size for p in kf.parts) if kf is not None else 0) + _delta_bytes(chain)
    first = chain[0][0].version
    try:
        mine = chain[held.version - first :] if held.version >= first else await walk_down(source, version, down_to=held.version)
    except (ChainBroken, ObjectNotFound):
        return None  # gone from the history (a replaced or collected run): the keyframe path says why
    if mine[0][1] != held.version_id or _delta_bytes(mine) >= from_keyframe:
        return None
    return mine


async def catch_up(
    source: VersionSource,
    version: int,
    *,
    into: dict[str, Any] | None = None,
    verify: bool = True,
    warm: Callable[[], Awaitable[Any]] | None = None,
    on_delta: Callable[[int], None] | None = None,
    held: HeldState | None = None,
) -> CaughtUp:
    """The full state of ``version``, rebuilt from the newest usable keyframe at or before it.

    Args:
        source: where the run is read.
        version: the version to rebuild.
        into: tensors of run.json's table to load into (the live weights of a first bootstrap);
            default fresh ones.
        verify: check the chain up to HEAD and the newest recorded digest (hashes and parent links
            of what is read are always checked).
        warm: called once there are deltas to apply, before the keyframe loads; it starts the
            codec's JIT warm-up and returns what to await before the first decode.
        on_delta: called with each version once its delta is applied (progress).
        held: a version the caller holds, to start from when its deltas fetch less than a keyframe.

    Without ``verify``, a target that is HEAD's version is still checked to have HEAD's id (one
    read: a run replaced under its name is never rebuilt from a stale copy of its old manifests).
    """
    chain = await walk_down(source, version)
    if verify:
        await check_up_to_head(source, version, chain[-1][1])
    else:
        head = await source.head()
        if head is not None and head.version == version and head.version_id != chain[-1][1]:
            named, has = short_pair(head.version_id, chain[-1][1])
            raise ChainBroken(f"{source.layout.head}: names id {named} for version {version}, "
                              f"but {source.layout.manifest(version)} has id {has}")
    shorter = None if held is None else await _from_held(source, version, held, chain)
    if shorter is not None:
        assert held is not None
        state = await asyncio.to_thread(held.copy)
        check_at = _digest_at(shorter) if verify else None
        warming = warm() if warm is not None else None
        await apply_chain(source, state, shorter, check_at=check_at, warm=warming, on_delta=on_delta)
        return CaughtUp(state, shorter[-1][0], shorter[-1][1], held.version, len(shorter) - 1, check_at is not None)
    warming = warm() if warm is not None and len(chain) > 1 else None
    fetching: dict[int, asyncio.Task[list[bytes]]] = {}
    if len(chain) > 1:  # the first delta's segments while the keyframe streams in
        fetching[chain[1][0].version] = asyncio.ensure_future(source.segments(chain[1][0]))
    try:
        state = await load_base(source, chain, into)  # (may extend the chain down to an older keyframe)
    except BaseException:
        for task in fetching.values():
            task.cancel()
        await asyncio.gather(*fetching.values(), return_exceptions=True)
        raise
    if warming is None and warm is not None and len(chain) > 1:  # a fallback brought deltas
        warming = warm()
    check_at = _digest_at(chain) if verify else None
    await apply_chain(source, state, chain, check_at=check_at, warm=warming, on_delta=on_delta, fetching=fetching)
    last, vid = chain[-1]
    return CaughtUp(state, last, vid, chain[0][0].version, len(chain) - 1, check_at is not None)
