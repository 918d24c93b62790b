"""What ``gc --keep-last N`` keeps, checked before anything older is deleted.

The last N versions are rebuilt from the newest keyframe at or before the oldest of them plus the
deltas after it. gc is about to delete everything older than that keyframe, so it first proves the
keyframe usable and the chain from it sound: every part's bytes against its manifest's hashes
(:meth:`ObjectRef.verifier`, streamed: no state is built), the parts' ranges against run.json, the
segments of the versions between the keyframe and the oldest kept one (the same streamed check),
and every parent link from the keyframe up to the last version. A keyframe that fails is skipped
with a warning and the next older one is tried, as replay does, so gc never deletes the only
fallback of a damaged keyframe. Damage that no older keyframe can route around (a delta the kept
versions need, or no keyframe that verifies) is a :class:`RunError`: gc then removes nothing.

Deltas after the oldest kept version are not read: every kept version needs them whatever gc
deletes, so their state does not change what may go.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from deltarl.errors import FormatError, ObjectNotFound, RunError, TensorMismatch
from deltarl.pipeline.manifest import Manifest, ObjectRef
from deltarl.pipeline.reader import RunReader
from deltarl.storage.store import ObjectStore

logger = logging.getLogger(__name__)

#: Bytes per ranged read while a kept keyframe is checked (one buffer per part in flight).
CHECK_READ_BYTES = 8 << 20
#: Keyframe parts checked at once.
CHECK_WORKERS = 4

#: What a damaged object raises when read (IntegrityError is a FormatError).
DAMAGE = (FormatError, ObjectNotFound, TensorMismatch)


@dataclass
class Retention:
    """The versions ``keep_last`` keeps: from ``keyframe`` (a version that verified) onwards."""

    keyframe: int
    #: One line per keyframe that failed its check and was passed over (the object and the reason).
    damaged: list[str] = field(default_factory=list)


def verify_object(store: ObjectStore, ref: ObjectRef, named_by: str) -> None:
    """Read ``ref``'s object in ranges through its verifier; IntegrityError (naming the object) if
    its size or any piece differs from what ``named_by`` records, ObjectNotFound if it is gone."""
    try:
        size = store.head(ref.key).size
    except ObjectNotFound as err:
        raise ObjectNotFound(f"{ref.key}: missing ({named_by} names it)") from err
    verifier = ref.verifier(named_by)
    if size > ref.size:
        verifier.update(bytes(ref.size + 1))  # raises: oversized
    for start in range(0, min(size, ref.size), CHECK_READ_BYTES):
        verifier.update(store.get_range(ref.key, start, min(start + CHECK_READ_BYTES, ref.size)))
    verifier.finish()  # raises: truncated, or (v1) a whole sha256 that differs


def verify_keyframe(reader: RunReader, manifest: Manifest) -> None:
    """Check every part of ``manifest``'s keyframe by its hashes and its ranges against run.json."""
    keyframe = manifest.keyframe
    if keyframe is None:
        raise RunError(f"{manifest.key}: version {manifest.version} has no keyframe")
    if manifest.format_version >= 2:
        keyframe.check_covers(reader.info().tensors, manifest.key)
    with ThreadPoolExecutor(min(CHECK_WORKERS, len(keyframe.parts)), thread_name_prefix="deltarl-gc-check") as pool:
        for _ in pool.map(lambda part: verify_object(reader.store, part, manifest.key), keyframe.parts):
            pass


def plan_retention(reader: RunReader, last: int, keep_last: int, stored: set[int]) -> Retention | None:
    """The keyframe the last ``keep_last`` versions (up to ``last``) are kept from, checked; ``None``
    when no ``stored`` version is older than the newest keyframe they could be kept from (nothing
    would go, so nothing is read: a gc run after every step checks a keyframe only when it moves on).

    Raises:
        RunError: no keyframe at or before the oldest kept version verifies, or a delta or parent
            link the kept versions need is damaged; the message says gc removes nothing.
    """
    oldest_kept = max(0, last - keep_last + 1)
    newest = next((v for v in range(oldest_kept, -1, -1) if v in stored and reader.manifest(v)[0].keyframe), None)
    if not any(v < (oldest_kept if newest is None else newest) for v in stored):
        return None
    retention: Retention | None = None
    damaged: list[str] = []
    for version in range(oldest_kept, -1, -1):
        try:
            manifest, _ = reader.manifest(version)
        except ObjectNotFound:
            break  # removed by an earlier gc: nothing older is stored
        if manifest.keyframe is None:
            continue
        try:
            verify_keyframe(reader, manifest)
        except DAMAGE as err:
            logger.warning("gc: keyframe %d is unusable (%s); looking for an older one to keep", version, err)
            damaged.append(f"keyframe {version}: {err}")
            continue
        retention = Retention(keyframe=version, damaged=damaged)
        break
    if retention is None:
        raise RunError(f"{reader.layout.versions_prefix}: no keyframe at or before version {oldest_kept} verifies "
                       f"({'; '.join(damaged) or 'none stored'}): versions {oldest_kept}..{last} cannot be "
                       "replayed; gc removes nothing")  # fmt: skip
    _check_chain(reader, retention.keyframe, oldest_kept, last)
    return retention


def _check_chain(reader: RunReader, keyframe: int, oldest_kept: int, last: int) -> None:
    """The parent links from ``keyframe`` to ``last``, and the segments of the versions up to
    ``oldest_kept`` (the deltas that only the oldest kept versions need from that keyframe)."""
    try:
        chain = reader.chain(last, from_version=keyframe)
        for manifest, _ in chain[1 : oldest_kept - keyframe + 1]:
            for ref in manifest.segments:
                verify_object(reader.store, ref, manifest.key)
    except (*DAMAGE, RunError) as err:
        raise RunError(f"versions {oldest_kept}..{last} cannot be replayed from keyframe {keyframe}: {err}; "
                       "gc removes nothing (the run needs repair)") from err  # fmt: skip


__all__ = ["Retention", "plan_retention", "verify_keyframe", "verify_object"]
