"""Rebuild any committed version bit for bit from the store, and squash a range into one delta.

``replay`` starts from the nearest keyframe at or before the version, then applies each version's
delta in order. A keyframe that is damaged (missing, wrong sha256, unreadable, wrong digest) is
skipped with a warning naming it: replay falls back to an older keyframe plus the deltas after it
(every version, keyframes included, also stores its delta). Every manifest's parent link and
every object's sha256 are checked, and (with ``verify``) the newest state digest the chain records;
any failure raises before the state is returned, so a caller never holds a half-replayed state.

One digest is enough: each delta is staged against the state it was encoded from (the commit
checks every changed position still holds its old bits), so a state that went wrong at any
earlier version either fails a later commit or is still wrong at the newest recorded digest.
Checking every recorded digest would cost a whole-state hash pass each (``digest_interval``
versions apart) and prove nothing more about the state returned.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from deltarl.codec.heap import trim
from deltarl.codec.jit_warmup import warm_codec_quietly
from deltarl.errors import FormatError, IntegrityError, ObjectNotFound, RunError, TensorMismatch, short_pair
from deltarl.pipeline.manifest import Manifest
from deltarl.pipeline.reader import RunReader
from deltarl.storage.store import ObjectStore

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

FETCH_WORKERS = 8


def _check_digest(state: Any, manifest: Manifest) -> None:
    from deltarl.codec import state_digest

    recorded = manifest.state_digest
    if recorded is None:
        return
    got = state_digest(state, recorded.algo)
    if got != recorded.value:
        shown_got, shown_recorded = short_pair(got, recorded.value)
        raise IntegrityError(
            f"{manifest.key}: replayed state digest {shown_got} ({recorded.algo}) differs from the recorded {shown_recorded}"
        )


def _check_keyframe_digest(state: Any, manifest: Manifest) -> None:
    """A v1 keyframe's digest is checked; a v2 keyframe was verified piece by piece against its
    manifest as it was read, and its parts cover run.json exactly once, so hashing the same bytes
    again would prove nothing more (one sha256 pass per object read)."""
    if manifest.format_version < 2:
        _check_digest(state, manifest)


@contextmanager
def _progress(total: int, enabled: bool, desc: str) -> Iterator[Any]:
    if not enabled:
        yield None
        return
    from tqdm import tqdm

    with tqdm(total=total, desc=desc, unit="version") as bar:
        yield bar


def apply_versions(
    reader: RunReader,
    state: Any,
    chain: list[tuple[Manifest, str]],
    *,
    verify: bool = True,
    progress: bool = False,
) -> None:
    """Apply the deltas of ``chain[1:]`` in place onto ``state``, which must hold ``chain[0]``.

    Each version's segments are fetched in parallel and checked before any byte is applied; a
    version is applied all or nothing (staged, then committed). With ``verify``, the newest
    version of the chain that records a state digest is checked once it is applied.
    """
    from deltarl.codec import stage_delta

    with ThreadPoolExecutor(FETCH_WORKERS, thread_name_prefix="deltarl-replay") as pool, _progress(
        len(chain) - 1, progress, f"replay {reader.run}"
    ) as bar:
        pending = None
        check_at = max((pos for pos in range(1, len(chain)) if chain[pos][0].state_digest is not None), default=0)
        for pos in range(1, len(chain)):
            manifest, _ = chain[pos]
            parent_id = chain[pos - 1][1]
            if manifest.parent != parent_id:
                raise RunError(f"{manifest.key}: parent {manifest.parent} is not the id of version {manifest.version - 1}")
            futures = pending if pending is not None else [pool.submit(reader.segment, manifest, i) for i in range(len(manifest.segments))]
            if pos + 1 < len(chain):  # prefetch the next version while this one is applied
                nxt = chain[pos + 1][0]
                pending = [pool.submit(reader.segment, nxt, i) for i in range(len(nxt.segments))]
            else:
                pending = None
            segments = [f.result() for f in futures]
            stage_delta(state, segments, base=parent_id).commit()
            if verify and pos == check_at:
                _check_digest(state, manifest)
            if bar is not None:
                bar.update(1)


def load_base(reader: RunReader, chain: list[tuple[Manifest, str]], *, verify: bool = True
              ) -> tuple[dict[str, torch.Tensor], list[tuple[Manifest, str]]]:
    """The state of ``chain[0]``'s keyframe and the chain to apply onto it; a damaged keyframe falls
    back to the next older one (the chain grows by the versions in between), with a warning."""
    while True:
        base = chain[0][0]
        try:
            state = reader.keyframe(base)
            if verify:
                _check_keyframe_digest(state, base)
            return state, chain
        except (FormatError, ObjectNotFound, TensorMismatch) as err:  # IntegrityError is a FormatError
            key = ", ".join(p.key for p in base.keyframe.parts) if base.keyframe is not None else base.key
            if base.version == 0:
                raise
            try:
                older = reader.chain(base.version - 1)
            except RunError:
                raise err from None
            if base.parent != older[-1][1]:
                raise RunError(f"{base.key}: parent is not the id of version {base.version - 1}") from err
            logger.warning("keyframe %s is unusable (%s); falling back to keyframe %d plus %d deltas",
                           key, err, older[0][0].version, len(older) - 1 + len(chain))
            chain = older + chain


def replay(
    store: ObjectStore,
    run: str,
    version: int | None = None,
    *,
    verify: bool = True,
    progress: bool = False,
) -> dict[str, torch.Tensor]:
    """The full state of ``version`` (default: HEAD) as CPU torch tensors, checked end to end.

    Starts from the nearest keyframe at or before ``version`` and applies each delta after it.

    Args:
        store: the store the run was published to.
        run: the run's name.
        version: which version (default: the one HEAD names).
        verify: also check the newest state digest the chain records (every ``digest_interval``
            versions; a v1 keyframe's too); sha256 and the parent chain are always checked.
        progress: show a progress bar over the deltas.

    Returns:
        ``{name: tensor}``, bit for bit the state the trainer published.

    Raises:
        RunError: no such run or version; IntegrityError: an object does not match its manifest.

    Example:
        >>> state = replay(open_store("s3://bucket/runs"), "qwen-grpo", 42)  # doctest: +SKIP
        >>> model.load_state_dict(state)  # doctest: +SKIP
    """
    reader = RunReader(store, run)
    reader.info()
    if version is None:
        version = reader.head().version
    chain = reader.chain(version)
    reader.check_head(version, chain[-1][1])
    with ThreadPoolExecutor(1, thread_name_prefix="deltarl-warmup") as warming:
        if len(chain) > 1:
            warming.submit(warm_codec_quietly, [t.dtype for t in reader.info().tensors])  # while the keyframe streams in
        state, chain = load_base(reader, chain, verify=verify)
    apply_versions(reader, state, chain, verify=verify, progress=progress)
    trim()  # staged updates and segments are gone: give their memory back to the OS
    logger.info("replayed %s version %d from keyframe %d (%d deltas)", run, version, chain[0][0].version, len(chain) - 1)
    return state


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
    from deltarl.codec import encode_delta

    if from_version >= to_version:
        raise ValueError(f"squash needs from_version < to_version, got {from_version} >= {to_version}")
    reader = RunReader(store, run)
    reader.info()
    old, start = load_base(reader, reader.chain(from_version))
    apply_versions(reader, old, start)
    new = {name: t.clone() for name, t in old.items()}
    apply_versions(reader, new, reader.chain(to_version, from_version=from_version))
    return encode_delta(old, new, base=start[-1][1], segment_bytes=segment_bytes, codec=codec)
