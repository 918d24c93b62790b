"""Rebuild any committed version bit for bit from the store, and squash a range into one delta.

``replay`` is the store's side of the one catch-up path (:mod:`deltarl.pipeline.catch_up`): the
nearest usable keyframe at or before the version, then each version's delta in order; a damaged
keyframe (missing, corrupt, unreadable) is skipped with a warning naming it. Every manifest's
parent link, every object's hashes and (with ``verify``) the chain up to HEAD and the newest
recorded state digest are checked; any failure raises before the state is returned, so a caller
never holds a half-replayed state. The store may be any store, a relay's ``http://`` included.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, TypeVar

from deltarl.codec.heap import trim
from deltarl.codec.jit_warmup import warm_codec_quietly
from deltarl.errors import ObjectNotFound
from deltarl.pipeline.catch_up import Chain, apply_chain, catch_up, walk_down
from deltarl.pipeline.layout import RunLayout
from deltarl.pipeline.manifest import HeadRecord, Manifest, RunInfo
from deltarl.pipeline.reader import RunReader
from deltarl.storage.store import ObjectStore

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

FETCH_WORKERS = 8
T = TypeVar("T")


class StoreSource:
    """A :class:`~deltarl.pipeline.catch_up.VersionSource` over a store: the verified reads of a
    :class:`RunReader`, on a pool of ``workers`` threads (segments of a version in parallel; a
    keyframe's parts read by ranges straight into the tensors)."""

    def __init__(self, reader: RunReader, pool: ThreadPoolExecutor) -> None:
        self.reader = reader
        self.layout: RunLayout = reader.layout
        self._pool = pool

    async def _call(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def run_info(self) -> RunInfo:
        return await self._call(self.reader.info)

    async def manifest(self, version: int) -> tuple[Manifest, str]:
        return await self._call(self.reader.manifest, version)

    async def head(self) -> HeadRecord | None:
        try:
            return await self._call(self.reader.head)
        except ObjectNotFound:
            return None

    async def segments(self, manifest: Manifest) -> list[bytes]:
        return list(await asyncio.gather(*(self._call(self.reader.segment, manifest, i) for i in range(len(manifest.segments)))))

    async def keyframe(self, manifest: Manifest, into: dict[str, Any] | None) -> dict[str, Any]:
        return await self._call(self.reader.keyframe, manifest, into)


def run_blocking(make: Callable[[], Awaitable[T]]) -> T:
    """Run the coroutine ``make()`` to completion from synchronous code: on a fresh event loop in
    this thread, or on a thread of its own when this thread already runs one."""
    box: dict[str, Any] = {}

    async def boxed() -> None:
        # the task's result stays None: asyncio formats a finished main task (result included)
        # when it restores its SIGINT handler, and a model's tensors take seconds to format
        box["value"] = await make()

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        asyncio.run(boxed())
        return box["value"]

    def run() -> None:
        try:
            asyncio.run(boxed())
        except BaseException as err:
            box["error"] = err

    t = threading.Thread(target=run, name="deltarl-replay")
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


@contextmanager
def _progress(enabled: bool, desc: str) -> Iterator[Callable[[int], None] | None]:
    if not enabled:
        yield None
        return
    from tqdm import tqdm

    with tqdm(desc=desc, unit="version") as bar:
        yield lambda _version: bar.update(1)


def replay(
    store: ObjectStore,
    run: str,
    version: int | None = None,
    *,
    verify: bool = True,
    progress: bool = False,
) -> dict[str, torch.Tensor]:
    """The full state of ``version`` (default: HEAD) as CPU torch tensors, checked end to end.

    Starts from the nearest usable keyframe at or before ``version`` and applies each delta after it.

    Args:
        store: the store the run was published to (or a relay in front of it).
        run: the run's name.
        version: which version (default: the one HEAD names).
        verify: also check that the version is in the history HEAD commits to, and the newest
            state digest the chain records; hashes and parent links are always checked.
        progress: show a progress bar over the deltas.

    Returns:
        ``{name: tensor}``, bit for bit the state the trainer published.

    Raises:
        RunError: no such run or version, or a broken chain; IntegrityError: an object does not
        match its manifest, or the state its recorded digest.

    Example:
        >>> state = replay(open_store("s3://bucket/runs"), "qwen-grpo", 42)  # doctest: +SKIP
        >>> model.load_state_dict(state)  # doctest: +SKIP
    """
    reader = RunReader(store, run)
    info = reader.info()
    target = reader.head().version if version is None else version

    async def rebuild() -> Any:
        with ThreadPoolExecutor(FETCH_WORKERS, thread_name_prefix="deltarl-replay") as pool, \
                _progress(progress, f"replay {run}") as on_delta:
            def warm() -> Awaitable[None]:
                return asyncio.get_running_loop().run_in_executor(pool, warm_codec_quietly, [t.dtype for t in info.tensors])

            return await catch_up(StoreSource(reader, pool), target, verify=verify, warm=warm, on_delta=on_delta)

    done = run_blocking(rebuild)
    trim()  # staged updates and segments are gone: give their memory back to the OS
    logger.info("replayed %s version %d from keyframe %d (%d deltas)", run, target, done.keyframe_version, done.deltas)
    return done.state


def roll_forward(store: ObjectStore, run: str, state: dict[str, Any], held: int, version: int, *, verify: bool = True
                 ) -> None:
    """Apply the deltas from version ``held`` (which ``state`` holds) up to ``version``, in place,
    each checked; with ``verify``, the newest digest recorded after ``held`` too."""
    if version <= held:
        return
    reader = RunReader(store, run)

    async def forward() -> None:
        with ThreadPoolExecutor(FETCH_WORKERS, thread_name_prefix="deltarl-replay") as pool:
            source = StoreSource(reader, pool)
            chain: Chain = await walk_down(source, version, down_to=held)
            at = max((i for i in range(1, len(chain)) if chain[i][0].state_digest is not None), default=None)
            await apply_chain(source, state, chain, check_at=at if verify else None)

    run_blocking(forward)


def squash(
    store: ObjectStore,
    run: str,
    from_version: int,
    to_version: int,
    *,
    segment_bytes: int = 16 << 20,
    codec: str = "auto",
) -> list[bytes]:
    """One delta from ``from_version`` to ``to_version`` whose base is the id of ``from_version``.

    A laggard actor holding ``from_version`` fetches these segments instead of every delta in
    between; applying them yields ``to_version`` bit for bit.
    """
    from deltarl.codec.encode import encode_delta

    if from_version >= to_version:
        raise ValueError(f"squash needs from_version < to_version, got {from_version} >= {to_version}")
    old = replay(store, run, from_version)
    new = {name: t.clone() for name, t in old.items()}
    roll_forward(store, run, new, from_version, to_version)
    base = RunReader(store, run).manifest(from_version)[1]
    return encode_delta(old, new, base=base, segment_bytes=segment_bytes, codec=codec)
