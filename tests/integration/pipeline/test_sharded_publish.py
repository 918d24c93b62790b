"""Sharded publishing with real torch.distributed (gloo, CPU, spawned ranks) and FSDP2 on the tiny
Qwen3: replay is bit-exact against the gathered state, a killed rank leaves no half version, and a
restarted job at another world size resumes from the store."""

from __future__ import annotations

import os
import signal
import tempfile
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from deltarl.storage import LocalStore

pytestmark = [pytest.mark.torch, pytest.mark.slow]
KW = {"keyframe_interval": 3, "digest_interval": 2, "segment_bytes": 8192, "upload_workers": 2, "encode_threads": 1}


def _init(rank: int, world: int, init_file: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=timedelta(seconds=60))


def _model(seed: int):
    import torch
    from torch.distributed.fsdp import fully_shard

    from deltarl.model.build import ModelSpec, build_model

    model = build_model(ModelSpec(seed=seed))
    model.train()
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=3e-3)


def _train_step(model, opt, seed: int) -> None:
    import torch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 259, (2, 16), generator=g)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    opt.step()
    opt.zero_grad()


def _gathered(model) -> dict:
    import torch

    return {n: p.full_tensor().detach().to(torch.bfloat16).clone() for n, p in model.named_parameters()}


class NoKeyframeReads(LocalStore):
    """A local store that refuses to read keyframe parts (a rank that must not replay the run)."""

    def _refuse(self, key: str) -> None:
        if "-part-" in key:
            raise AssertionError(f"this rank read keyframe part {key}")

    def get(self, key: str) -> bytes:
        self._refuse(key)
        return super().get(key)

    def get_range(self, key: str, start: int, end: int | None = None) -> bytes:
        self._refuse(key)
        return super().get_range(key, start, end)

    def get_range_into(self, key: str, start: int, buf: Any) -> int:
        self._refuse(key)
        return super().get_range_into(key, start, buf)


def _worker(rank: int, world: int, tmp: str, mode: str, first_step: int, steps: int) -> None:
    import torch

    from deltarl.errors import ShardedPublishError
    from deltarl.pipeline.sharded import ShardedPublisher
    from deltarl.storage import LocalStore
    from deltarl.testing.faults import CrashAt
    from deltarl.testing.ranks import leave_process_group, traceback_to

    with traceback_to(Path(tmp, f"error-{mode}-{rank}.txt")):
        _init(rank, world, os.path.join(tmp, f"init-{mode}-{world}"))
        failed = False
        crash = CrashAt(first_step + steps - 1, "segments", 1) if mode == "crash" and rank == 1 else None
        model, opt = _model(seed=0)
        # a resuming job: only rank 0 replays the run; the others get their rows from it
        store = (NoKeyframeReads if mode == "resume" and rank else LocalStore)(os.path.join(tmp, "store"))
        with ShardedPublisher(store, "r", writer_id="job", on_progress=crash, **KW) as pub:
            for step in range(first_step, first_step + steps):
                if step:
                    _train_step(model, opt, seed=step)
                full = _gathered(model)  # collective: every rank
                try:
                    info = pub.publish_model(model, step)
                except ShardedPublishError as err:
                    Path(tmp, f"failed-{rank}.txt").write_text(str(err))
                    failed = True
                    break
                if rank == 0:
                    torch.save(full, os.path.join(tmp, f"full-{info.version}.pt"))
    leave_process_group(barrier=not failed)  # a failed version may mean a killed peer: no barrier then


def _spawn(world: int, tmp: Path, mode: str, first_step: int, steps: int) -> list[int | None]:
    from deltarl.testing.ranks import spawn_ranks

    codes = spawn_ranks(_worker, world, str(tmp), mode, first_step, steps)
    for err in sorted(tmp.glob(f"error-{mode}-*.txt")):
        pytest.fail(err.read_text())
    return codes


def _check_replays(tmp: Path, versions: range) -> None:
    import torch

    from deltarl.pipeline.replay import replay
    from deltarl.storage import LocalStore

    store = LocalStore(tmp / "store")
    for v in versions:
        want = torch.load(tmp / f"full-{v}.pt")
        got = replay(store, "r", v)
        assert sorted(got) == sorted(want)
        for name, t in want.items():
            assert torch.equal(got[name].view(torch.int16), t.view(torch.int16)), (v, name)


def test_fsdp2_versions_replay_bit_exact() -> None:
    world = 2
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        assert _spawn(world, tmp, "plain", 0, 5) == [0] * world
        _check_replays(tmp, range(5))  # keyframes at 0 and 3 (in parts), deltas, digests at 0, 2, 3, 4
        from deltarl.pipeline.reader import RunReader
        from deltarl.storage import LocalStore

        reader = RunReader(LocalStore(tmp / "store"), "r")
        manifest, _ = reader.manifest(3)
        assert manifest.keyframe is not None
        assert len(manifest.keyframe.parts) == world
        ranks = {ref.key.split("-r")[1][:3] for ref in reader.manifest(4)[0].segments}
        assert ranks == {f"{r:03d}" for r in range(world)}


def test_killed_rank_leaves_no_half_version_and_resume_at_other_world_size() -> None:
    from deltarl.pipeline.gc import gc
    from deltarl.pipeline.reader import RunReader
    from deltarl.storage import LocalStore

    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        codes = _spawn(3, tmp, "crash", 0, 4)  # rank 1 of 3 dies after its first segment of version 3
        assert codes[1] == -signal.SIGKILL
        assert (tmp / "failed-0.txt").exists(), "rank 0 fails the version"
        assert (tmp / "failed-2.txt").exists(), "rank 2 fails the version"
        reader = RunReader(LocalStore(tmp / "store"), "r")
        assert reader.last_committed() == 2
        assert not reader.has_manifest(3)
        _check_replays(tmp, range(3))
        # a new job of 2 ranks resumes the run (rank 0 replays the base and scatters each rank's rows;
        # rank 1 never reads a keyframe), under a new writer epoch
        for f in tmp.glob("failed-*.txt"):
            f.unlink()
        assert _spawn(2, tmp, "resume", 3, 3) == [0, 0]
        assert not [f.read_text() for f in tmp.glob("failed-*.txt")]
        _check_replays(tmp, range(6))
        manifest, _ = reader.manifest(3)
        assert manifest.keyframe is not None
        assert len(manifest.keyframe.parts) == 2
        keys = [ref.key for ref in [*reader.manifest(4)[0].segments, *manifest.keyframe.parts]]
        assert all("/e000002-" in k for k in keys), keys
        # what the killed job left of version 3 (epoch 1) is an orphan gc removes; the run stays whole
        report = gc(LocalStore(tmp / "store"), "r")
        assert all("/e000001-" in k for k in report.orphans), report.orphans
        assert not [k for k in LocalStore(tmp / "store").list("r/versions/000000000003/") if "/e000001-" in k]
        _check_replays(tmp, range(6))


def _local_worker(rank: int, world: int, tmp: str) -> None:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from deltarl.errors import ShardedPublishError
    from deltarl.pipeline.sharded import ShardedPublisher
    from deltarl.storage import LocalStore
    from deltarl.testing.ranks import leave_process_group, traceback_to

    with traceback_to(Path(tmp, f"error-local-{rank}.txt")):
        _init(rank, world, os.path.join(tmp, "init-local"))
        g = torch.Generator().manual_seed(0)
        full = {"a": torch.randn(10, 300, generator=g).bfloat16(), "b": torch.randn(3, generator=g)}
        fulls = []

        def shards(state: dict, bad: bool = False) -> dict:
            out = {}
            for name, t in state.items():
                per = -(-t.shape[0] // world)
                lo = min(per * rank, t.shape[0])
                hi = min(lo + per, t.shape[0])
                local = t[lo:hi].clone()
                out[name] = (local.float() if bad and name == "a" else local, tuple(t.shape), lo)
            return out

        store = LocalStore(os.path.join(tmp, "store"))
        with ShardedPublisher(store, "r", **KW) as pub:
            for step in range(4):
                if step:
                    full = {k: torch.where(torch.rand(v.shape, generator=g) < 0.1, v * 1.5, v).to(v.dtype) for k, v in full.items()}
                if step == 2:  # one rank hands over a float32 shard of a bfloat16 tensor: nobody commits
                    with pytest.raises(ShardedPublishError, match=r"rank 1: TensorMismatch|rank 0: RunError"):
                        pub.publish_local(shards(full, bad=rank == 1), step)
                    assert pub.next_version == 2
                if step == 3:  # a NaN among rank 2's changes: refused on every rank, nothing committed
                    poisoned = shards(full)
                    if rank == 2:
                        poisoned["a"][0][0, 0] = float("nan")
                    with pytest.raises(ShardedPublishError, match=r"rank 2: NonFiniteTensor: tensor 'a'"):
                        pub.publish_local(poisoned, step)
                    assert pub.next_version == 3
                pub.publish_local(shards(full), step)
                fulls.append(full)
            mesh = init_device_mesh("cpu", (world,))
            layer = torch.nn.Linear(4, 6)
            layer.weight = torch.nn.Parameter(distribute_tensor(layer.weight.data, mesh, [Shard(1)]))
            layer.bias = torch.nn.Parameter(distribute_tensor(layer.bias.data, mesh, [Shard(0)]))
            with pytest.raises(ShardedPublishError, match=r"'weight': placement Shard\(dim=1\)"):
                pub.publish_model(layer, 9)
            assert pub.next_version == 4
        if rank == 0:
            torch.save(fulls, os.path.join(tmp, "fulls.pt"))
    leave_process_group()


def _spawn_and_replay(worker: Any, world: int, name: str) -> None:
    """Run ``worker`` on ``world`` ranks (a traceback from any fails the test), then replay every
    version rank 0 saved in ``fulls.pt``, bit-exact."""
    import torch

    from deltarl.pipeline.replay import replay
    from deltarl.testing.ranks import spawn_ranks

    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        codes = spawn_ranks(worker, world, str(tmp))
        for err in sorted(tmp.glob(f"error-{name}-*.txt")):
            pytest.fail(err.read_text())
        assert codes == [0] * world
        fulls = torch.load(tmp / "fulls.pt")
        store = LocalStore(tmp / "store")
        for v, want in enumerate(fulls):
            got = replay(store, "r", v)
            for k in want:  # (reshaped: a 0-d tensor has no byte view)
                assert torch.equal(got[k].reshape(-1).view(torch.uint8), want[k].reshape(-1).view(torch.uint8)), (v, k)


def test_publish_local_and_a_failed_rank_fails_the_version_everywhere() -> None:
    _spawn_and_replay(_local_worker, 3, "local")


def _resume_worker(rank: int, world: int, tmp: str) -> None:
    import torch
    import torch.distributed as dist

    from deltarl.errors import ShardedPublishError
    from deltarl.pipeline import RunLayout
    from deltarl.pipeline.sharded import ShardedPublisher
    from deltarl.testing.ranks import leave_process_group, traceback_to

    with traceback_to(Path(tmp, f"error-resume-{rank}.txt")):
        _init(rank, world, os.path.join(tmp, "init-resume"))
        g = torch.Generator().manual_seed(0)
        fulls = [{"a": torch.randn(10, 300, generator=g).bfloat16(), "s": torch.randn((), generator=g)}]
        for _ in range(3):
            fulls.append({k: torch.where(torch.rand(v.shape, generator=g) < 0.1, v * 1.5, v).to(v.dtype)
                          for k, v in fulls[-1].items()})

        def shards(state: dict) -> dict:
            lo, hi = (0, 4) if rank == 0 else (4, 10)
            return {"a": (state["a"][lo:hi].clone(), (10, 300), lo),
                    "s": (state["s"].clone() if rank == 0 else torch.empty(0), (), 0)}  # the scalar: rank 0's

        store = LocalStore(os.path.join(tmp, "store"))
        with ShardedPublisher(store, "r", writer_id="first", **KW) as pub:
            for step in range(3):
                pub.publish_local(shards(fulls[step]), step)
        key = RunLayout("r").segment(2, 0, epoch=1, rank=1)
        good = store.get(key)
        if rank == 0:  # a damaged delta under HEAD: the new job's replay of its base fails
            store.put(key, good[:-1] + bytes([good[-1] ^ 1]))
        dist.barrier()
        with ShardedPublisher(store, "r", writer_id="second", **KW) as pub:
            with pytest.raises(ShardedPublishError, match=rf"resuming from version 2: IntegrityError: .*{key}"):
                pub.publish_local(shards(fulls[3]), 3)  # on every rank, named; nobody waits for rows
            assert pub.next_version == 3
            dist.barrier()
            if rank == 0:
                store.put(key, good)
            dist.barrier()
            wrong = shards(fulls[3])
            if rank == 1:  # rows 4..12 of a tensor the run has 10 rows of: nothing is sent, nobody waits
                wrong["a"] = (torch.cat([wrong["a"][0], wrong["a"][0][:2]]), (12, 300), 4)
            with pytest.raises(ShardedPublishError, match=r"rank 1 holds elements \[1200, 3600\) of tensor 'a', which has 3000"):
                pub.publish_local(wrong, 3)
            import deltarl.pipeline.shard_resume as shard_resume

            shard_resume.P2P_BACKENDS = frozenset()  # the rows go by scatter_object_list (NCCL's way) this time
            pub.publish_local(shards(fulls[3]), 3)  # every rank resumes again: rank 0 replays, scatters
            assert pub.next_version == 4
        if rank == 0:
            torch.save(fulls, os.path.join(tmp, "fulls.pt"))
    leave_process_group()


def test_resume_that_cannot_replay_fails_the_version_on_every_rank_then_resumes() -> None:
    _spawn_and_replay(_resume_worker, 2, "resume")
