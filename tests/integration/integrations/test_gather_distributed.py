"""gather_bf16 across two ranks (gloo on CPU): FSDP2 (DTensor) and FSDP1 shards give rank 0 the whole export."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.slow, pytest.mark.torch]


def _worker(rank: int, world: int, port: int, kind: str, out: str) -> None:
    import torch.distributed as dist

    from deltarl.integrations.gather import gather_bf16
    from deltarl.model.build import ModelSpec, build_model, export_bf16
    from deltarl.testing.ranks import leave_process_group

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        model = build_model(ModelSpec())
        want = export_bf16(model)
        if kind == "fsdp2":
            from torch.distributed.fsdp import fully_shard

            for layer in model.model.layers:
                fully_shard(layer)
            fully_shard(model)
        else:
            import warnings

            from torch.distributed.fsdp import FullyShardedDataParallel
            from torch.distributed.fsdp.wrap import ModuleWrapPolicy
            from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer

            warnings.simplefilter("ignore")  # FSDP1 is deprecated in favour of fully_shard
            model = FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({Qwen3DecoderLayer}),
                                             device_id=torch.device("cpu"), use_orig_params=True)
        sharded = sum(p.numel() for p in model.parameters() if not hasattr(p, "full_tensor"))
        got = gather_bf16(model, is_main=rank == 0)
        report = {"rank": rank, "got": len(got), "local_numel": sharded}
        if rank == 0:
            report["names_equal"] = sorted(got) == sorted(want)
            report["bits_equal"] = all(torch.equal(got[n].view(torch.int16), want[n].view(torch.int16)) for n in want)
        Path(out, f"{rank}.json").write_text(json.dumps(report))
    except BaseException:
        dist.destroy_process_group()
        raise
    leave_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize("kind", ["fsdp2", "fsdp1"])
def test_every_rank_joins_and_rank_zero_gets_the_export(kind: str, tmp_path) -> None:
    import torch.multiprocessing as mp

    mp.spawn(_worker, args=(2, _free_port(), kind, str(tmp_path)), nprocs=2, join=True)
    r0, r1 = (json.loads((tmp_path / f"{r}.json").read_text()) for r in (0, 1))
    assert (r0["names_equal"], r0["bits_equal"]) == (True, True)
    assert r0["got"] == 24
    assert r1["got"] == 0
