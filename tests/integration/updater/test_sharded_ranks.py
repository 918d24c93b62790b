"""Two real ranks (gloo, spawned processes) each holding part of every tensor, kept at a run's
versions by :class:`~deltarl.updater.sharded.ShardedUpdater` (no vLLM needed): the
bootstrap and each update land on every rank (one version, or several at once), and a commit refused
on one rank leaves every rank bit-identical to the version before."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

R, C, TP = 256, 384, 2  # large enough for format 2's shard-grid cells


def _state(seed: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    return {"k": torch.randn(4, C, generator=gen).to(torch.bfloat16), "o": torch.randn(R, C, generator=gen).to(torch.bfloat16),
            "q": torch.randn(R, C, generator=gen).to(torch.bfloat16)}


def _part(t: Any, region: Any) -> Any:
    if region.kind == "rows":
        return t[region.start : region.stop].clone()
    if region.kind == "cols":
        return t[:, region.start : region.stop].clone()
    return t.clone()


def _rank(rank: int, world: int, root: str, case: str) -> None:
    import torch.distributed as dist

    from deltarl.testing.ranks import leave_process_group, traceback_to

    with traceback_to(Path(root) / f"rank{rank}.err"):
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["TEST_PORT"])
        dist.init_process_group("gloo", rank=rank, world_size=world)
        asyncio.run(_serve(rank, root, case))
    leave_process_group(0)


async def _serve(rank: int, root: str, case: str) -> None:
    import torch.distributed as dist

    from deltarl.actor.fetcher import Fetcher
    from deltarl.codec.tensors import TensorSpec
    from deltarl.errors import StagingError
    from deltarl.storage.open import open_store
    from deltarl.testing.vllm_runs import evolve
    from deltarl.updater.probe import Placement, Region
    from deltarl.updater.ranks import Ranks
    from deltarl.updater.sharded import ShardedUpdater

    states = [_state(0)]
    for v in (1, 2):
        states.append(evolve(states[-1], 0.02, seed=v))
    regions = {"q": Region("rows", rank * R // TP, (rank + 1) * R // TP, (R, C)),
               "o": Region("cols", rank * C // TP, (rank + 1) * C // TP, (R, C)), "k": Region("whole", 0, 4, (4, C))}
    views = {n: torch.zeros(r.local_shape, dtype=torch.bfloat16) for n, r in regions.items()}
    placements = [Placement(n, n, 0, views[n].numel(), r.shape, r) for n, r in regions.items()]
    table = [TensorSpec(n, "bfloat16", tuple(states[0][n].shape)) for n in sorted(states[0])]
    ranks = Ranks(dist.group.WORLD, rank, TP)
    ranks.cover(table, placements)
    store = open_store(str(Path(root) / "store"))
    async with Fetcher([store]) as fetcher:
        up = ShardedUpdater(views, placements, table, "r", fetcher, ranks, poll_wait_s=0.2)
        await up.bootstrap(0)
        assert all(torch.equal(views[n], _part(states[0][n], r)) for n, r in regions.items())
        want = 2 if case == "far" else 1
        up.start()
        if case == "far":  # "latest" two versions behind: the rank's part rebuilt from the keyframe
            up.catch_up_to(2)
        while up.staged is None or up.staged.version != want:
            await asyncio.sleep(0.05)
        if case == "refused" and rank == 1:  # this rank's weights moved under the staged update: its commit refuses
            changed = up.staged.update.changes()["q"][0]
            views["q"].view(-1).view(torch.int16)[int(changed[0])] ^= 0x5555
        before = {n: v.clone() for n, v in views.items()}
        try:
            up.commit()
            await up.confirm()
            assert case != "refused"
            assert all(torch.equal(views[n], _part(states[want][n], r)) for n, r in regions.items())
            assert ranks.engine_digest(table, placements, views) == _digest(states[want])
        except StagingError:
            assert case == "refused"
            assert all(torch.equal(views[n], before[n]) for n in views)  # every rank: bit-identical
            assert up.version == 0
        await up.close()
    store.close()


def _digest(state: dict[str, Any]) -> str:
    from deltarl.codec import state_digest

    return state_digest(state)


@pytest.mark.parametrize("case", ["ok", "refused", "far"])
def test_two_ranks_update_together_or_not_at_all(tmp_path: Path, case: str) -> None:
    import socket

    from deltarl.pipeline.publisher import Publisher
    from deltarl.storage.open import open_store
    from deltarl.testing.ranks import spawn_ranks
    from deltarl.testing.vllm_runs import evolve

    states = [_state(0)]
    for v in (1, 2):
        states.append(evolve(states[-1], 0.02, seed=v))
    store = open_store(str(tmp_path / "store"))
    with Publisher(store, "r", keyframe_interval=1000, digest_interval=1) as pub:
        for v, s in enumerate(states):
            pub.publish(s, v)
    store.close()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        os.environ["TEST_PORT"] = str(s.getsockname()[1])
    codes = spawn_ranks(_rank, TP, str(tmp_path), case, timeout_s=180)
    errors = [(tmp_path / f"rank{r}.err").read_text() for r in range(TP) if (tmp_path / f"rank{r}.err").exists()]
    assert codes == [0] * TP, errors
