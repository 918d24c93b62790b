"""``ShardedPublisher(serve_as="fp8-block128")`` with real torch.distributed (gloo, spawned ranks):
every version replays to the bits a one-process ``Publisher(serve_as=...)`` of the gathered state
publishes, for row splits not aligned to 128 rows, uneven and empty shards, world sizes 1 to 4
and a resume at another world size; a rank that fails before quantizing, or ranks that disagree
on ``serve_as``, fail on every rank and leave the run as it was."""

from __future__ import annotations

import os
import tempfile
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.torch, pytest.mark.slow]
KW: dict[str, Any] = {"keyframe_interval": 3, "digest_interval": 2, "segment_bytes": 4096, "upload_workers": 2,
                      "serve_as": "fp8-block128"}
NAMES = {
    "model.embed_tokens.weight": (300, 64),  # kept in BF16
    "model.layers.0.self_attn.q_proj.weight": (384, 200),
    "model.layers.0.mlp.down_proj.weight": (130, 300),  # partial blocks both ways
    "model.layers.0.mlp.gate.weight": (8, 128),  # an MoE router: kept in BF16
    "model.layers.0.input_layernorm.weight": (128,),
}
#: each rank's first row, as a fraction of a tensor's rows, by world size (rank 0 of 4 holds nothing)
CUTS = {1: [0.0], 2: [0.0, 0.37], 3: [0.0, 0.2, 0.95], 4: [0.0, 0.0, 0.5, 0.51]}


def exports(n: int) -> list[dict[str, Any]]:
    """``n`` BF16 exports of a training run: small steps everywhere, and an element that grows
    enough to move its block's scale (in a block that ranks split) every step."""
    import torch

    g = torch.Generator().manual_seed(7)
    master = {k: torch.randn(s, generator=g) * 0.02 for k, s in NAMES.items()}
    out = []
    for step in range(n):
        out.append({k: v.bfloat16() for k, v in master.items()})
        for v in master.values():
            v.add_(torch.randn(v.shape, generator=g) * 2e-4)
        master["model.layers.0.self_attn.q_proj.weight"][70 + 3 * step, step] *= 1.5
        master["model.layers.0.mlp.down_proj.weight"][120 + step, 290] *= 1.5
    return out


def bounds(rows: int, world: int, rank: int) -> tuple[int, int]:
    starts = [int(rows * f) for f in CUTS[world]] + [rows]
    return starts[rank], starts[rank + 1]


def shards(state: dict[str, Any], world: int, rank: int) -> dict[str, tuple[Any, tuple[int, ...], int]]:
    out = {}
    for name, t in state.items():
        lo, hi = bounds(t.shape[0], world, rank)
        out[name] = (t[lo:hi].clone(), tuple(t.shape), lo)
    return out


def _init(rank: int, world: int, init_file: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))


def _worker(rank: int, world: int, tmp: str, first: int, steps: int, refusals: bool) -> None:
    import torch

    from deltarl.errors import ShardedPublishError
    from deltarl.pipeline.sharded import ShardedPublisher
    from deltarl.storage import LocalStore
    from deltarl.testing.ranks import leave_process_group, traceback_to

    with traceback_to(Path(tmp, f"error-{first}-{rank}.txt")):
        _init(rank, world, os.path.join(tmp, f"init-{first}"))
        store = LocalStore(os.path.join(tmp, "store"))
        states = exports(first + steps)
        if refusals:  # rank 1 publishes BF16 while the others publish FP8: nobody opens the run
            wrong = {**KW, "serve_as": None if rank == 1 else KW["serve_as"]}
            with pytest.raises(ValueError, match=r"ranks disagree on serve_as"):
                ShardedPublisher(store, "r", writer_id="job", **wrong)
            assert not list(store.list("r/"))
        with ShardedPublisher(store, "r", writer_id="job", encode_threads=1, **KW) as pub:
            for step in range(first, first + steps):
                if refusals and step == 2:
                    _refusals(pub, states[step], world, rank)
                info = pub.publish_local(shards(states[step], world, rank), step, owned=step % 2 == 0)
                assert info.version == step
        del ShardedPublishError, torch
    leave_process_group()


def _refusals(pub: Any, state: dict[str, Any], world: int, rank: int) -> None:
    """Two versions every rank fails before anything is uploaded; the publisher stays usable."""
    import torch

    from deltarl.errors import ShardedPublishError

    name = "model.layers.0.self_attn.q_proj.weight"
    bad = shards(state, world, rank)
    if rank == 1:  # columns, not rows: refused before quantizing
        t, shape, lo = bad[name]
        bad[name] = (t[:, :100].clone(), shape, lo)
    with pytest.raises(ShardedPublishError, match=r"(?=.*rank 1: TensorMismatch: tensor 'model.layers.0.self_attn.q_proj)"
                                                  r"(?=.*ranks 0, 2: RunError: FP8 block scales not reduced: rank 1 failed)"):
        pub.publish_local(bad, 2)
    assert pub.next_version == 2
    bad = shards(state, world, rank)
    if rank == 2:  # a NaN in this rank's rows: no FP8 quantization, whatever allow_nonfinite says
        bad[name][0][-1, 0] = float("nan")
    with pytest.raises(ShardedPublishError, match=r"rank 2: NonFiniteTensor: tensor 'model.layers.0.self_attn"):
        pub.publish_local(bad, 2, allow_nonfinite=True)
    assert pub.next_version == 2
    del torch


def _run(tmp: Path, world: int, first: int, steps: int, refusals: bool = False) -> None:
    from deltarl.testing.ranks import spawn_ranks

    codes = spawn_ranks(_worker, world, str(tmp), first, steps, refusals)
    for err in sorted(tmp.glob(f"error-{first}-*.txt")):
        pytest.fail(err.read_text())
    assert codes == [0] * world


def _check_against_one_process(tmp: Path, n: int) -> None:
    """Every version replays to the bits of a one-process ``Publisher(serve_as=...)`` run of the
    gathered states (and of ``quantize_state``), and both runs have the same tensor table."""
    import torch

    from deltarl.codec.fp8 import quantize_state
    from deltarl.pipeline.publisher import Publisher
    from deltarl.pipeline.reader import RunReader
    from deltarl.pipeline.replay import replay
    from deltarl.storage import LocalStore, MemoryStore

    single = MemoryStore()
    states = exports(n)
    with Publisher(single, "r", **{k: v for k, v in KW.items() if k != "upload_workers"}) as pub:
        for step, state in enumerate(states):
            pub.publish(state, step)
    sharded = LocalStore(tmp / "store")
    assert RunReader(sharded, "r").info().tensors == RunReader(single, "r").info().tensors
    for v in range(n):
        got, want, direct = replay(sharded, "r", v), replay(single, "r", v), quantize_state(states[v])
        assert sorted(got) == sorted(want) == sorted(direct)
        for name in want:
            for other in (want[name], direct[name]):
                assert got[name].dtype == other.dtype, (v, name)
                assert torch.equal(got[name].reshape(-1).view(torch.uint8), other.reshape(-1).view(torch.uint8)), (v, name)


@pytest.mark.parametrize("world", [1, 2])
def test_sharded_fp8_replays_the_one_process_bits(world: int) -> None:
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        _run(tmp, world, 0, 5)  # keyframes 0 and 3, deltas 1, 2, 4
        _check_against_one_process(tmp, 5)


def test_refusals_fail_every_rank_then_a_resume_at_another_world_size() -> None:
    from deltarl.pipeline.reader import RunReader
    from deltarl.storage import LocalStore

    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        _run(tmp, 3, 0, 4, refusals=True)
        assert RunReader(LocalStore(tmp / "store"), "r").last_committed() == 3
        _run(tmp, 4, 4, 2)  # rank 0 replays the FP8 base and sends each rank its codes and scale rows
        _check_against_one_process(tmp, 6)


def _fsdp_worker(rank: int, world: int, tmp: str) -> None:
    import torch
    import torch.distributed as dist

    from deltarl.pipeline.sharded import ShardedPublisher
    from deltarl.storage import LocalStore
    from deltarl.testing.ranks import leave_process_group, traceback_to
    from tests.integration.pipeline.test_sharded_publish import _gathered, _model, _train_step

    with traceback_to(Path(tmp, f"error-fsdp-{rank}.txt")):
        _init(rank, world, os.path.join(tmp, "init-fsdp"))
        model, opt = _model(seed=0)
        fulls = []
        group = dist.new_group(backend="gloo")  # background publishing: a group of its own
        with ShardedPublisher(LocalStore(os.path.join(tmp, "store")), "r", group=group, encode_threads=1, **KW) as pub:
            for step in range(4):
                if step:
                    _train_step(model, opt, seed=step)
                fulls.append(_gathered(model))  # collective: every rank
                pub.publish_model_async(model, step)  # exported now; quantized, encoded, committed in the background
                assert pub.wait() is not None
        if rank == 0:
            torch.save(fulls, os.path.join(tmp, "fulls.pt"))
    leave_process_group()


def test_fsdp2_model_published_in_the_background_as_fp8() -> None:
    """FSDP2 shards of the tiny Qwen3 (rows split by FSDP, not at 128), ``publish_model_async``:
    every version replays to ``quantize_state`` of the gathered BF16 model."""
    import torch

    from deltarl.codec.fp8 import quantize_state
    from deltarl.pipeline.replay import replay
    from deltarl.storage import LocalStore
    from deltarl.testing.ranks import spawn_ranks

    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        codes = spawn_ranks(_fsdp_worker, 2, str(tmp))
        for err in sorted(tmp.glob("error-fsdp-*.txt")):
            pytest.fail(err.read_text())
        assert codes == [0, 0]
        fulls = torch.load(tmp / "fulls.pt")
        quantized = 0
        for v, full in enumerate(fulls):
            want, got = quantize_state(full), replay(LocalStore(tmp / "store"), "r", v)
            assert sorted(got) == sorted(want)
            quantized = sum(t.dtype == torch.float8_e4m3fn for t in got.values())
            for name, t in want.items():
                assert got[name].dtype == t.dtype, (v, name)
                assert torch.equal(got[name].reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)), (v, name)
        assert quantized > 0
