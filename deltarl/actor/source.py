"""The actor's side of the one catch-up path: a run read through the fetcher (relays, then the origin).

:class:`FetcherSource` is the :class:`~deltarl.pipeline.catch_up.VersionSource` the subscriber and
the follower catch up from: manifests (cached: they are immutable; :meth:`FetcherSource.forget`
drops them when a run's history changed), HEAD, segments verified by their pieces, and keyframes
streamed part by part straight into the tensors they fill (each part's header first, checked
against the ranges its manifest records, then its bytes by ranges, checked piece by piece: no
object-sized buffer, no second copy), two parts at a time so a relay pulls the next while the
last ranges of one arrive.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from typing import Any

from deltarl.actor.fetcher import Fetcher
from deltarl.errors import FormatError, IntegrityError, ObjectNotFound, RunError, TransferError, short_pair
from deltarl.pipeline.layout import RunLayout
from deltarl.pipeline.manifest import HeadRecord, Manifest, RunInfo, version_id

#: Keyframe parts a bootstrap fetches at once: while one part's last ranges arrive, a relay is
#: already pulling the next one from its upstream.
KEYFRAME_PARTS_IN_FLIGHT = 2

#: Manifests kept in memory (the most recently used): enough for a catch-up's chain, bounded.
MANIFESTS_KEPT = 64

#: Bytes read from the start of a keyframe part to parse its header (fetched again, whole, if longer).
HEADER_PROBE = 64 << 10


class FetcherSource:
    """One run read through ``fetcher``; every object verified against its manifest."""

    def __init__(self, fetcher: Fetcher, run: str) -> None:
        self.fetcher = fetcher
        self.layout = RunLayout(run)
        self._manifests: OrderedDict[int, tuple[Manifest, str]] = OrderedDict()
        self._info: RunInfo | None = None

    def forget(self) -> None:
        """Drop cached manifests and run.json (the run's history changed: re-created, or repaired)."""
        self._manifests.clear()
        self._info = None

    def cached(self, version: int) -> tuple[Manifest, str] | None:
        """A manifest already read, or None."""
        return self._manifests.get(version)

    async def run_info(self) -> RunInfo:
        if self._info is None:
            key = self.layout.run_json
            info = RunInfo.from_bytes(await self.fetcher.fetch_key(key), where=key)
            if info.run != self.layout.run:
                raise RunError(f"{key}: run.json names run {info.run!r}, not {self.layout.run!r}")
            self._info = info
        return self._info

    async def head(self) -> HeadRecord | None:
        try:
            got = await self.fetcher.get_mutable(self.layout.head)
        except ObjectNotFound:
            return None
        assert got is not None
        return HeadRecord.from_bytes(got[0], where=self.layout.head)

    async def manifest(self, version: int, *, wait_s: float = 0.0, expect_id: str | None = None) -> tuple[Manifest, str]:
        """A version's manifest and id (cached); ``wait_s`` long-polls one not committed yet.

        A copy that does not parse, names another run or version, or (with ``expect_id``, the id
        HEAD names) has another id, counts as its source failing: the next source is asked, so a
        relay that cached a bad or replaced manifest falls back to the origin. A cached manifest
        whose id is not ``expect_id`` is read again."""
        hit = self._manifests.get(version)
        if hit is not None and expect_id in (None, hit[1]):
            self._manifests.move_to_end(version)
            return hit
        key = self.layout.manifest(version)

        def check(data: bytes) -> None:
            manifest = Manifest.from_bytes(data, where=key)
            if manifest.run != self.layout.run or manifest.version != version:
                raise RunError(f"{key}: manifest is for run {manifest.run!r} version {manifest.version}")
            if expect_id is not None and version_id(data) != expect_id:
                got, named = short_pair(version_id(data), expect_id)
                raise IntegrityError(f"{key}: id {got} is not the id HEAD names ({named})")

        try:
            data = await self.fetcher.fetch_key(key, wait_s=wait_s, check=check)
        except TransferError as err:  # every source served a copy that does not check: say why
            if isinstance(err.__cause__, (FormatError, RunError)):
                raise err.__cause__ from None
            raise
        self._manifests[version] = (Manifest.from_bytes(data, where=key), version_id(data))
        while len(self._manifests) > MANIFESTS_KEPT:  # bounded: an engine that runs for months stays flat
            self._manifests.popitem(last=False)
        return self._manifests[version]

    async def segments(self, manifest: Manifest) -> list[bytes]:
        return [data async for _, data in self.fetcher.fetch_objects(list(manifest.segments))]  # any order

    async def keyframe(self, manifest: Manifest, into: dict[str, Any] | None) -> dict[str, Any]:
        from deltarl.pipeline.keyframe import empty_state, part_views

        if manifest.keyframe is None:
            raise RunError(f"{manifest.key}: version {manifest.version} has no keyframe")
        info = await self.run_info()
        manifest.keyframe.check_covers(info.tensors, manifest.key)
        specs = {t.name: t for t in info.tensors}
        state = into if into is not None else await asyncio.to_thread(empty_state, info.tensors)
        ahead = asyncio.Semaphore(KEYFRAME_PARTS_IN_FLIGHT)

        async def load_part(part: Any) -> None:
            async with ahead:
                head = await self.fetcher.fetch_range(part.key, 0, min(part.size, HEADER_PROBE))
                views = part_views(part, head, specs, state, named_by=manifest.key)
                if views is None:  # a header longer than the probe: fetch it whole
                    head = await self.fetcher.fetch_range(part.key, 0, 8 + int.from_bytes(head[:8], "little"))
                    views = part_views(part, head, specs, state, named_by=manifest.key)
                    assert views is not None
                await self.fetcher.fetch_into(part, views)

        tasks = [asyncio.ensure_future(load_part(part)) for part in manifest.keyframe.parts]
        try:
            await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        return state
