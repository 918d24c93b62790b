"""An engine's workers as one group: deltarl's agreements and digests over the engine's own CPU
process group (vLLM's gloo group), so that an update commits on every rank or on none.

Every call here is a collective: each of the engine's workers makes it, in the same order (vLLM's
``collective_rpc`` runs each weight-transfer call on every worker). With one worker they cost nothing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from deltarl.codec.tensors import TensorSpec
from deltarl.errors import TensorMismatch
from deltarl.updater.probe import Placement


class Ranks:
    """This worker's ``rank`` among ``size`` workers, and ``group`` (a torch.distributed CPU group)."""

    def __init__(self, group: Any = None, rank: int = 0, size: int = 1) -> None:
        self.group, self.rank, self.size = group, rank, size
        self.owned: set[str] | None = None  # the tensors whose part this rank hashes (None: all it holds)

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` (small, picklable), in rank order, on every rank."""
        if self.size == 1:
            return [obj]
        import torch.distributed as dist

        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def all_ok(self, ok: bool) -> bool:
        """Whether every rank says ``ok``."""
        return all(self.gather(bool(ok)))

    def cover(self, table: Sequence[TensorSpec], placements: Sequence[Placement] | None) -> None:
        """Check that the ranks' regions tile every tensor (TensorMismatch on every rank if not) and
        note which tensors this rank hashes for the engine's digest. ``placements`` None: this rank's
        probe failed (the others raise too, instead of waiting for it)."""
        from deltarl.updater.shards import owners

        mine = None if placements is None else {p.name: p.region for p in placements}
        every = self.gather(mine)
        failed = [r for r, regions in enumerate(every) if regions is None]
        if failed:
            raise TensorMismatch(f"the load_weights probe failed on rank(s) {failed} of {self.size}")
        self.owned = owners(table, every)[self.rank]

    def engine_digest(self, table: Sequence[TensorSpec], placements: Sequence[Placement], views: Mapping[str, Any]) -> str:
        """The state digest of the whole engine's served weights (each rank hashes the parts it owns;
        the cut blocks' bytes travel)."""
        if self.size == 1:
            from deltarl.codec.tensors import state_digest

            return state_digest(views)
        from deltarl.pipeline.shard_digest import combine_digest
        from deltarl.updater.shards import digest_shares

        owned = self.owned if self.owned is not None else {p.name for p in placements}
        shares = self.gather(digest_shares(table, placements, views, owned))
        return combine_digest(list(table), [s for rank in shares for s in rank])
