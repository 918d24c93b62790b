"""What the ranks of a sharded publisher tell each other, as typed records, and the collectives.

Per version: rank 0 answers :class:`Go` (its claim renewed, or why not); every rank sends rank 0
its :class:`RankReport` (its segments and keyframe parts, the chunks it encoded, its digest
share, or why it failed); rank 0 commits through the writer core and broadcasts the
:class:`Outcome`. Opening and resuming have their own records (:class:`Opened`,
:class:`ResumeStatus`). Records travel pickled by torch.distributed's object collectives, so they
hold plain data only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from deltarl.pipeline.manifest import DeltaStatsRecord, KeyframePart, ObjectRef, StateDigest
from deltarl.pipeline.shard_digest import ShardHashes

#: (name, dtype, global shape) of one tensor as a rank sees it
SpecRow = tuple[str, str, tuple[int, ...]]
#: (tensor name, first element, element count)
Range = tuple[str, int, int]


@dataclass(frozen=True)
class Opened:
    """Rank 0's answer to opening the run: where it stands, or why it cannot be opened."""

    error: str | None
    writer_id: str = ""
    epoch: int = 0
    keyframe_interval: int = 1
    digest_interval: int = 1
    next_version: int = 0
    head_id: str | None = None
    #: whether the next version's manifest records a digest even off its interval (a resume, when asked)
    digest_on_resume: bool = False


@dataclass(frozen=True)
class Go:
    """Rank 0's go (claim renewed) or stop for one version."""

    error: str | None = None


@dataclass(frozen=True)
class RankReport:
    """One rank's part of a version, for rank 0 to check and commit (or the reason it failed)."""

    error: str | None
    specs: tuple[SpecRow, ...] = ()
    ranges: tuple[Range, ...] = ()
    chunks: tuple[Range, ...] = ()
    bases: tuple[str, ...] = ()
    changed: int = 0
    digest: ShardHashes | None = None
    segments: tuple[ObjectRef, ...] = ()
    parts: tuple[KeyframePart, ...] = ()


@dataclass(frozen=True)
class Outcome:
    """What rank 0 committed (the same on every rank), or why the version was not committed."""

    error: str | None
    version_id: str = ""
    manifest_key: str = ""
    kind: str = "delta"
    stats: DeltaStatsRecord | None = None
    segment_keys: tuple[str, ...] = ()
    keyframe_keys: tuple[str, ...] = ()
    state_digest: StateDigest | None = None
    keyframe_bytes: int = 0
    commit_s: float = 0.0


@dataclass(frozen=True)
class ResumeStatus:
    """Rank 0's replay of the version a sharded job resumes from: the dtypes of the rows it sends,
    or why every rank fails the version."""

    error: str | None
    dtypes: dict[str, str] = field(default_factory=dict)


class Collectives:
    """The object collectives of one process group, rooted at its rank 0."""

    def __init__(self, dist: Any, group: Any) -> None:
        self.dist = dist
        self.group = group
        self.rank: int = dist.get_rank(group)
        self.world: int = dist.get_world_size(group)
        self.root: int = dist.get_global_rank(group, 0) if group is not None else 0

    def bcast(self, obj: Any) -> Any:
        box = [obj]
        self.dist.broadcast_object_list(box, src=self.root, group=self.group)
        return box[0]

    def gather(self, obj: Any) -> list[Any] | None:
        out: list[Any] | None = [None] * self.world if self.rank == 0 else None
        self.dist.gather_object(obj, out, dst=self.root, group=self.group)
        return out

    def global_rank(self, rank: int) -> int:
        return int(self.dist.get_global_rank(self.group, rank)) if self.group is not None else rank


def describe_errors(reports: list[RankReport]) -> str | None:
    """The ranks' errors, grouped (``"ranks 1, 3: …; rank 2: …"``), or None if every rank succeeded."""
    errors: dict[str, list[int]] = {}
    for rank, r in enumerate(reports):
        if r.error is not None:
            errors.setdefault(r.error, []).append(rank)
    if not errors:
        return None
    return "; ".join(f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}: {e}" for e, rs in errors.items())
